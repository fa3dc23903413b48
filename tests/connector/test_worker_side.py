"""The worker side's data plane against a real pool service, on CPU paged caches."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
from maru_vllm.pool.messages import ChunkMeta


def _meta(chunk: int) -> ChunkMeta:
    """Chunk metadata as the scheduler side builds it (two blocks of four tokens)."""
    return ChunkMeta(v=1, chunk=chunk, block_size=4, block_hashes=["aa" * 16, "bb" * 16], parent_block_hash=None,
                     token_ids=[[1, 2, 3, 4], [5, 6, 7, 8]])
from maru_vllm.connector.pool_access import PoolAccess
from maru_vllm.connector.worker import MaruWorkerSide
from tests.connector.sched_harness import PoolService

NS = "kv:test:worker"


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolService]:
    d = Path(tempfile.mkdtemp(prefix="mws-", dir="/tmp"))
    svc = PoolService(d).start()
    yield svc
    svc.stop()
    shutil.rmtree(d, ignore_errors=True)


def make_worker(address: str, seed: int) -> tuple[MaruWorkerSide, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    # vLLM 0.31 CPU layout: [num_blocks, kv_heads, block_size, 2 * head_size]
    caches = {f"layer{i}": torch.randn(16, 2, 8, 32).to(torch.bfloat16) for i in range(3)}
    side = MaruWorkerSide(namespace=NS, rank=0, pool=PoolAccess(address, None, 5.0, True, "test"), block_size=8,
                          num_blocks=16, use_lmcache_kernels=False, enable_fused_load=False)
    side.register_kv_caches(caches, "CPU_ATTN")
    return side, caches


def test_store_then_load_into_another_instance(pool: PoolService) -> None:
    a, a_kv = make_worker(pool.address, 1)
    b, b_kv = make_worker(pool.address, 2)
    a.store(MaruConnectorMetadata(stores=[ChunkStore("r1", b"chunk-a", [3, 4], _meta(0))]))
    assert a.take_counters().chunks_stored == 1
    b.load(MaruConnectorMetadata(loads=[ChunkLoad("r9", b"chunk-a", [10, 11])]))
    assert b.take_failed_blocks() == set()
    for name in a_kv:
        assert torch.equal(b_kv[name][10], a_kv[name][3]) and torch.equal(b_kv[name][11], a_kv[name][4])


def test_failed_load_blocks_are_reported_and_that_requests_stores_are_dropped(pool: PoolService) -> None:
    w, kv = make_worker(pool.address, 3)
    step = MaruConnectorMetadata(
        loads=[ChunkLoad("r1", b"never-stored", [0, 1])],
        stores=[ChunkStore("r1", b"r1-chunk-1", [2, 3], _meta(1)),  # computed over missing KV
                ChunkStore("r2", b"r2-chunk-0", [4, 5], _meta(0))],
    )
    w.load(step)
    assert w.take_failed_blocks() == {0, 1}
    w.store(step)
    counters = w.take_counters()
    assert counters.load_failures == 1 and counters.chunks_stored == 1 and counters.stores_skipped == 1
    assert w.pool.client.lookup([b"r1-chunk-1/r0", b"r2-chunk-0/r0"], namespace=NS) == [False, True]
    # The next step (after vLLM recomputed) stores r1's chunk normally.
    w.store(MaruConnectorMetadata(stores=[ChunkStore("r1", b"r1-chunk-1", [2, 3], _meta(1))]))
    assert w.take_counters().chunks_stored == 1


def test_pool_down_means_misses_and_skipped_stores_never_errors(tmp_path: Path) -> None:
    w, kv = make_worker(f"unix://{tmp_path}/nobody.sock", 4)
    before = {k: v.clone() for k, v in kv.items()}
    w.load(MaruConnectorMetadata(loads=[ChunkLoad("r1", b"x", [0, 1])]))
    assert w.take_failed_blocks() == {0, 1}
    w.store(MaruConnectorMetadata(stores=[ChunkStore("r2", b"y", [2, 3], _meta(0))]))
    counters = w.take_counters()
    assert counters.store_failures == 1 and counters.chunks_stored == 0
    assert all(torch.equal(before[k], kv[k]) for k in kv)


def test_unsupported_layout_disables_the_connector_instead_of_the_engine(pool: PoolService,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    side = MaruWorkerSide(namespace=NS, rank=0, pool=PoolAccess(pool.address, None, 5.0, True, "test"),
                          block_size=8, num_blocks=16, use_lmcache_kernels=False, enable_fused_load=False)
    side.register_kv_caches({"l0": torch.zeros(7, 3)}, None)  # no dimension of 16 blocks: unsupported
    assert side.codec is None
    side.load(MaruConnectorMetadata(loads=[ChunkLoad("r1", b"k", [0, 1])]))
    assert side.take_failed_blocks() == {0, 1}  # recomputed, never loaded into an unknown layout
    side.store(MaruConnectorMetadata(stores=[ChunkStore("r2", b"k2", [2, 3], _meta(0))]))
    assert side.pool.client.lookup([b"k2/r0"], namespace=NS) == [False]
