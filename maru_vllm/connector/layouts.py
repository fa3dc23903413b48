"""Paged KV-cache layouts and the whole-page chunk codec.

A pool object holds one (chunk, rank): for every unique layer, the chunk's pages
back to back, layer after layer. A page is everything one block id addresses in
one layer (page_layout.py finds it from the tensor vLLM hands over), copied in its
storage order, so on the usual layouts a page is one ``memcpy`` and nothing is
scattered per token. A cache set given its format (`use_format`, what the worker
does) ends every object with the format trailer (object_format.py) and reads an
object only after checking it: the same format is copied as is, the same content
in another order is permuted while it is copied, anything else is a miss.

Std ``logging`` is used on purpose: ``import vllm.logger`` costs seconds and
thousands of modules, and these helpers are imported by light tools as well.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from maru_vllm.connector.converted_reads import convert_unpack, own_nbytes, unpack_heads
from maru_vllm.connector.object_format import (
    TRAILER_BYTES,
    HeadRange,
    ObjectFormat,
    format_of,
    read_format,
)
from maru_vllm.connector.page_copies import byte_tensor, copy_runs
from maru_vllm.connector.page_layout import LayoutError, LayoutMismatch, PageLayout, block_runs, layout_for_backend
from maru_vllm.connector.page_segments import PageSegments
from maru_vllm.native import copy_kernel
from maru_vllm.pool.objects import PayloadHasher, checksum_from_digest

logger = logging.getLogger(__name__)

__all__ = ["KVCacheSet"]

_SIGNATURE_VERSION = "maru-pages/v1"

# Bytes copied and then hashed at a time by a verifying unpack on the pure path (whole layers):
# small enough that a tile is still in cache when it is hashed, large enough that Python's
# per-tile cost stays small (benchmarks/profile_load.py compares tile sizes).
TILE_BYTES = 4 * 1024 * 1024


class KVCacheSet:
    """The registered caches of one rank, as a codec for whole-page chunks.

    Built from ``{layer_name: tensor}``; names aliasing one tensor view (same
    device, data_ptr, shape, stride, dtype) are stored once. When all unique
    layers are equal views of one storage at a constant layer stride (vLLM
    0.31's single allocation), every run of blocks is one strided copy across
    all layers instead of one per layer. On host memory, when every unique layer
    has one page geometry, copies go through the fused copy + checksum kernel
    (maru_vllm.native; page_segments.py plans them) unless it is missing or off.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        block_size: int,
        *,
        num_blocks: int | None = None,
        backend_name: str | None = None,
        block_dims: Mapping[str, int] | None = None,
    ) -> None:
        if not kv_caches:
            raise LayoutError("no KV cache layers to register")
        self.layer_names: tuple[str, ...] = tuple(kv_caches)
        self.aliases: dict[str, str] = {}
        seen: dict[tuple[Any, ...], str] = {}
        self.layouts: dict[str, PageLayout] = {}
        self._pages: dict[str, torch.Tensor] = {}
        for name, tensor in kv_caches.items():
            key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
            if key in seen:
                self.aliases[name] = seen[key]
                continue
            seen[key] = name
            self.aliases[name] = name
            try:
                hint = None if block_dims is None else block_dims.get(name)
                if hint is not None:
                    lay = PageLayout.detect(tensor, block_size, num_blocks=num_blocks, hint=hint)
                else:
                    lay = layout_for_backend(backend_name, tensor, block_size, num_blocks=num_blocks)
            except LayoutError as exc:
                raise type(exc)(f"layer {name!r}: {exc}") from exc
            self.layouts[name] = lay
            self._pages[name] = lay.pages(tensor)
        self.unique_layers: tuple[str, ...] = tuple(self.layouts)
        counts = {lay.num_blocks for lay in self.layouts.values()}
        if len(counts) != 1:
            raise LayoutError(f"layers disagree on num_blocks: {sorted(counts)}")
        self.num_blocks: int = counts.pop()
        self.bytes_per_block: int = sum(lay.page_nbytes for lay in self.layouts.values())
        self._stack = self._stacked_view()
        # Host caches with one page geometry: copies may go through the fused copy + checksum kernel.
        self._segments = PageSegments.build([self._pages[n] for n in self.unique_layers])
        self._signature = self._make_signature()
        # Set by `use_format`: objects then end with this trailer, and loads check it.
        self.format: ObjectFormat | None = None
        self._trailer = b""
        logger.debug("KV cache set: %s; one copy per run across layers: %s", self._signature, self._stack is not None)

    def _stacked_view(self) -> torch.Tensor | None:
        """``[L, num_blocks, *page]`` over all layers when they are equally spaced."""
        views = [self._pages[n] for n in self.unique_layers]
        if len(views) < 2:
            return None
        v0 = views[0]
        same = all(
            v.shape == v0.shape
            and v.stride() == v0.stride()
            and v.dtype == v0.dtype
            and v.device == v0.device
            and v.untyped_storage().data_ptr() == v0.untyped_storage().data_ptr()
            for v in views
        )
        if not same:
            return None
        step = views[1].data_ptr() - v0.data_ptr()
        if step <= 0 or step % v0.element_size():
            return None
        if any(b.data_ptr() - a.data_ptr() != step for a, b in itertools.pairwise(views)):
            return None
        return torch.as_strided(
            v0,
            (len(views), *v0.shape),
            (step // v0.element_size(), *v0.stride()),
            v0.storage_offset(),
        )

    def pages_of(self, layer: str) -> torch.Tensor:
        """The ``[num_blocks, *page]`` view of a unique layer's cache."""
        return self._pages[layer]

    @property
    def device(self) -> torch.device:
        """Device of the registered caches (every layer is on the same one)."""
        return self._pages[self.unique_layers[0]].device

    def chunk_nbytes(self, n_blocks: int) -> int:
        """Bytes of a pool object holding ``n_blocks`` blocks of every layer (and the trailer)."""
        return n_blocks * self.bytes_per_block + len(self._trailer)

    def use_format(self, heads: HeadRange) -> ObjectFormat:
        """From now on objects carry this cache set's format, and loads check the format they carry."""
        self.format = format_of([self.layouts[n] for n in self.unique_layers], self._signature, heads)
        self._trailer = self.format.trailer()
        return self.format

    def write_trailer(self, payload: Any) -> None:
        """Write the format trailer at the end of an object about to be filled (before it is hashed)."""
        if self._trailer:
            flat = byte_tensor(payload, writable=True)
            flat[-TRAILER_BYTES:].numpy()[:] = np.frombuffer(self._trailer, dtype=np.uint8)

    def written_format(self, payload: Any, what: str) -> ObjectFormat | None:
        """None when `payload` is in this cache set's own format (or formats are not in use), else
        the other format it is in and this cache set can read; LayoutMismatch naming both when it
        cannot (an older object, another dtype, head range or geometry)."""
        if not self._trailer:
            return None
        pin_bytes = isinstance(payload, memoryview) and payload.format == "B" and payload.ndim == 1
        if pin_bytes and payload.nbytes >= TRAILER_BYTES and payload[-TRAILER_BYTES:] == self._trailer:
            return None  # the hot path: a pool pin's bytes, in this engine's format
        flat = byte_tensor(payload, writable=False)
        if flat.numel() >= TRAILER_BYTES and flat[-TRAILER_BYTES:].numpy().tobytes() == self._trailer:
            return None
        assert self.format is not None
        try:
            written = read_format(flat)
        except LayoutMismatch as exc:
            raise LayoutMismatch(f"{what}: {exc}; this engine reads {self.format.describe()}") from None
        problem = self.format.conversion_problem(written)
        if problem is not None:
            raise LayoutMismatch(
                f"{what}: the object is {written.describe()}, this engine reads {self.format.describe()} ({problem})"
            )
        return written

    def layout_signature(self) -> str:
        """Geometry string for the namespace hash: equal iff objects are interchangeable.

        Per unique layer (run-length encoded): block dim, kernel-block group, dim
        order, page shape, dtype; plus the unique layer count. Not num_blocks.
        """
        return self._signature

    def _make_signature(self) -> str:
        parts: list[str] = []
        prev, count = "", 0
        for name in self.unique_layers:
            d = self.layouts[name].describe()
            if d == prev:
                count += 1
                continue
            if count:
                parts.append(f"{count}*({prev})")
            prev, count = d, 1
        parts.append(f"{count}*({prev})")
        return f"{_SIGNATURE_VERSION};layers={len(self.unique_layers)};" + ";".join(parts)

    def check_chunk(
        self, block_ids: Sequence[int], nbytes: int, what: str, skip_blocks: int = 0, chunk_blocks: int | None = None
    ) -> int:
        """The blocks in a chunk of ``nbytes`` holding ``block_ids`` after ``skip_blocks`` (or
        ``chunk_blocks`` of them); raises LayoutMismatch on a wrong size, IndexError on a block
        id outside the caches, ValueError when the blocks do not fit the chunk."""
        n = len(block_ids) + skip_blocks if chunk_blocks is None else chunk_blocks
        if n < len(block_ids) + skip_blocks:
            raise ValueError(
                f"{what}: blocks [{skip_blocks}, {skip_blocks + len(block_ids)}) are not all in a chunk of {n} blocks"
            )
        want = self.chunk_nbytes(n)
        if nbytes != want:
            raise LayoutMismatch(
                f"{what}: buffer has {nbytes} bytes, {n} blocks x "
                f"{self.bytes_per_block} bytes/block = {want} expected "
                f"({self._signature})"
            )
        for bid in block_ids:
            if not 0 <= int(bid) < self.num_blocks:
                raise IndexError(f"{what}: block id {bid} not in [0, {self.num_blocks})")
        return n

    def pack(self, block_ids: Sequence[int], out: Any) -> int:
        """Copy the pages of ``block_ids`` into ``out``; returns bytes written.

        ``out`` is a writable buffer (memoryview, bytearray, mmap, uint8 tensor)
        of exactly ``chunk_nbytes(len(block_ids))`` bytes.
        """
        self.pack_with_checksum(block_ids, out)
        return self.chunk_nbytes(len(block_ids))

    def pack_with_checksum(self, block_ids: Sequence[int], out: Any) -> int | None:
        """:meth:`pack`, returning the payload's checksum (`objects.payload_checksum`) when the
        fused kernel computed it in the copy, else None (the pure path: the pool client hashes)."""
        flat = byte_tensor(out, writable=True)
        n = self.check_chunk(block_ids, flat.numel(), "pack")
        self.write_trailer(flat)
        kernel = self._kernel()
        if kernel is not None and n:
            assert self._segments is not None
            digest = kernel.copy(flat.numpy(), self._segments.segments(block_ids, n), False)
            return None if digest is None else checksum_from_digest(digest)
        if self.device.type != "cpu" and n:
            self._staged_pack(block_ids, flat, n)
            return None
        copy_runs(self._pairs(flat, n), block_runs(block_ids), into_cache=False)
        return None

    def copy_path(self) -> str:
        """``native-<isa>`` when copies go through the fused kernel, else ``torch``."""
        kernel = self._kernel()
        return "torch" if kernel is None else f"native-{kernel.isa()}"

    def fused_plan(self) -> tuple[Any, PageSegments] | None:
        """The fused copy kernel and this cache set's segment planner, when its copies use them."""
        kernel = self._kernel()
        return None if kernel is None or self._segments is None else (kernel, self._segments)

    def _kernel(self) -> Any | None:
        """The fused copy kernel when this cache set can use it (host memory, one page geometry)."""
        return copy_kernel() if self._segments is not None else None

    def unpack(
        self,
        block_ids: Sequence[int],
        src: Any,
        *,
        skip_blocks: int = 0,
        chunk_blocks: int | None = None,
        hasher: Any = None,
    ) -> None:
        """Copy a chunk made by :meth:`pack` into the pages of ``block_ids``.

        With ``skip_blocks=k`` the chunk holds ``k + len(block_ids)`` blocks and
        its first ``k`` are not copied (the engine already has them locally).
        With ``chunk_blocks=n`` the chunk holds ``n`` blocks and only blocks
        ``[k, k + len(block_ids))`` are copied (a chunk shared in part: every
        layer's pages of those blocks, read out of the layer-major object).
        Raises :class:`LayoutMismatch` when ``src`` is not exactly the size this
        geometry expects (a stale or foreign object: treat as a miss).

        With ``hasher`` every byte of ``src`` is hashed, copied or not. A fresh
        :class:`~maru_vllm.pool.objects.PayloadHasher` on host caches gets the
        digest of the fused copy + checksum kernel (one pass over memory). Any other
        hasher (anything with ``update(buffer)``), or the pure path, is fed every byte
        in order, tile by tile, each tile right after it was copied, while it is still
        in cache. The caller compares the checksum and treats a mismatch as a miss.
        """
        if skip_blocks < 0:
            raise ValueError(f"skip_blocks={skip_blocks} must be >= 0")
        flat = byte_tensor(src, writable=False)
        n, written = self._check_object(block_ids, flat, "unpack", skip_blocks, chunk_blocks)
        if written is not None:
            self._convert_unpack(block_ids, flat, n, skip_blocks, written, hasher)
            return
        kernel = self._kernel()
        fused_hash = isinstance(hasher, PayloadHasher) and hasher.fresh
        if kernel is not None and n and (hasher is None or fused_hash):
            assert self._segments is not None
            segments = self._segments.segments(block_ids, n, skip_blocks)
            digest = kernel.copy(flat.numpy(), segments, True, hasher is not None)
            if hasher is not None:
                if digest is None:  # too short for the kernel's hash: the package hashes it
                    hasher.update(flat.numpy().data)
                else:
                    hasher.set_digest(digest)
            return
        if self.device.type != "cpu" and n:
            if hasher is not None:
                hasher.update(flat.numpy().data)
            self._staged_unpack(block_ids, flat, n, skip_blocks)
            return
        runs = block_runs(block_ids)
        if hasher is None:
            copy_runs(self._pairs(flat, n), runs, into_cache=True, skip_blocks=skip_blocks)
            return
        raw = flat.numpy().data if flat.numel() else memoryview(b"")  # ndarray.data: memoryview(ndarray)
        for lo, hi, tile_pairs in self._tiles(flat, n):
            copy_runs(tile_pairs, runs, into_cache=True, skip_blocks=skip_blocks)
            hasher.update(raw[lo:hi])
        if self._trailer:
            hasher.update(raw[n * self.bytes_per_block :])

    def _check_object(
        self, block_ids: Sequence[int], flat: torch.Tensor, what: str, skip_blocks: int, chunk_blocks: int | None
    ) -> tuple[int, ObjectFormat | None]:
        """`check_chunk` of an object in this cache set's format or one it reads (`written_format`),
        whose pages may hold more KV heads than this rank's: (blocks in the chunk, its format)."""
        written = self.written_format(flat, what)
        nbytes = flat.numel()
        if written is not None:
            nbytes = self._own_nbytes(nbytes, written)
        return self.check_chunk(block_ids, nbytes, what, skip_blocks, chunk_blocks), written

    def _own_nbytes(self, nbytes: int, written: ObjectFormat) -> int:

        return own_nbytes(self, nbytes, written)

    def _convert_unpack(
        self, block_ids: Sequence[int], flat: torch.Tensor, n: int, skip_blocks: int, written: ObjectFormat, hasher: Any
    ) -> None:

        convert_unpack(self, block_ids, flat, n, skip_blocks, written, hasher)

    def unpack_heads(self, block_ids: Sequence[int], srcs: Sequence[Any], *, skip_blocks: int = 0) -> None:
        """Copy a chunk written by ranks that split the KV heads finer than this one
        (converted_reads.unpack_heads)."""

        unpack_heads(self, block_ids, srcs, skip_blocks=skip_blocks)

    def staged_pack(self, block_ids: Sequence[int], out: Any) -> None:
        """:meth:`pack` for caches on a device, always through one buffer there (see below)."""
        flat = byte_tensor(out, writable=True)
        n = self.check_chunk(block_ids, flat.numel(), "pack")
        self.write_trailer(flat)
        if n:
            self._staged_pack(block_ids, flat, n)

    def staged_unpack(self, block_ids: Sequence[int], src: Any, *, skip_blocks: int = 0) -> None:
        """:meth:`unpack` (no hasher) for caches on a device, through one buffer there."""
        flat = byte_tensor(src, writable=False)
        n, written = self._check_object(block_ids, flat, "unpack", skip_blocks, None)
        if written is not None:
            self._convert_unpack(block_ids, flat, n, skip_blocks, written, None)
        elif n:
            self._staged_unpack(block_ids, flat, n, skip_blocks)

    def _staged_pack(self, block_ids: Sequence[int], flat: torch.Tensor, n: int) -> None:
        """Device caches: gather the pages into one object-shaped buffer on the device, then one
        contiguous copy to the host (a DMA when the region is registered). A copy per run and
        layer straight into host memory would be a small transfer each, staged by the driver."""
        stage = torch.empty(n * self.bytes_per_block, dtype=torch.uint8, device=self.device)
        copy_runs(self._pairs(stage, n), block_runs(block_ids), into_cache=False)
        flat[: stage.numel()].copy_(stage)

    def _staged_unpack(self, block_ids: Sequence[int], flat: torch.Tensor, n: int, skip_blocks: int) -> None:
        """Device caches: one contiguous copy of the object to the device, then a scatter of its
        pages there. Returns once the host object has been read (the pins may go)."""
        stage = torch.empty(n * self.bytes_per_block, dtype=torch.uint8, device=self.device)
        stage.copy_(flat[: stage.numel()])
        copy_runs(self._pairs(stage, n), block_runs(block_ids), into_cache=True, skip_blocks=skip_blocks)

    def _tiles(self, flat: torch.Tensor, n: int) -> list[tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """The chunk cut into consecutive byte ranges of about ``TILE_BYTES`` (whole layers),
        each with its (buffer view, cache pages view) pairs; the ranges cover every byte."""
        if n == 0:
            return []
        tiles: list[tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        if self._stack is not None:
            ((buf, cache),) = self._pairs(flat, n)  # [n, L, *page] both
            layers = len(self.unique_layers)
            layer_bytes = n * self.layouts[self.unique_layers[0]].page_nbytes
            per_tile = max(1, TILE_BYTES // max(1, layer_bytes))
            for l0 in range(0, layers, per_tile):
                l1 = min(layers, l0 + per_tile)
                tiles.append((l0 * layer_bytes, l1 * layer_bytes, [(buf[:, l0:l1], cache[:, l0:l1])]))
            return tiles
        off = 0
        current: list[tuple[torch.Tensor, torch.Tensor]] = []
        start = 0
        for pair, name in zip(self._pairs(flat, n), self.unique_layers):
            current.append(pair)
            off += n * self.layouts[name].page_nbytes
            if off - start >= TILE_BYTES:
                tiles.append((start, off, current))
                current, start = [], off
        if current:
            tiles.append((start, off, current))
        return tiles

    def _pairs(self, flat: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(buffer view, cache pages view) pairs, both indexed by block first."""
        if n == 0:
            return []
        flat = flat[: n * self.bytes_per_block]  # the pages, not the trailer
        if self._stack is not None:
            lay = self.layouts[self.unique_layers[0]]
            buf = flat.view(lay.dtype).view(len(self.unique_layers), n, *lay.page_shape)
            # Index blocks on dim 1 of both: move it first on both sides.
            return [(buf.transpose(0, 1), self._stack.transpose(0, 1))]
        pairs = []
        off = 0
        for name in self.unique_layers:
            lay = self.layouts[name]
            size = n * lay.page_nbytes
            buf = flat[off : off + size].view(lay.dtype).view(n, *lay.page_shape)
            pairs.append((buf, self._pages[name]))
            off += size
        return pairs
