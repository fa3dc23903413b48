"""Typed forms of what the relay handles: pool events, pool snapshots, the block facts of one
pool object, and the per-block changes the relay announces to Dynamo.

Everything here is plain data. The wire shapes (events, snapshot pages, chunk metadata) are
defined once in `maru_vllm.pool.messages`; this module only decodes them with those types and
keeps what routing needs. Parsing is strict about structure and lenient about content that does
not concern routing (an object whose `meta` is not a MaruKVConnector chunk simply carries no
blocks and is never announced).
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from maru_vllm.pool import messages as M

ObjectId = tuple[str, str]  # (namespace, key hex): a pool object's identity

#: The lower tiers pool blocks may be announced at: host (CPU_PINNED, CPU) or disk-like (DISK, EXTERNAL, SHARED).
POOL_MEDIUMS = ("CPU_PINNED", "CPU", "DISK", "EXTERNAL", "SHARED")
#: Mediums Dynamo 1.6.1's router places in a tier (it drops events at any other).
KNOWN_MEDIUMS = ("GPU", *POOL_MEDIUMS)
#: Dynamo's host tier, which the frontend weights with --router-host-cache-hit-weight.
DEFAULT_MEDIUM = "CPU_PINNED"

#: A pool event or snapshot that does not have the documented structure.
EventFormatError = M.MessageError


@dataclasses.dataclass(frozen=True, slots=True)
class PoolChunk:
    """The vLLM blocks one pool object holds, from its MaruKVConnector metadata.

    `block_hashes` are raw vLLM `BlockHash` bytes (what the connector hex-encodes), in prompt
    order; `tokens` are the blocks' token ids back to back (`block_size` per block, uint32: a
    relay holds 10^6 chunks, and a list of Python ints costs several times the memory); `parent_block_hash` is the
    hash of the block before the first one (None for the first chunk of a prompt).
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    tokens: array.array
    block_size: int
    lora_name: str | None = None
    chunk_index: int = 0
    rank: int = 0

    @classmethod
    def from_meta(cls, meta: Any) -> PoolChunk | None:
        """Parse chunk metadata (raw JSON as events/snapshots carry it, a `ChunkMeta`, or a dict);
        None when `meta` is not (a supported version of) `messages.ChunkMeta`."""
        if isinstance(meta, PoolChunk):
            return meta  # parsed already (snapshots parse page by page, see PoolSnapshot.from_pages)
        try:
            cm = cls.chunk_meta(meta)
            tokens = array.array("I", itertools.chain.from_iterable(cm.token_ids))
        except (M.MessageError, OverflowError):
            return None
        return cls(
            tuple(bytes.fromhex(h) for h in cm.block_hashes),
            bytes.fromhex(cm.parent_block_hash) if cm.parent_block_hash else None,
            tokens,
            cm.block_size,
            cm.lora_name,
            cm.chunk,
            cm.rank,
        )

    def tokens_of(self, first: int, end: int) -> array.array:
        """The token ids of blocks first..end-1, flattened (a compact copy)."""
        return self.tokens[first * self.block_size : end * self.block_size]

    @staticmethod
    def chunk_meta(meta: Any) -> M.ChunkMeta:
        """`meta` as a validated `ChunkMeta`; MessageError naming the problem when it is not one."""
        if isinstance(meta, M.ChunkMeta):
            return meta
        if isinstance(meta, (msgspec.Raw, bytes, bytearray, memoryview)):
            return M.decode_chunk_meta(meta)
        try:
            return msgspec.convert(meta, M.ChunkMeta)
        except msgspec.ValidationError as exc:
            raise M.MessageError(f"not MaruKVConnector chunk metadata: {exc}") from None

    def parent_of(self, i: int) -> bytes | None:
        """The hash of the block before block `i` of this chunk."""
        return self.block_hashes[i - 1] if i > 0 else self.parent_block_hash


@dataclasses.dataclass(frozen=True, slots=True)
class PoolObject:
    """One committed pool object as a snapshot or an event describes it."""

    namespace: str
    key: str  # hex
    size: int
    meta: Any

    @property
    def oid(self) -> ObjectId:
        return (self.namespace, self.key)

    @classmethod
    def from_info(cls, o: M.ObjectInfo, parse: bool = False) -> PoolObject:
        """`parse`: keep the parsed `PoolChunk` instead of the raw metadata when it is one (a
        snapshot of 10^6 objects then never holds all their JSON at once)."""
        meta: Any = o.meta
        if parse:
            meta = PoolChunk.from_meta(meta) or meta
        return cls(sys.intern(o.namespace), o.key, o.size, meta)


@dataclasses.dataclass(frozen=True)
class PoolEvent:
    """`{"type": "stored"|"removed", "seq", "incarnation", "pool", "namespace", "key", "size", "meta"}`."""

    type: str
    seq: int
    incarnation: str
    pool: str
    obj: PoolObject

    @classmethod
    def from_msg(cls, m: M.PoolEventMsg) -> PoolEvent:
        return cls(m.type, m.seq, m.incarnation, m.pool, PoolObject(m.namespace, m.key, m.size, m.meta))

    @classmethod
    def from_json(cls, data: bytes) -> PoolEvent:
        return cls.from_msg(M.decode_event(data))


@dataclasses.dataclass(frozen=True)
class PoolSnapshot:
    """`{"pool", "incarnation", "seq", "objects": [...]}`: the object set as of event `seq`."""

    pool: str
    incarnation: str
    seq: int
    objects: tuple[PoolObject, ...]

    @classmethod
    def from_pages(cls, pages: Iterable[M.SnapshotPage]) -> PoolSnapshot:
        """Join pages into one snapshot; its `seq` is the first page's (see `SnapshotPage`)."""
        first: M.SnapshotPage | None = None
        objects: list[PoolObject] = []
        for page in pages:
            if first is None:
                first = page
            elif page.incarnation != first.incarnation:
                raise EventFormatError(
                    f"pool restarted during the snapshot ({first.incarnation} -> {page.incarnation})"
                )
            objects.extend(PoolObject.from_info(o, parse=True) for o in page.objects)
        if first is None:
            raise EventFormatError("empty snapshot: no page")
        return cls(first.pool, first.incarnation, first.seq, tuple(objects))


@dataclasses.dataclass(frozen=True)
class BlocksStored:
    """Announce: these consecutive blocks now exist at the pool's tier."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: Sequence[int]  # flattened, len == block_size * len(block_hashes)
    block_size: int
    lora_name: str | None = None


@dataclasses.dataclass(frozen=True)
class BlocksRemoved:
    """Announce: these blocks no longer exist at the pool's tier."""

    block_hashes: tuple[bytes, ...]


Announcement = BlocksStored | BlocksRemoved
