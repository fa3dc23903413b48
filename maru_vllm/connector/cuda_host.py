"""Register the pool's shared mapping with CUDA, so GPU copies to and from it are DMA.

A device<->host copy from ordinary (pageable) memory is staged by the CUDA driver through its
own pinned bounce buffer: two copies and a CPU in the loop. Registering the mapping
(`cudaHostRegister`, what `pin_memory()` does for memory CUDA allocates itself) pins its pages
and lets the copy engine read and write them directly, and lets LMCache's kernels address them
(zero-copy). The pool region is mapped by the pool client; a pool restart maps a new
incarnation at a new address, so `HostRegistry.ensure` registers whatever mapping a buffer
lives in, once, and unregisters mappings that are gone.

Only used when the KV cache is on CUDA; on CPU nothing here runs. `cudart` is
`torch.cuda.cudart()` (tests pass a named stand-in where CUDA does not exist).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every context, and a device
# pointer exists for the kernels (equal to the host pointer on UVA systems).
HOST_REGISTER_FLAGS = 0x01 | 0x02


def buffer_address(buf: Any) -> int:
    """Address of the first byte of a buffer-protocol object (memoryview into the region)."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.nbytes == 0:
        raise ValueError("empty buffer has no address")
    return torch.frombuffer(mv.cast("B") if mv.format != "B" else mv, dtype=torch.uint8).data_ptr()


class HostRegistry:
    """Which mappings are registered with CUDA; registers a mapping the first time it is used."""

    def __init__(self, cudart: Any = None) -> None:
        self._cudart = cudart
        self._lock = threading.Lock()
        self._ranges: dict[int, int] = {}  # base address -> size
        self.failed: set[int] = set()  # bases CUDA refused (copies still work, staged)

    @property
    def cudart(self) -> Any:
        if self._cudart is None:
            self._cudart = torch.cuda.cudart()
        return self._cudart

    def covers(self, address: int, size: int) -> bool:
        return any(b <= address and address + size <= b + s for b, s in self._ranges.items())

    def ensure(self, region_view: memoryview) -> bool:
        """Register the whole mapping `region_view` (the pool client's region view) if not yet."""
        base, size = buffer_address(region_view), region_view.nbytes
        with self._lock:
            if self.covers(base, size):
                return True
            if base in self.failed:
                return False
            # A mapping at an overlapping address is an old incarnation that was unmapped.
            for old in [b for b, s in self._ranges.items() if b < base + size and base < b + s]:
                self._unregister(old)
            rc = int(self.cudart.cudaHostRegister(base, size, HOST_REGISTER_FLAGS))
            if rc != 0:
                self.failed.add(base)
                logger.warning(
                    "cudaHostRegister of the pool region (%d bytes) failed with CUDA error %d; "
                    "GPU copies to and from the pool are staged, not DMA",
                    size,
                    rc,
                )
                return False
            self._ranges[base] = size
            logger.info("Pool region registered with CUDA (%d bytes at %#x): copies are DMA", size, base)
            return True

    def _unregister(self, base: int) -> None:
        self._ranges.pop(base, None)
        rc = int(self.cudart.cudaHostUnregister(base))
        if rc != 0:
            logger.debug("cudaHostUnregister(%#x) returned %d (mapping already gone)", base, rc)

    def close(self) -> None:
        with self._lock:
            for base in list(self._ranges):
                self._unregister(base)

    @property
    def registered(self) -> dict[int, int]:
        return dict(self._ranges)
