"""The records the pool's index keeps: objects, sessions and their quotas, and metadata blocks.

`Obj` is one object of the index (reserved, committed or doomed), `Session` one client's
reservations and pins, `SessionLimits` the quotas `PoolIndex` enforces per session. `MetaIO`
reads and writes the region blocks that hold committed objects' metadata
(`[u32 length][u32 checksum][bytes]`): a block whose checksum no longer matches reads as no
metadata, never as other metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import xxhash

from maru_vllm.pool.allocator import Allocation
from maru_vllm.pool.messages import BINARY_META_PREFIX, NULL, ObjectInfo
from maru_vllm.pool.objects import OBJ_HEADER_SIZE


@dataclass(eq=False, slots=True)
class Obj:
    oid: int
    ns: str
    key: bytes
    size: int
    alloc: Allocation
    data_offset: int  # absolute region offset of the data area
    session: int
    # the committer's metadata (JSON or binary chunk metadata): its bytes, or the region block
    # holding them (PoolIndex.meta_of reads either)
    meta: bytes | Allocation | None = None
    meta_len: int = 0  # catalog.NO_META (-1): committed without metadata, its record block in `meta`
    parts: tuple[bytes, ...] = ()  # parts[i] names the first i + 1 units (see module docstring)
    committed: bool = False
    pins: int = 0
    doomed: bool = False
    cseq: int = 0  # commit order, the snapshot cursor
    slot: int = -1  # its catalog slot while visible (catalog.py), else -1

    @property
    def meta_cost(self) -> int:
        """Bytes this object counts against the metadata budget (key, metadata JSON, part keys)."""
        return len(self.key) + max(self.meta_len, 0) + sum(map(len, self.parts))

    @property
    def header_offset(self) -> int:
        return self.data_offset + self.alloc.offset

    @property
    def payload_offset(self) -> int:
        return self.header_offset + OBJ_HEADER_SIZE

    def info(self, meta: bytes | None) -> ObjectInfo:
        """This object as snapshots list it, with `meta` (`PoolIndex.meta_of`)."""
        if meta is not None and meta[:3] == BINARY_META_PREFIX:
            return ObjectInfo(self.ns, self.key.hex(), self.size, NULL, meta)
        return ObjectInfo(self.ns, self.key.hex(), self.size, NULL if meta is None else msgspec.Raw(meta))


META_HEADER = 8  # u32 length, u32 checksum (XXH3-64, low 32 bits) of the metadata bytes


class MetaIO:
    """Metadata bytes in region blocks: `view` is the region, offsets are absolute."""

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def write(self, at: int, meta: bytes) -> None:
        v = self.view
        v[at + META_HEADER : at + META_HEADER + len(meta)] = meta
        check = xxhash.xxh3_64_intdigest(meta) & 0xFFFFFFFF
        v[at : at + META_HEADER] = len(meta).to_bytes(4, "little") + check.to_bytes(4, "little")

    def read(self, at: int, length: int) -> bytes | None:
        """The `length` bytes written at `at`; None when the block no longer holds them."""
        v = self.view
        head = bytes(v[at : at + META_HEADER])
        if int.from_bytes(head[:4], "little") != length:
            return None
        meta = bytes(v[at + META_HEADER : at + META_HEADER + length])
        if xxhash.xxh3_64_intdigest(meta) & 0xFFFFFFFF != int.from_bytes(head[4:], "little"):
            return None
        return meta


@dataclass(slots=True)
class Session:
    sid: int
    client: str
    last_seen: float
    reservations: dict[int, Obj] = field(default_factory=dict)
    pins: dict[int, int] = field(default_factory=dict)  # oid -> pin count held by this session
    reserved_bytes: int = 0  # payload bytes of `reservations`
    pinned_bytes: int = 0  # payload bytes of the distinct objects in `pins`


@dataclass(frozen=True)
class SessionLimits:
    """Per-session quotas (payload bytes) and the cap on pins of one object; None: unlimited."""

    reserve_bytes: int | None = None
    pin_bytes: int | None = None
    pins_per_object: int | None = None
