"""The worker side for engines served group by group (worker_groups.py), over a real pool.

Two groups as vLLM's hybrid manager makes them for a Gemma-3-like model: a sliding-window layer
and a full-attention layer, each with its own block ids. One worker stores a chunk; a second
worker (another engine: zeroed caches) loads it, the full group whole and the window group only
its last block, and must end with the same bytes in exactly those blocks.
"""

from __future__ import annotations

import torch

from maru_vllm.connector.chunks import placeholder_meta
from maru_vllm.connector.kv_groups import FULL, SLIDING, KVGroup
from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
from maru_vllm.connector.pool_access import PoolAccess
from maru_vllm.connector.worker_groups import GroupedWorkerSide
from maru_vllm.launch.stack import PoolProcess

BLOCK, BLOCKS = 8, 16
GROUPS = [
    KVGroup(0, ("layer.sliding",), ("SlidingWindowSpec",), BLOCK, SLIDING, window=12),
    KVGroup(1, ("layer.full",), ("FullAttentionSpec",), BLOCK, FULL),
]
NAMESPACES = ["kvg0:test:window", "kv:test:full"]


def grouped_worker(address: str, seed: int | None) -> tuple[GroupedWorkerSide, dict[str, torch.Tensor]]:
    if seed is None:
        caches = {g.layer_names[0]: torch.zeros(BLOCKS, 2, BLOCK, 32, dtype=torch.bfloat16) for g in GROUPS}
    else:
        torch.manual_seed(seed)
        caches = {g.layer_names[0]: torch.randn(BLOCKS, 2, BLOCK, 32).to(torch.bfloat16) for g in GROUPS}
    side = GroupedWorkerSide(
        groups=GROUPS,
        namespaces=NAMESPACES,
        rank=0,
        pool=PoolAccess(address, None, 5.0, True, "test"),
        store_pool=None,
        write_behind=False,
        block_size=BLOCK,
        num_blocks=BLOCKS,
        use_lmcache_kernels=False,
        enable_fused_load=False,
        blocks_per_chunk=2,
    )
    side.register_kv_caches(caches, "CPU_ATTN")
    return side, caches


def store_chunk(writer: GroupedWorkerSide, key: bytes) -> None:
    meta = placeholder_meta(0, blocks_per_chunk=2, block_size=BLOCK)
    writer.store(
        MaruConnectorMetadata(
            stores=[
                ChunkStore("w", key, [3, 4], meta, [], group=0),  # the window group's blocks
                ChunkStore("w", key, [7, 9], meta, [], group=1),  # the full group's blocks
            ]
        )
    )


def test_a_chunk_comes_back_in_each_groups_own_blocks(pool: PoolProcess) -> None:
    writer, src = grouped_worker(pool.address, seed=1)
    store_chunk(writer, b"chunk-a")
    reader, dst = grouped_worker(pool.address, seed=None)
    reader.load(
        MaruConnectorMetadata(
            loads=[
                ChunkLoad("r", b"chunk-a", [5], skip_blocks=1, group=0),  # only the block the window keeps
                ChunkLoad("r", b"chunk-a", [1, 2], group=1),
            ],
            async_loads={"r"},
        )
    )
    assert reader.take_load_results() == ({"r"}, set())
    window, full = dst["layer.sliding"], dst["layer.full"]
    assert torch.equal(window[5], src["layer.sliding"][4])
    assert torch.equal(full[1], src["layer.full"][7]) and torch.equal(full[2], src["layer.full"][9])
    untouched = [b for b in range(BLOCKS) if b != 5]
    assert not window[untouched].any() and not full[[b for b in range(BLOCKS) if b not in (1, 2)]].any()
    assert reader.take_failed_blocks() == set()
    writer.shutdown()
    reader.shutdown()


def test_a_load_missing_in_one_group_fails_the_request_in_every_group(pool: PoolProcess) -> None:
    writer, _ = grouped_worker(pool.address, seed=2)
    store_chunk(writer, b"chunk-b")
    reader, _ = grouped_worker(pool.address, seed=None)
    meta = MaruConnectorMetadata(
        loads=[
            ChunkLoad("r", b"chunk-b", [1, 2], group=1),
            ChunkLoad("r", b"not-in-the-pool", [5], skip_blocks=1, group=0),
        ],
        # The same step also completes a chunk of the failed request: computed over a hole,
        # it must not reach the pool in any group.
        stores=[
            ChunkStore("r", b"computed-over-a-hole", [6, 8], placeholder_meta(1, 2, BLOCK), [], group=g) for g in (0, 1)
        ],
        async_loads={"r", "planned-nothing"},
    )
    reader.load(meta)
    finished, failed = reader.take_load_results()
    assert finished == {"r", "planned-nothing"} and failed == {"r", "planned-nothing"}
    assert reader.take_failed_blocks() == set()  # vLLM takes no block ids with several groups
    reader.store(meta)
    probe = PoolAccess(pool.address, None, 5.0, True, "probe")
    try:
        for ns in NAMESPACES:
            assert probe.lookup_prefix([b"computed-over-a-hole/r0"], ns) == 0
            assert probe.lookup_prefix([b"chunk-b/r0"], ns) == 1
    finally:
        probe.close()
    writer.shutdown()
    reader.shutdown()


def test_a_finished_request_is_released_once_every_group_is_done(pool: PoolProcess) -> None:
    writer, _ = grouped_worker(pool.address, seed=3)
    store_chunk(writer, b"chunk-c")
    assert writer.finished_stores({"w"}, MaruConnectorMetadata(held_for_stores={"w"})) == {"w"}
    assert writer.finished_stores(set(), MaruConnectorMetadata()) == set()  # reported once
    writer.shutdown()
