"""What the scheduler side tells the worker side for one step (KVConnectorMetadata)."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from maru_vllm.pool.messages import ChunkMeta


@dataclasses.dataclass
class ChunkLoad:
    """Load the blocks [skip_blocks:] of one pool chunk into `block_ids`."""

    req_id: str
    key: bytes  # rank-less key; the worker appends its own rank
    block_ids: list[int]
    skip_blocks: int = 0


@dataclasses.dataclass
class ChunkStore:
    """Store the pages of `block_ids` as one pool chunk, committed with `meta`."""

    req_id: str
    key: bytes
    block_ids: list[int]
    meta: ChunkMeta


@dataclasses.dataclass
class MaruConnectorMetadata(KVConnectorMetadata):
    loads: list[ChunkLoad] = dataclasses.field(default_factory=list)
    stores: list[ChunkStore] = dataclasses.field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.loads and not self.stores
