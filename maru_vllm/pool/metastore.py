"""Where a committed object's metadata lives: in this process, or in a region block of its own.

Metadata is kept as the bytes it arrives as (JSON, or binary chunk metadata). Without a `MetaIO`
it stays in the index's memory. With one (the service's region) it is not in the index's memory
at all: each object's metadata is written into a region block beside the payloads
(`[u32 length][u32 checksum][bytes]`, `records.MetaIO`) and read back from there for events and
snapshots; a block whose checksum no longer matches reads as no metadata (the object is then not
announced), never as other metadata. With a `Catalog` as well, every committed object gets that
block, its record after the metadata, and a catalog slot naming it, so a service started again
on the region can recover it (`catalog.py`, `recovery.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from maru_vllm.pool.allocator import Allocation
from maru_vllm.pool.catalog import NO_META, Catalog, encode_record, record_bytes
from maru_vllm.pool.records import META_HEADER, MetaIO, Obj

logger = logging.getLogger(__name__)

#: allocate `n` bytes of region space, evicting what must go; None when it cannot be had
AllocEvicting = Callable[[int], Allocation | None]


class MetadataStore:
    """Keeps and reads committed objects' metadata. Not thread-safe: the index's loop owns it."""

    def __init__(
        self,
        meta_io: MetaIO | None,
        catalog: Catalog | None,
        data_offset: int,
        alloc_evicting: AllocEvicting,
        counters: dict[str, int],
    ) -> None:
        """`catalog` counts only with `meta_io`. `counters`: the index's, where unreadable
        metadata is counted."""
        self.meta_io = meta_io
        self.catalog = catalog if meta_io is not None else None
        self.data_offset = data_offset
        self.alloc_evicting = alloc_evicting
        self.counters = counters

    def keep(self, obj: Obj, meta: bytes | None) -> bool:
        """Store `meta` for `obj` (its cseq already set); False when no region space is left
        for it. On success `obj.meta` is the bytes or the block, and with a catalog `obj.slot`
        names its catalog slot."""
        catalog = self.catalog
        if self.meta_io is None or (meta is None and catalog is None):
            obj.meta = meta
            return True
        if catalog is None:
            assert meta is not None
            block = self.alloc_evicting(META_HEADER + len(meta))
            if block is None:
                return False
            self.meta_io.write(self.data_offset + block.offset, meta)
            obj.meta = block
            return True
        meta_len = NO_META if meta is None else len(meta)
        block = self.alloc_evicting(record_bytes(obj.ns, obj.key, obj.parts, meta_len))
        if block is None:
            return False
        at = self.data_offset + block.offset
        self.meta_io.write(at, meta or b"")
        a = obj.alloc
        data = encode_record(
            obj.oid,
            obj.cseq,
            obj.size,
            obj.ns,
            obj.key,
            obj.parts,
            meta_len,
            (a.offset, a.capacity, a.slab.start_page if a.slab is not None else -1),
            (block.offset, block.capacity, block.slab.start_page if block.slab is not None else -1),
        )
        start = at + META_HEADER + max(meta_len, 0)
        self.meta_io.view[start : start + len(data)] = data
        obj.meta = block
        obj.meta_len = meta_len
        obj.slot = catalog.add(block.offset, obj.oid)  # last: the record is complete
        return True

    def read(self, obj: Obj) -> bytes | None:
        """The metadata `obj` was committed with (None: none, or its region block was damaged)."""
        meta = obj.meta
        if not isinstance(meta, Allocation):
            return meta
        if obj.meta_len == NO_META:
            return None
        assert self.meta_io is not None
        got = self.meta_io.read(self.data_offset + meta.offset, obj.meta_len)
        if got is None:
            self.counters["metadata_unreadable"] += 1
            logger.warning("metadata of %s/%s in the region is damaged; served without it", obj.ns, obj.key.hex())
        return got

    def forget(self, obj: Obj) -> None:
        """`obj` stops being visible: a restarted service must not bring it back."""
        if obj.slot >= 0:
            assert self.catalog is not None
            self.catalog.drop(obj.slot)
            obj.slot = -1
