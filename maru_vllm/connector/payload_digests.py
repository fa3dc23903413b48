"""Payload digests of a step's chunks, computed on several host threads at once.

On a GPU a chunk moves between the device and the pool region by DMA at memory speed, and the
payload checksum (XXH3-64 on the host, `pool.objects`) is then what bounds a load or a store.
The compiled hash (`maru_vllm.native`) runs without the GIL, so the chunks of one step are
hashed side by side, and beside the copies. Without the compiled module the `xxhash` package
hashes on the caller's thread (it holds the GIL: more threads would not help); both give the
same XXH3-64.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Any

import xxhash

from maru_vllm.native import copy_kernel

# Threads hashing at once, per process: a GPU worker's host has cores to spare during a
# forward, and eight already bring a 1 GiB step's checksums under its DMA time.
MAX_HASH_THREADS = 8


@functools.cache
def _executor() -> concurrent.futures.ThreadPoolExecutor:
    threads = max(1, min(MAX_HASH_THREADS, os.cpu_count() or 1))
    return concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="maru-hash")


def _digest(kernel: Any, payload: memoryview) -> int:
    digest = kernel.hash(payload) if kernel is not None else None
    return xxhash.xxh3_64_intdigest(payload) if digest is None else int(digest)


class PayloadDigests:
    """XXH3-64 digests of payloads handed in one by one, in the order they were handed in.

    `add` starts a payload's hash (on a hashing thread when the compiled hash is there) and
    returns at once; `results` waits for every hash. The payloads must not change until then,
    and a caller that releases them (unpins a pool object) calls `results` first.
    """

    def __init__(self) -> None:
        self._kernel = copy_kernel()
        self._pending: list[concurrent.futures.Future[int] | int | None] = []

    def add(self, payload: memoryview | None) -> None:
        """Hash `payload`; None keeps its place with no digest (a payload not to be hashed)."""
        if payload is None:
            self._pending.append(None)
        elif self._kernel is None:
            self._pending.append(_digest(None, payload))
        else:
            self._pending.append(_executor().submit(_digest, self._kernel, payload))

    def wait(self) -> None:
        """Until every hash has finished reading its payload (before the payloads go)."""
        concurrent.futures.wait([p for p in self._pending if isinstance(p, concurrent.futures.Future)])

    def results(self) -> list[int | None]:
        """Every digest (None where none was asked for), once all hashes have finished."""
        return [p.result() if isinstance(p, concurrent.futures.Future) else p for p in self._pending]
