"""What the scheduler side tells the worker side for one step (KVConnectorMetadata)."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from maru_vllm.pool.chunk_codec import ChunkMeta


@dataclasses.dataclass
class ChunkLoad:
    """Load blocks [skip_blocks, skip_blocks + len(block_ids)) of one pool chunk into `block_ids`.

    A whole chunk (`chunk_blocks` 0) is found by its key and holds exactly those blocks. A
    chunk the request shares only in part (`chunk_blocks` > 0: the chunk object's block count)
    is found by the hash of the last block to load, one of the chunk's part keys, and only its
    leading blocks are copied.
    """

    req_id: str
    key: bytes  # slice-less key; the worker appends the names of the slices it reads
    block_ids: list[int]
    skip_blocks: int = 0
    chunk_blocks: int = 0
    group: int = 0  # the KV cache group whose layers and namespace the blocks are of
    split: int = 0  # which of the geometry's splits holds the chunk (0: this engine's own)


@dataclasses.dataclass
class ChunkStore:
    """Store the pages of `block_ids` as one pool chunk, committed with `meta`."""

    req_id: str
    key: bytes
    block_ids: list[int]
    meta: ChunkMeta
    parts: list[bytes] = dataclasses.field(default_factory=list)  # rank-less part keys (ChunkGeometry.part_hashes)
    group: int = 0  # the KV cache group whose layers and namespace the blocks are of


@dataclasses.dataclass
class LoadFailure:
    """Blocks vLLM counts as loaded that no load will write: the worker reports them failed."""

    req_id: str
    block_ids: list[int]


@dataclasses.dataclass
class MaruConnectorMetadata(KVConnectorMetadata):
    loads: list[ChunkLoad] = dataclasses.field(default_factory=list)
    stores: list[ChunkStore] = dataclasses.field(default_factory=list)
    # Requests preempted this step: vLLM freed their blocks, so their pending stores must be
    # finished before the forward may overwrite them (`handle_preemptions`).
    preempted_req_ids: set[str] = dataclasses.field(default_factory=set)
    # Finished requests whose blocks vLLM keeps until the worker reports their stores done
    # (`request_finished` returned True; reported through `get_finished`).
    held_for_stores: set[str] = dataclasses.field(default_factory=set)
    # Nothing is computed this step (the engine only steps to collect finished transfers).
    idle: bool = False
    load_failures: list[LoadFailure] = dataclasses.field(default_factory=list)
    # Requests whose blocks vLLM handed to another use this step while a write-behind copy may
    # still read them (sliding-window blocks leave a running request): like preempted requests,
    # their copies are finished before anything writes the blocks.
    flush_req_ids: set[str] = dataclasses.field(default_factory=set)
    # Asynchronous loads (engines served group by group): every request vLLM admitted to wait
    # for a load this step; the worker reports each finished, and failed unless all its loads
    # succeeded. `async_failed`: the scheduler side could not plan them (no loads planned).
    async_loads: set[str] = dataclasses.field(default_factory=set)
    async_failed: set[str] = dataclasses.field(default_factory=set)

    def is_empty(self) -> bool:
        return not (
            self.loads
            or self.stores
            or self.preempted_req_ids
            or self.held_for_stores
            or self.load_failures
            or self.flush_req_ids
            or self.async_loads
        )

    def copies_to_finish(self) -> set[str]:
        """Requests whose write-behind copies must be done before this step writes any block."""
        return self.preempted_req_ids | self.flush_req_ids

    def planned_load_blocks(self) -> set[int]:
        """Every block this step's loads (or failed loads) cover."""
        return {b for ld in self.loads for b in ld.block_ids} | {b for f in self.load_failures for b in f.block_ids}
