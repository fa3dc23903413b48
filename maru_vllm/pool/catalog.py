"""The region's catalog and object records: what lets a restarted service find its objects again.

The index (index.py) lives in the service's memory and dies with it; payloads and their headers
(objects.py) live in the region and outlive it. So that a new service on the same region can
rebuild the index (a warm restart, recovery.py), the service keeps two more things in the region
for every object it makes visible:

* a **record block**, one small allocation beside the payloads: the object's metadata as
  `records.MetaIO` keeps it (`[u32 length][u32 checksum][bytes]`), followed by its identity - oid,
  commit order, size, namespace, key, part keys and where its two blocks lie - with a checksum of
  its own (`Identity`, `encode_identity`);
* a **catalog slot**, 16 bytes in a table between the presence table and the heap: the record
  block's heap offset + 1 and the oid. It is set once the record is complete and cleared the
  moment the object is hidden (evicted, removed, found corrupt), before any of its blocks can be
  handed out again.

A slot that is set therefore names a complete record of an object that was visible when the
service stopped. Whatever a crash interrupts - a record half written, a slot half set, a
reservation half filled - is a slot that is not set, or one whose record or object does not
verify; recovery trusts nothing it reads (bounds, checksums, the object header, the payload's
checksum) and frees what does not verify.

One writer: the service's loop. Slots are handed out from a high-water mark and reused from a
stack of freed ones (8 bytes each in the service), so an unused table costs the service no
memory. A pool with more visible objects than slots keeps serving; the objects past it are not
recoverable (`catalog_full` in stats).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from maru_vllm.pool.allocator import Allocation
from maru_vllm.pool.records import META_HEADER

SLOT_BYTES = 16
RECORD_FORMAT = 1  # the catalog + record layout; a region of another format is not recovered
NO_META = -1  # Identity.meta_len of an object committed without metadata

_MAGIC = b"MREC"
# magic, length (the whole identity), checksum (of the bytes after it), flags, oid, commit seq, size,
# payload block (heap offset, capacity, slab start page or -1), record block (likewise),
# namespace length, key length, part count, reserved; then namespace, key, parts ([u16 len][bytes])
_IDENT = struct.Struct("<4sIIIQQQQIiQIiHHHH")
_FLAG_META = 1
_PART_LEN = struct.Struct("<H")


def _check(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class BlockRef:
    """Where one allocation lies in the heap: what `Allocator.restore` needs to claim it again."""

    offset: int
    capacity: int
    slab: int  # the start page of its slab, or -1 for a page run

    @classmethod
    def of(cls, a: Allocation) -> BlockRef:
        return cls(a.offset, a.capacity, a.slab.start_page if a.slab is not None else -1)


@dataclass(frozen=True, slots=True)
class Identity:
    """What a record says about its object (everything the index needs besides the metadata)."""

    oid: int
    cseq: int
    size: int
    ns: str
    key: bytes
    parts: tuple[bytes, ...]
    meta_len: int  # NO_META: committed without metadata
    payload: BlockRef
    record: BlockRef


def record_bytes(ns: str, key: bytes, parts: Sequence[bytes], meta_len: int) -> int:
    """The size of the record block of such an object."""
    return META_HEADER + max(meta_len, 0) + identity_bytes(ns, key, parts)


def identity_bytes(ns: str, key: bytes, parts: Sequence[bytes]) -> int:
    return _IDENT.size + len(ns.encode()) + len(key) + sum(_PART_LEN.size + len(p) for p in parts)


def encode_identity(ident: Identity) -> bytes:
    p, r = ident.payload, ident.record
    return encode_record(
        ident.oid,
        ident.cseq,
        ident.size,
        ident.ns,
        ident.key,
        ident.parts,
        ident.meta_len,
        (p.offset, p.capacity, p.slab),
        (r.offset, r.capacity, r.slab),
    )


def encode_record(
    oid: int,
    cseq: int,
    size: int,
    ns: str,
    key: bytes,
    parts: Sequence[bytes],
    meta_len: int,
    payload: tuple[int, int, int],
    record: tuple[int, int, int],
) -> bytes:
    """`encode_identity` of the identity these fields make (the commit path: no objects built);
    `payload` and `record` are (heap offset, capacity, slab start page or -1)."""
    nsb = ns.encode()
    pack = _PART_LEN.pack
    tail = b"".join([nsb, key, *[pack(len(p)) + p for p in parts]]) if parts else nsb + key
    head = _IDENT.pack(
        _MAGIC,
        _IDENT.size + len(tail),
        0,
        _FLAG_META if meta_len != NO_META else 0,
        oid,
        cseq,
        size,
        *payload,
        *record,
        len(nsb),
        len(key),
        len(parts),
        0,
    )
    check = xxhash.xxh3_64()
    check.update(memoryview(head)[12:])
    check.update(tail)
    return head[:8] + (check.intdigest() & 0xFFFFFFFF).to_bytes(4, "little") + head[12:] + tail


def decode_identity(view: memoryview, at: int, limit: int, meta_len: int) -> tuple[Identity, int] | str:
    """The identity written at `at` and where it ends (it may not reach past `limit`); a reason
    string when there is none that verifies. `meta_len` is what the metadata header before it says."""
    if at + _IDENT.size > limit:
        return "record runs past its block"
    (magic, length, check, flags, oid, cseq, size, poff, pcap, pslab, roff, rcap, rslab, nsl, kl, nparts, _) = (
        _IDENT.unpack_from(view, at)
    )
    if magic != _MAGIC:
        return "no record magic"
    if length < _IDENT.size or at + length > limit:
        return "record length out of bounds"
    if _check(view[at + 12 : at + length]) != check:
        return "record checksum mismatch"
    pos = at + _IDENT.size
    ns = bytes(view[pos : pos + nsl]).decode()
    pos += nsl
    key = bytes(view[pos : pos + kl])
    pos += kl
    parts = []
    for _ in range(nparts):
        (n,) = _PART_LEN.unpack_from(view, pos)
        pos += _PART_LEN.size
        parts.append(bytes(view[pos : pos + n]))
        pos += n
    if pos != at + length:
        return "record fields do not add up to its length"
    ident = Identity(
        oid,
        cseq,
        size,
        ns,
        key,
        tuple(parts),
        meta_len if flags & _FLAG_META else NO_META,
        BlockRef(poff, pcap, pslab),
        BlockRef(roff, rcap, rslab),
    )
    return ident, pos


class Catalog:
    """The slot table at region offset `offset` (`slots` slots); offsets it holds are heap offsets."""

    def __init__(self, view: memoryview, offset: int, slots: int) -> None:
        self.offset = offset
        self.slots = slots
        self._table = view[offset : offset + slots * SLOT_BYTES].cast("Q")  # two words per slot
        self._next = 0  # slots below it have been handed out at least once
        self._free = array("Q")
        self.full_refusals = 0  # objects that got no slot (not recoverable)

    @staticmethod
    def table_bytes(slots: int) -> int:
        return slots * SLOT_BYTES

    @property
    def used(self) -> int:
        return self._next - len(self._free)

    def clear(self) -> None:
        """Empty every slot (a fresh region)."""
        self._table.cast("B")[:] = bytes(self.slots * SLOT_BYTES)
        self._next = 0
        self._free = array("Q")

    def add(self, record_offset: int, oid: int) -> int:
        """Name a complete record; its slot, or -1 when the table is full."""
        if self._free:
            slot = self._free.pop()
        elif self._next < self.slots:
            slot = self._next
            self._next += 1
        else:
            self.full_refusals += 1
            return -1
        t = self._table
        t[2 * slot + 1] = oid
        t[2 * slot] = record_offset + 1  # last: a slot with an offset has its oid
        return slot

    def drop(self, slot: int) -> None:
        if slot < 0:
            return
        self._table[2 * slot] = 0
        self._free.append(slot)

    def entries(self) -> list[tuple[int, int, int]]:
        """(slot, record heap offset, oid) of every set slot."""
        table = self._words()
        slots = np.flatnonzero(table[:, 0])
        return list(zip(slots.tolist(), (table[slots, 0] - 1).tolist(), table[slots, 1].tolist()))

    def keep_only(self, kept: Sequence[int]) -> None:
        """After recovery: the slots in `kept` stay set; every other one is emptied and free."""
        table = self._words()
        keep = np.zeros(self.slots, dtype=bool)
        keep[np.asarray(kept, dtype=np.int64)] = True
        table[~keep, 0] = 0
        top = int(np.flatnonzero(keep)[-1]) + 1 if len(kept) else 0
        free = np.flatnonzero(~keep[:top])[::-1]  # popped from the end: lowest slots first
        self._next = top
        self._free = array("Q", free.astype(np.uint64).tobytes())

    def _words(self) -> np.ndarray:
        return np.frombuffer(self._table, dtype=np.uint64).reshape(-1, 2)
