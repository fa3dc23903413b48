"""A warm restart: the index rebuilt from the region a previous service left behind.

`recover` runs once, in a new service, before it listens (so no client sees a half-built index)
and after the region's header names the new incarnation (so a client of the old service that
is still mid-write finds its reservation stale, `Region.serves_incarnation`):

1. every set catalog slot (catalog.py) names a record block; the record must lie inside the heap
   and verify (its metadata's checksum, its identity's checksum, the slot's oid);
2. the object the record describes must verify as a reader would check it (objects.py): the
   header's magic, oid, length and key digest, a checksum, and the payload against it - so an
   object whose bytes cannot be vouched for is never served again;
3. of two records of one key the later commit wins; blocks the allocator cannot claim again
   (out of bounds, claimed twice, overlapping) drop their objects;
4. the kept objects' blocks are claimed where they are (`Allocator.restore`), every other slot
   is emptied, and the index takes the objects (`PoolIndex.restore`, which refills the
   presence table). Everything else - torn, unverifiable, half-written, reserved but never
   committed - is free space.

Nothing a record says is trusted before it is checked; a record that does not parse is dropped
like any other that does not verify.

Speed: the rebuild makes millions of small containers (an object's part keys each get an entry)
and none of them is cyclic garbage, so Python's cyclic collector is paused while it runs; left on,
its collections re-scan everything built so far and take about a third of the rebuild at 10^5
chunks (`benchmarks/bench_restarts.py`, the pool-warm case, reports the rebuild time).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import struct
import time
from collections.abc import Iterator
from typing import Any

import xxhash

from maru_vllm.native import copy_kernel
from maru_vllm.pool.allocator import Allocation, Allocator
from maru_vllm.pool.catalog import NO_META, Catalog, Identity, decode_identity
from maru_vllm.pool.index import PoolIndex
from maru_vllm.pool.objects import OBJ_HEADER_SIZE, checksum_from_digest, expected_checksum, key_digest, validate
from maru_vllm.pool.protocol import MAX_META_BYTES
from maru_vllm.pool.records import META_HEADER, MetaIO

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RecoveryReport:
    """What one recovery found: objects kept, records dropped (by reason), how long it took."""

    records: int = 0  # catalog slots that were set
    recovered: int = 0
    recovered_bytes: int = 0  # payload bytes of the recovered objects
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    clean_stop: bool | None = None  # whether the previous service stopped cleanly

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def line(self) -> str:
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.dropped.items(), key=lambda kv: -kv[1]))
        return (
            f"recovered {self.recovered} of {self.records} objects ({self.recovered_bytes} payload bytes) in "
            f"{self.seconds:.2f} s; dropped {self.dropped_total}{f' ({why})' if why else ''}; the last service "
            + ("stopped cleanly" if self.clean_stop else "did not stop cleanly")
        )


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, back on after it if it was on."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@_collector_paused()
def recover(
    view: memoryview,
    heap_offset: int,
    heap_bytes: int,
    catalog: Catalog,
    allocator: Allocator,
    index: PoolIndex,
    oid_floor: int,
) -> RecoveryReport:
    """Rebuild `index` (fresh, as are `allocator` and the presence table) from the region `view`
    whose heap is `heap_bytes` at `heap_offset` (see module docstring), the cyclic collector paused."""
    t0 = time.perf_counter()
    report = RecoveryReport()
    dropped: collections.Counter[str] = collections.Counter()
    meta_io = MetaIO(view)
    kernel = copy_kernel()  # looked up once: it hashes each payload without the GIL
    newest: dict[tuple[str, bytes], tuple[Identity, int]] = {}
    for slot, at, oid in catalog.entries():
        report.records += 1
        try:
            found = _verified(view, meta_io, kernel, heap_offset, heap_bytes, at, oid, oid_floor)
        except (struct.error, ValueError, UnicodeDecodeError) as exc:  # bytes that do not parse
            found = f"unreadable record ({type(exc).__name__})"
        if isinstance(found, str):
            dropped[found] += 1
            continue
        key = (found.ns, found.key)
        other = newest.get(key)
        if other is not None:
            dropped["superseded by a later commit of the same key"] += 1
            if other[0].cseq > found.cseq:
                continue
        newest[key] = (found, slot)
    t_scan = time.perf_counter()
    candidates = list(newest.values())
    blocks: list[tuple[int, int, int]] = []
    for ident, _ in candidates:
        p, r = ident.payload, ident.record
        blocks += [(p.offset, p.capacity, p.slab), (r.offset, r.capacity, r.slab)]
    claimed = allocator.restore(blocks)
    kept: list[tuple[Identity, Allocation, Allocation, int]] = []
    for i, (ident, slot) in enumerate(candidates):
        payload, record = claimed[2 * i], claimed[2 * i + 1]
        if payload is None or record is None:
            dropped["blocks that cannot be claimed again"] += 1
            for a in (payload, record):
                if a is not None:
                    allocator.free(a)
            continue
        kept.append((ident, payload, record, slot))
        report.recovered_bytes += ident.size
    catalog.keep_only([slot for *_, slot in kept])
    t_claim = time.perf_counter()
    index.restore(kept, oid_floor)
    report.recovered = len(kept)
    report.dropped = dict(dropped)
    report.seconds = time.perf_counter() - t0
    logger.debug(
        "recovery: records verified in %.2f s, blocks claimed in %.2f s, index built in %.2f s",
        t_scan - t0,
        t_claim - t_scan,
        t0 + report.seconds - t_claim,
    )
    return report


def _verified(
    view: memoryview,
    meta_io: MetaIO,
    kernel: Any | None,
    heap_offset: int,
    heap_bytes: int,
    at: int,
    oid: int,
    oid_floor: int,
) -> Identity | str:
    """The identity of the object whose record is at heap offset `at`, once record and object
    verify; else why not."""
    heap_end = heap_offset + heap_bytes
    start = heap_offset + at
    if at < 0 or start + META_HEADER > heap_end:
        return "record outside the heap"
    meta_len = int.from_bytes(view[start : start + 4], "little")
    if meta_len > MAX_META_BYTES:
        return "metadata length out of bounds"
    if meta_io.read(start, meta_len) is None:
        return "metadata checksum mismatch"
    decoded = decode_identity(view, start + META_HEADER + meta_len, heap_end, meta_len)
    if isinstance(decoded, str):
        return decoded
    ident, end = decoded
    if ident.oid != oid or (oid_floor and oid >= oid_floor):
        return "record of another object"
    if ident.meta_len == NO_META and meta_len:
        return "record of another object"
    rec, pay = ident.record, ident.payload
    if rec.offset != at or at + rec.capacity > heap_bytes or end > start + rec.capacity:
        return "record block out of bounds"
    if pay.offset < 0 or pay.offset + pay.capacity > heap_bytes or OBJ_HEADER_SIZE + ident.size > pay.capacity:
        return "payload block out of bounds"
    head = heap_offset + pay.offset
    header = view[head : head + OBJ_HEADER_SIZE]
    payload = view[head + OBJ_HEADER_SIZE : head + OBJ_HEADER_SIZE + ident.size]
    problem = validate(
        header, payload, ident.oid, ident.size, key_digest(ident.ns, ident.key), check_crc=False, require_crc=True
    )
    if problem is not None:
        return _reason(problem)
    digest = kernel.hash(payload) if kernel is not None else None
    if digest is None:
        digest = xxhash.xxh3_64_intdigest(payload)
    if checksum_from_digest(digest) != expected_checksum(header):
        return "checksum mismatch"
    return ident


def _reason(problem: str) -> str:
    """`objects.validate`'s reason without the numbers (the report counts reasons)."""
    if problem.startswith("object id"):
        return "object id mismatch"
    if problem.startswith("length"):
        return "length mismatch"
    return problem
