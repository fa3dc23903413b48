"""Chunk keys and per-chunk metadata, derived from vLLM's own block hashes.

A chunk is `blocks_per_chunk` consecutive KV blocks of one request. Its pool key is the vLLM
block hash of its last block (that hash already chains the whole prefix, so equal keys mean
equal prefixes) plus the worker's rank in the TP x PP world, since every rank stores its own slice. Nothing
here re-hashes tokens.

Its part keys are the hashes of its other blocks (same rank suffix): part j names the chunk's
first j + 1 blocks, so a request that shares only the start of a chunk finds the object and
loads those blocks (the pool's part index, `PoolClient.lookup_parts` / `acquire_parts`).

The metadata committed with a chunk carries what a KV event needs per block - the block
hashes, the parent block hash, each block's token ids, the block size, the LoRA name - so the
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


def chunk_key(block_hash: Any, rank: int) -> bytes:
    return hash_bytes(block_hash) + b"/r" + str(rank).encode()


@dataclasses.dataclass(frozen=True)
class ChunkGeometry:
    block_size: int
    blocks_per_chunk: int
    ranks: int = 1  # TP x PP world size: one object per rank and chunk

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

    def keys_all_ranks(self, block_hashes: Sequence[Any], num_chunks: int) -> list[bytes]:
        """Keys of chunks 0..num_chunks-1, every TP rank of a chunk next to each other."""
        return [chunk_key(self.chunk_hash(block_hashes, c), r) for c in range(num_chunks) for r in range(self.ranks)]

    def chunk_meta(
        self,
        block_hashes: Sequence[Any],
        token_ids: Sequence[int],
        chunk_index: int,
        lora_name: str | None,
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
