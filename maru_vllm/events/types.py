"""Typed forms of what the relay handles: pool events, pool snapshots, the block facts of one
pool object, and the per-block changes the relay announces to Dynamo.

Everything here is plain data; parsing is strict about structure and lenient about content
that does not concern routing (an object whose `meta` is not a MaruKVConnector chunk simply
carries no blocks and is never announced).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

#: The `meta["v"]` values of MaruKVConnector chunk metadata this relay understands.
SUPPORTED_META_VERSIONS = frozenset({1})

ObjectId = tuple[str, str]  # (namespace, key hex): a pool object's identity


class EventFormatError(ValueError):
    """A pool event or snapshot that does not have the documented structure."""


@dataclasses.dataclass(frozen=True)
class PoolChunk:
    """The vLLM blocks one pool object holds, from its MaruKVConnector metadata.

    `block_hashes` are raw vLLM `BlockHash` bytes (what the connector hex-encodes), in prompt
    order; `token_ids[i]` are the `block_size` tokens of block i; `parent_block_hash` is the
    hash of the block before the first one (None for the first chunk of a prompt).
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[tuple[int, ...], ...]
    block_size: int
    lora_name: str | None = None
    chunk_index: int = 0
    rank: int = 0

    @classmethod
    def from_meta(cls, meta: Any) -> PoolChunk | None:
        """Parse chunk metadata; None when `meta` is not (a supported version of) it."""
        if not isinstance(meta, Mapping) or meta.get("v") not in SUPPORTED_META_VERSIONS:
            return None
        try:
            hashes = tuple(bytes.fromhex(h) for h in meta["block_hashes"])
            parent_hex = meta.get("parent_block_hash")
            parent = bytes.fromhex(parent_hex) if parent_hex else None
            block_size = int(meta["block_size"])
            tokens = tuple(tuple(int(t) for t in block) for block in meta["token_ids"])
            lora = meta.get("lora_name")
            chunk = int(meta.get("chunk", 0))
            rank = int(meta.get("rank", 0) or 0)
        except (KeyError, TypeError, ValueError):
            return None
        if not hashes or block_size <= 0 or len(tokens) != len(hashes):
            return None
        if any(len(block) != block_size for block in tokens) or any(not h for h in hashes):
            return None
        if lora is not None and not isinstance(lora, str):
            return None
        return cls(hashes, parent, tokens, block_size, lora, chunk, rank)

    def parent_of(self, i: int) -> bytes | None:
        """The hash of the block before block `i` of this chunk."""
        return self.block_hashes[i - 1] if i > 0 else self.parent_block_hash


@dataclasses.dataclass(frozen=True)
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
    def from_dict(cls, d: Mapping[str, Any]) -> PoolObject:
        try:
            return cls(str(d["namespace"]), str(d["key"]), int(d.get("size", 0)), d.get("meta"))
        except (KeyError, TypeError, ValueError) as exc:
            raise EventFormatError(f"bad pool object {d!r}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class PoolEvent:
    """`{"type": "stored"|"removed", "seq", "incarnation", "pool", "namespace", "key", "size", "meta"}`."""

    type: str
    seq: int
    incarnation: str
    pool: str
    obj: PoolObject

    @classmethod
    def from_dict(cls, d: Any) -> PoolEvent:
        if not isinstance(d, Mapping):
            raise EventFormatError(f"pool event is not an object: {d!r}")
        kind = d.get("type")
        if kind not in ("stored", "removed"):
            raise EventFormatError(f"pool event type {kind!r} is not 'stored' or 'removed'")
        try:
            seq = int(d["seq"])
            incarnation = str(d["incarnation"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EventFormatError(f"pool event without a valid seq/incarnation: {exc}") from None
        return cls(kind, seq, incarnation, str(d.get("pool", "")), PoolObject.from_dict(d))

    @classmethod
    def from_json(cls, data: bytes) -> PoolEvent:
        try:
            return cls.from_dict(msgspec.json.decode(data))
        except msgspec.DecodeError as exc:
            raise EventFormatError(f"pool event is not JSON: {exc}") from None


@dataclasses.dataclass(frozen=True)
class PoolSnapshot:
    """`{"pool", "incarnation", "seq", "objects": [...]}`: the object set as of event `seq`."""

    pool: str
    incarnation: str
    seq: int
    objects: tuple[PoolObject, ...]

    @classmethod
    def from_dict(cls, d: Any) -> PoolSnapshot:
        if not isinstance(d, Mapping):
            raise EventFormatError(f"pool snapshot is not an object: {d!r}")
        if "error" in d:
            raise EventFormatError(f"pool answered the snapshot request with an error: {d['error']}")
        try:
            return cls(str(d.get("pool", "")), str(d["incarnation"]), int(d["seq"]),
                       tuple(PoolObject.from_dict(o) for o in d["objects"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise EventFormatError(f"bad pool snapshot: {exc}") from None


@dataclasses.dataclass(frozen=True)
class BlocksStored:
    """Announce: these consecutive blocks now exist at the pool's tier."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]  # flattened, len == block_size * len(block_hashes)
    block_size: int
    lora_name: str | None = None


@dataclasses.dataclass(frozen=True)
class BlocksRemoved:
    """Announce: these blocks no longer exist at the pool's tier."""

    block_hashes: tuple[bytes, ...]


Announcement = BlocksStored | BlocksRemoved


def flatten(blocks: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(t for block in blocks for t in block)
