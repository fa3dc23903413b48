"""Chunk keys and per-chunk metadata, derived from vLLM's own block hashes.

A chunk is `blocks_per_chunk` consecutive KV blocks of one request. Its pool key is the vLLM
block hash of its last block (that hash already chains the whole prefix, so equal keys mean
equal prefixes) plus the name of the slice the object holds. Nothing here re-hashes tokens.

Slices. Every rank stores its own pages: the layers of its pipeline stage and the KV heads of
its tensor-parallel rank. A slice is named by what it holds, not by who wrote it - ``p<stage>h<lo>-<hi>``
(KV heads ``[lo, hi)``; MLA's latent, whole on every rank, is ``h0-1``) - so engines of any TP
size name the same heads the same way, and ranks that hold the same heads (MLA, or GQA with
fewer KV heads than ranks) write one object between them. A `Split` is every slice a chunk is
cut into by writers of one TP size; a reader looks a chunk up under its own split first and
then under the other TP sizes' (`splits_for`), and each rank reads the slices that hold its
heads: one object when the writer split coarser (a head range of it is read), several when it
split finer. Engines whose head count is unknown fall back to rank-named slices (``r<rank>``),
which only an engine of the same parallel layout reads.

Its part keys are the hashes of its other blocks (same slice suffix): part j names the chunk's
first j + 1 blocks, so a request that shares only the start of a chunk finds the object and
loads those blocks (the pool's part index, `PoolClient.lookup_parts` / `acquire_parts`).

The metadata committed with a chunk carries what a KV event needs per block - the block
hashes, the parent block hash, each block's token ids, the block size, the LoRA name, the cache salt - so the
pool's events can be turned into router events without re-deriving anything. Its shape and
version are defined once, as `maru_vllm.pool.chunk_codec.ChunkMeta`, which the event relay decodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgspec

from maru_vllm.pool.chunk_codec import CHUNK_META_VERSION as META_VERSION
from maru_vllm.pool.chunk_codec import ChunkMeta


def hash_bytes(block_hash: Any) -> bytes:
    """A block hash as key bytes: vLLM's `BlockHash` is bytes already; an int (tests use small
    ints as stand-ins) becomes 16 bytes, anything else its repr."""
    if isinstance(block_hash, bytes):
        return block_hash
    if isinstance(block_hash, int):
        return block_hash.to_bytes(16, "big", signed=True)
    return repr(block_hash).encode()


def chunk_key(block_hash: Any, slot: str | int) -> bytes:
    """The pool key of one slice of a chunk: a slice name (`Slice.name`), or a rank (``r<rank>``)."""
    name = f"r{slot}" if isinstance(slot, int) else slot
    return hash_bytes(block_hash) + b"/" + name.encode()


# The TP sizes whose splits a reader looks for besides its own (vLLM's TP sizes divide the KV
# head count or are a multiple of it; bigger ones are not tried).
WRITER_TP_SIZES = (1, 2, 4, 8, 16)


def rank_heads(total: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads ``[lo, hi)`` vLLM gives TP rank `tp_rank` of `tp_size`: ``total / tp`` each, or
    one replicated head when there are fewer heads than ranks."""
    total, tp_size = max(1, int(total)), max(1, int(tp_size))
    if total >= tp_size:
        per = total // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    head = tp_rank * total // tp_size
    return head, head + 1


@dataclasses.dataclass(frozen=True)
class Slice:
    """What one object of a chunk holds: pipeline stage `pp`'s layers, KV heads ``[lo, hi)``."""

    pp: int
    lo: int
    hi: int
    rank: int = -1  # >= 0: a rank-named slice (head count unknown)

    @property
    def name(self) -> str:
        return f"r{self.rank}" if self.rank >= 0 else f"p{self.pp}h{self.lo}-{self.hi}"

    def overlaps(self, other: Slice) -> bool:
        return self.pp == other.pp and self.lo < other.hi and other.lo < self.hi


@dataclasses.dataclass(frozen=True)
class Split:
    """The slices writers of TP size `writer_tp` cut a chunk into (pipeline stage major)."""

    writer_tp: int
    slices: tuple[Slice, ...]


def rank_split(ranks: int) -> Split:
    """Rank-named slices, one per rank of a TP x PP world (head count unknown)."""
    return Split(ranks, tuple(Slice(0, 0, 0, r) for r in range(max(1, ranks))))


def split_of(total_heads: int, writer_tp: int, pp: int, mla: bool) -> Split:
    ranges = [(0, 1)] if mla else sorted({rank_heads(total_heads, writer_tp, r) for r in range(writer_tp)})
    return Split(writer_tp, tuple(Slice(stage, lo, hi) for stage in range(max(1, pp)) for lo, hi in ranges))


def splits_for(total_heads: int, tp: int, pp: int, mla: bool) -> tuple[Split, ...]:
    """Every split a reader of TP size `tp` can read a chunk from, its own first (see module
    docstring); only its own, rank-named, when the head count is unknown (0)."""
    if total_heads <= 0:
        return (rank_split(tp * pp),)
    found = [split_of(total_heads, tp, pp, mla)]
    for w in WRITER_TP_SIZES:
        if total_heads % w and w % total_heads:
            continue
        split = split_of(total_heads, w, pp, mla)
        if all(split.slices != f.slices for f in found):
            found.append(split)
    return tuple(found)


def own_slice(total_heads: int, tp: int, tp_rank: int, pp_rank: int, mla: bool) -> Slice:
    """The slice this rank's objects hold (rank-named when the head count is unknown)."""
    if total_heads <= 0:
        return Slice(0, 0, 0, pp_rank * tp + tp_rank)
    lo, hi = (0, 1) if mla else rank_heads(total_heads, tp, tp_rank)
    return Slice(pp_rank, lo, hi)


def slices_to_read(split: Split, own: Slice) -> list[Slice]:
    """The slices of `split` that hold a part of `own`'s KV heads (of its pipeline stage)."""
    if own.rank >= 0:
        return [s for s in split.slices if s.rank == own.rank]
    return [s for s in split.slices if s.overlaps(own)]


@dataclasses.dataclass(frozen=True)
class ChunkGeometry:
    block_size: int
    blocks_per_chunk: int
    ranks: int = 1  # TP x PP world size (rank-named slices when `splits` is not given)
    # The splits this engine reads (splits_for), its own first; stores write the own one.
    splits: tuple[Split, ...] = ()

    def __post_init__(self) -> None:
        if not self.splits:
            object.__setattr__(self, "splits", (rank_split(self.ranks),))

    def objects_per_chunk(self, split: int = 0) -> int:
        return len(self.splits[split].slices)

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    def full_chunks(self, num_tokens: int, num_block_hashes: int) -> int:
        """Chunks fully covered by `num_tokens` tokens and by the known block hashes."""
        return min(num_tokens // self.chunk_tokens, num_block_hashes // self.blocks_per_chunk)

    def chunk_hash(self, block_hashes: Sequence[Any], chunk_index: int) -> bytes:
        """The rank-less key part of a chunk: the hash of its last block."""
        return hash_bytes(block_hashes[(chunk_index + 1) * self.blocks_per_chunk - 1])

    def part_hashes(self, block_hashes: Sequence[Any], chunk_index: int) -> list[bytes]:
        """Rank-less part keys of a chunk: the hashes of all its blocks but the last."""
        first = chunk_index * self.blocks_per_chunk
        return [hash_bytes(block_hashes[b]) for b in range(first, first + self.blocks_per_chunk - 1)]

    def keys_all_ranks(
        self, block_hashes: Sequence[Any], num_chunks: int, split: int = 0, first: int = 0
    ) -> list[bytes]:
        """Keys of chunks first..num_chunks-1 under split `split`, every slice of a chunk next to each other."""
        names = [s.name for s in self.splits[split].slices]
        return [chunk_key(self.chunk_hash(block_hashes, c), n) for c in range(first, num_chunks) for n in names]

    def chunk_meta(
        self,
        block_hashes: Sequence[Any],
        token_ids: Sequence[int],
        chunk_index: int,
        lora_name: str | None,
        cache_salt: str | None = None,
    ) -> ChunkMeta:
        """The per-block facts committed with chunk `chunk_index` (see module docstring); the
        worker sets `rank` (`with_rank`)."""
        first = chunk_index * self.blocks_per_chunk
        blocks = range(first, first + self.blocks_per_chunk)
        bs = self.block_size
        return ChunkMeta(
            v=META_VERSION,
            chunk=chunk_index,
            block_size=bs,
            block_hashes=[hash_bytes(block_hashes[b]).hex() for b in blocks],
            parent_block_hash=hash_bytes(block_hashes[first - 1]).hex() if first > 0 else None,
            token_ids=[list(token_ids[b * bs : (b + 1) * bs]) for b in blocks],
            lora_name=lora_name,
            cache_salt=cache_salt,
        )


def with_rank(meta: ChunkMeta, rank: int) -> ChunkMeta:
    """The metadata one rank commits with its slice of a chunk."""
    return msgspec.structs.replace(meta, rank=rank)


def placeholder_meta(chunk_index: int, blocks_per_chunk: int = 2, block_size: int = 4) -> ChunkMeta:
    """Well-formed metadata for chunks stored without a scheduler (benchmarks, tests): made-up
    block hashes and token ids, chained like a real prompt's."""
    first = chunk_index * blocks_per_chunk
    return ChunkMeta(
        v=META_VERSION,
        chunk=chunk_index,
        block_size=block_size,
        block_hashes=[f"{first + b:032x}" for b in range(blocks_per_chunk)],
        parent_block_hash=f"{first - 1:032x}" if chunk_index else None,
        token_ids=[[(first + b) * block_size + t for t in range(block_size)] for b in range(blocks_per_chunk)],
    )
