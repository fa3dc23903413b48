"""Chunk metadata and pool objects shaped like MaruKVConnector's, for the relay tests."""

from __future__ import annotations

import hashlib
from typing import Any

from maru_vllm.events.types import PoolObject

BLOCK = 4  # small blocks keep the tests readable; the relay does not care about the size


def block_hash(prefix_id: int, block: int) -> bytes:
    return hashlib.sha256(f"{prefix_id}/{block}".encode()).digest()


def ext(prefix_id: int, block: int):
    """`block_hash(prefix_id, block)` as vLLM announces it in KV events (and the relay does)."""
    from maru_vllm.events.vllm_format import external_hash

    return external_hash(block_hash(prefix_id, block))


def chunk_meta(
    prefix_id: int, chunk: int, blocks_per_chunk: int = 2, block_size: int = BLOCK, rank: int = 0
) -> dict[str, Any]:
    blocks = range(chunk * blocks_per_chunk, (chunk + 1) * blocks_per_chunk)
    return {
        "v": 1,
        "chunk": chunk,
        "block_size": block_size,
        "block_hashes": [block_hash(prefix_id, b).hex() for b in blocks],
        "parent_block_hash": block_hash(prefix_id, blocks[0] - 1).hex() if chunk > 0 else None,
        "token_ids": [[prefix_id * 1000 + b * block_size + t for t in range(block_size)] for b in blocks],
        "lora_name": None,
        "rank": rank,
    }


def chunk_key(prefix_id: int, chunk: int, blocks_per_chunk: int = 2, rank: int = 0) -> bytes:
    return block_hash(prefix_id, (chunk + 1) * blocks_per_chunk - 1) + b"/r" + str(rank).encode()


def obj(prefix_id: int, chunk: int, namespace: str = "kv:m:1", rank: int = 0, **kw: Any) -> PoolObject:
    return PoolObject(
        namespace, chunk_key(prefix_id, chunk, rank=rank).hex(), 100, chunk_meta(prefix_id, chunk, rank=rank, **kw)
    )
