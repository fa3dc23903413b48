"""Typed forms of what the relay handles: pool events, pool snapshots, the block facts of one
pool object, and the per-block changes the relay announces to Dynamo.

Everything here is plain data. The wire shapes (events, snapshot pages, chunk metadata) are
defined once in `maru_vllm.pool.messages`; this module only decodes them with those types and
keeps what routing needs. Parsing is strict about structure and lenient about content that does
not concern routing (an object whose `meta` is not a MaruKVConnector chunk simply carries no
blocks and is never announced).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

from maru_vllm.pool import chunk_codec
from maru_vllm.pool import messages as M

ObjectId = tuple[str, str]  # (namespace, key hex): a pool object's identity

#: The lower tiers pool blocks may be announced at: host (CPU_PINNED, CPU) or disk-like (DISK, EXTERNAL, SHARED).
POOL_MEDIUMS = ("CPU_PINNED", "CPU", "DISK", "EXTERNAL", "SHARED")
#: Mediums Dynamo 1.6.1's router places in a tier (it drops events at any other).
KNOWN_MEDIUMS = ("GPU", *POOL_MEDIUMS)
#: Dynamo's host tier, which the frontend weights with --router-host-cache-hit-weight.
DEFAULT_MEDIUM = "CPU_PINNED"
#: Dynamo's disk tier (weighted with --router-disk-cache-hit-weight): where tier-2 credit announces.
TIER2_MEDIUM = "DISK"
#: How many tier-2 chunks a worker credits at most by default (`tier2_credit`; ~1.6 KiB each at 256 tokens).
DEFAULT_TIER2_CREDIT_CHUNKS = 16384

#: A pool event or snapshot that does not have the documented structure.
EventFormatError = M.MessageError


#: A block hash as vLLM writes it into its KV events (`vllm_format.external_hash`): with vLLM's
#: default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` the low 64 bits of the `BlockHash` as an int,
#: else the `BlockHash` bytes.
ExternalHash = int | bytes


def external_of_hex(h: str, int_hashes: bool) -> ExternalHash:
    """A hex-encoded vLLM `BlockHash` as vLLM announces it (see `ExternalHash`); ValueError when
    `h` is not hex of whole bytes."""
    raw = bytes.fromhex(h)
    if not raw or len(h) != 2 * len(raw):
        raise ValueError(f"not a hex block hash: {h!r}")
    return int.from_bytes(raw[-8:], "big") if int_hashes else raw


class _ChunkFacts(msgspec.Struct):
    """What a relay reads of `chunk_codec.ChunkMeta` JSON (the pool's canonical encoding), token ids
    left as raw JSON: parsing ~256 of them per chunk into Python ints was most of a resync."""

    v: int
    chunk: int
    block_size: int
    block_hashes: list[str]
    parent_block_hash: str | None
    token_ids: msgspec.Raw
    lora_name: str | None = None
    rank: int = 0
    cache_salt: str | None = None


_facts_decoder = msgspec.json.Decoder(_ChunkFacts)
_PARSE_GROUP = 1024  # chunks whose token ids are parsed in one pass


def _token_text(raw: bytes, blocks: int, block_size: int) -> bytes | None:
    """The token ids of `[[t, ...], ...]` (compact JSON: `blocks` lists of `block_size` ints) as
    one comma-separated run of ints; None when the lists do not have that shape."""
    if raw[:2] != b"[[" or raw[-2:] != b"]]":
        return None
    inner = raw[2:-2]
    per_block = inner.split(b"],[")
    if len(per_block) != blocks or any(b.count(b",") != block_size - 1 for b in per_block):
        return None
    return inner.replace(b"],[", b",")


def _parse_tokens(text: bytes, n: int) -> np.ndarray | None:
    """`n` comma-separated uint32 token ids as an array; None when `text` is anything else."""
    try:
        tokens = np.fromstring(text, dtype=np.int64, sep=",")
    except ValueError:
        return None
    if len(tokens) != n or (n and (tokens.min() < 0 or tokens.max() >= 1 << 32)):
        return None
    return tokens.astype(np.uint32)


@dataclasses.dataclass(frozen=True, slots=True)
class PoolChunk:
    """The vLLM blocks one pool object holds, from its MaruKVConnector metadata.

    `block_hashes` are the blocks' hashes as vLLM announces them (`ExternalHash`), in prompt
    order; `tokens` are the blocks' token ids back to back (`block_size` per block, uint32, as
    vLLM's events and Dynamo's router hold them); `parent_block_hash` is the hash of the block
    before the first one (None for the first chunk of a prompt). A chunk lives only while its
    store is announced: relays keep block keys, not chunks.
    """

    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    tokens: np.ndarray
    block_size: int
    lora_name: str | None = None
    chunk_index: int = 0
    rank: int = 0
    cache_salt: str | None = None

    @classmethod
    def from_meta(cls, meta: Any, int_hashes: bool = True) -> PoolChunk | None:
        """Parse chunk metadata (raw JSON as events/snapshots carry it, a `ChunkMeta`, or a dict);
        None when `meta` is not (a supported version of) `chunk_codec.ChunkMeta`. `int_hashes`:
        vLLM announces block hashes as ints (its default; see `ExternalHash`)."""
        return cls.many_from_meta([meta], int_hashes)[0]

    @classmethod
    def many_from_meta(cls, metas: Sequence[Any], int_hashes: bool = True) -> list[PoolChunk | None]:
        """`from_meta` of each of `metas`; the token ids of all raw JSON ones are parsed in one
        pass (a snapshot page: ~4x10^6 token ids)."""
        out: list[PoolChunk | None] = [None] * len(metas)
        raw: list[tuple[int, _ChunkFacts, tuple[ExternalHash, ...], ExternalHash | None, int]] = []
        texts: list[bytes] = []
        for i, meta in enumerate(metas):
            if isinstance(meta, PoolChunk):
                out[i] = meta
            elif isinstance(meta, bytes) and meta[:3] == M.BINARY_META_PREFIX:
                out[i] = cls.from_binary(meta, int_hashes)
            elif isinstance(meta, (msgspec.Raw, bytes, bytearray, memoryview)):
                try:
                    f = _facts_decoder.decode(meta)
                    if f.v not in chunk_codec.SUPPORTED_CHUNK_META_VERSIONS or f.block_size <= 0 or f.rank < 0:
                        continue
                    hashes = tuple(external_of_hex(h, int_hashes) for h in f.block_hashes)
                    parent = external_of_hex(f.parent_block_hash, int_hashes) if f.parent_block_hash else None
                except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
                    continue
                text = _token_text(bytes(f.token_ids), len(hashes), f.block_size) if hashes else None
                if text is not None:
                    raw.append((i, f, hashes, parent, len(hashes) * f.block_size))
                    texts.append(text)
            else:
                out[i] = cls._from_struct(meta, int_hashes)
        for lo in range(0, len(raw), _PARSE_GROUP):  # a group's text and arrays are a few MiB at most
            group = raw[lo : lo + _PARSE_GROUP]
            tokens = _parse_tokens(b",".join(texts[lo : lo + _PARSE_GROUP]), sum(r[4] for r in group))
            start = 0
            for (i, f, hashes, parent, n), text in zip(group, texts[lo : lo + _PARSE_GROUP]):
                mine = tokens[start : start + n] if tokens is not None else _parse_tokens(text, n)
                start += n
                if mine is not None:
                    out[i] = cls(hashes, parent, mine, f.block_size, f.lora_name, f.chunk, f.rank, f.cache_salt)
        return out

    @classmethod
    def from_binary(cls, data: bytes, int_hashes: bool = True) -> PoolChunk | None:
        """From binary chunk metadata (`chunk_codec`), sliced, never parsed token by token; None
        when it is not well-formed or of a format or version this code does not read."""
        try:
            lay = chunk_codec.Layout(data)
            lora = lay.lora_name(data)
            salt = lay.cache_salt(data)
        except M.MessageError:
            return None
        hashes: tuple[ExternalHash, ...] = tuple(lay.low64(data)) if int_hashes else tuple(lay.hashes(data))
        if lay.parent < 0:
            parent: ExternalHash | None = None
        elif int_hashes:
            parent = int.from_bytes(
                data[lay.parent + lay.hash_len - min(8, lay.hash_len) : lay.parent + lay.hash_len], "big"
            )
        else:
            parent = lay.parent_hash(data)
        return cls(hashes, parent, lay.token_array(data), lay.block_size, lora, lay.chunk, lay.rank, salt)

    @classmethod
    def _from_struct(cls, meta: Any, int_hashes: bool) -> PoolChunk | None:
        """From a `ChunkMeta` or a dict of one."""
        try:
            cm = cls.chunk_meta(meta)
            hashes = tuple(external_of_hex(h, int_hashes) for h in cm.block_hashes)
            parent = external_of_hex(cm.parent_block_hash, int_hashes) if cm.parent_block_hash else None
        except (M.MessageError, ValueError):
            return None
        tokens = np.array(list(itertools.chain.from_iterable(cm.token_ids)), dtype=np.int64)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= 1 << 32):
            return None
        return cls(
            hashes, parent, tokens.astype(np.uint32), cm.block_size, cm.lora_name, cm.chunk, cm.rank, cm.cache_salt
        )

    def tokens_of(self, first: int, end: int) -> np.ndarray:
        """The token ids of blocks first..end-1, flattened (a view)."""
        return self.tokens[first * self.block_size : end * self.block_size]

    @staticmethod
    def chunk_meta(meta: Any) -> chunk_codec.ChunkMeta:
        """`meta` as a validated `ChunkMeta`; MessageError naming the problem when it is not one."""
        if isinstance(meta, chunk_codec.ChunkMeta):
            return meta
        if isinstance(meta, (msgspec.Raw, bytes, bytearray, memoryview)):
            return chunk_codec.decode_chunk_meta(meta)
        try:
            return msgspec.convert(meta, chunk_codec.ChunkMeta)
        except msgspec.ValidationError as exc:
            raise M.MessageError(f"not MaruKVConnector chunk metadata: {exc}") from None

    def parent_of(self, i: int) -> ExternalHash | None:
        """The hash of the block before block `i` of this chunk."""
        return self.block_hashes[i - 1] if i > 0 else self.parent_block_hash


class PoolObject(NamedTuple):
    """One committed pool object as a snapshot or an event describes it (a named tuple: a
    resync makes one per pool object, and a tuple is the cheapest immutable record)."""

    namespace: str
    key: str  # hex
    size: int
    meta: Any

    @property
    def oid(self) -> ObjectId:
        return (self.namespace, self.key)

    @classmethod
    def from_info(cls, o: M.ObjectInfo) -> PoolObject:
        return cls(sys.intern(o.namespace), o.key, o.size, o.meta if o.bmeta is None else o.bmeta)


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
        meta = m.meta if m.bmeta is None else m.bmeta
        return cls(m.type, m.seq, m.incarnation, m.pool, PoolObject(m.namespace, m.key, m.size, meta))

    @classmethod
    def from_json(cls, data: bytes) -> PoolEvent:
        return cls.from_msg(M.decode_event(data))


@dataclasses.dataclass(frozen=True)
class PoolSnapshot:
    """The object set as of event `seq`, whole or one part of it (one pool page).

    A snapshot read page by page is handed on as parts `part` = 0, 1, ... with `last` set on the
    final one; every part carries the first page's `incarnation` and `seq` (see
    `messages.SnapshotPage`). `total`: the pool's object count when the first page was taken
    (a size hint, None when unknown). `full`: announce every block again, not only changes.
    """

    pool: str
    incarnation: str
    seq: int
    objects: tuple[PoolObject, ...]
    part: int = 0
    last: bool = True
    total: int | None = None
    full: bool = False

    @classmethod
    def from_page(cls, page: M.SnapshotPage, first: M.SnapshotPage, part: int, full: bool = False) -> PoolSnapshot:
        """Part `part` of the snapshot that began with page `first`."""
        if page.incarnation != first.incarnation:
            raise EventFormatError(f"pool restarted during the snapshot ({first.incarnation} -> {page.incarnation})")
        return cls(
            first.pool,
            first.incarnation,
            first.seq,
            tuple(PoolObject.from_info(o) for o in page.objects),
            part,
            page.next is None,
            first.total,
            full,
        )

    @classmethod
    def from_pages(cls, pages: Iterable[M.SnapshotPage]) -> PoolSnapshot:
        """Join pages into one snapshot; its `seq` is the first page's (see `SnapshotPage`)."""
        first: M.SnapshotPage | None = None
        objects: list[PoolObject] = []
        for page in pages:
            if first is None:
                first = page
            objects.extend(cls.from_page(page, first, 0).objects)
        if first is None:
            raise EventFormatError("empty snapshot: no page")
        return cls(first.pool, first.incarnation, first.seq, tuple(objects), total=first.total)


@dataclasses.dataclass(frozen=True)
class BlocksStored:
    """Announce: these consecutive blocks now exist at the pool's tier."""

    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: Sequence[int] | np.ndarray  # flattened, len == block_size * len(block_hashes)
    block_size: int
    lora_name: str | None = None
    cache_salt: str | None = None


@dataclasses.dataclass(frozen=True)
class BlocksRemoved:
    """Announce: these blocks no longer exist at the pool's tier."""

    block_hashes: tuple[ExternalHash, ...]


Announcement = BlocksStored | BlocksRemoved
