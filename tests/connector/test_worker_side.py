"""The worker side's data plane against a real pool service, on CPU paged caches."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
from maru_vllm.connector.worker import MaruWorkerSide
from maru_vllm.launch.stack import PoolProcess
from tests.connector.chunk_meta import chunk_meta
from tests.connector.worker_side import buffer_address, small_worker, worker_side

NS = "kv:test:worker"


def make_worker(address: str, seed: int) -> tuple[MaruWorkerSide, dict[str, torch.Tensor]]:
    return small_worker(address, seed, NS)


def test_store_then_load_into_another_instance(pool: PoolProcess) -> None:
    a, a_kv = make_worker(pool.address, 1)
    b, b_kv = make_worker(pool.address, 2)
    a.store(MaruConnectorMetadata(stores=[ChunkStore("r1", b"chunk-a", [3, 4], chunk_meta(0))]))
    assert a.writer.wait(timeout=30)  # write-behind: the step returned before the copy
    assert a.take_counters().chunks_stored == 1
    b.load(MaruConnectorMetadata(loads=[ChunkLoad("r9", b"chunk-a", [10, 11])]))
    assert b.take_failed_blocks() == set()
    for name in a_kv:
        assert torch.equal(b_kv[name][10], a_kv[name][3]) and torch.equal(b_kv[name][11], a_kv[name][4])


def test_failed_load_blocks_are_reported_and_that_requests_stores_are_dropped(pool: PoolProcess) -> None:
    w, _kv = make_worker(pool.address, 3)
    step = MaruConnectorMetadata(
        loads=[ChunkLoad("r1", b"never-stored", [0, 1])],
        stores=[
            ChunkStore("r1", b"r1-chunk-1", [2, 3], chunk_meta(1)),  # computed over missing KV
            ChunkStore("r2", b"r2-chunk-0", [4, 5], chunk_meta(0)),
        ],
    )
    w.load(step)
    assert w.take_failed_blocks() == {0, 1}
    w.store(step)
    assert w.writer.wait(timeout=30)
    counters = w.take_counters()
    assert counters.load_failures == 1 and counters.chunks_stored == 1 and counters.stores_skipped == 1
    assert w.pool.client.lookup([b"r1-chunk-1/r0", b"r2-chunk-0/r0"], namespace=NS) == [False, True]
    # The next step (after vLLM recomputed) stores r1's chunk normally.
    w.store(MaruConnectorMetadata(stores=[ChunkStore("r1", b"r1-chunk-1", [2, 3], chunk_meta(1))]))
    assert w.writer.wait(timeout=30)
    assert w.take_counters().chunks_stored == 1


def test_pool_down_means_misses_and_skipped_stores_never_errors(tmp_path: Path) -> None:
    w, kv = make_worker(f"unix://{tmp_path}/nobody.sock", 4)
    before = {k: v.clone() for k, v in kv.items()}
    w.load(MaruConnectorMetadata(loads=[ChunkLoad("r1", b"x", [0, 1])]))
    assert w.take_failed_blocks() == {0, 1}
    w.store(MaruConnectorMetadata(stores=[ChunkStore("r2", b"y", [2, 3], chunk_meta(0))]))
    assert w.writer.wait(timeout=30)
    counters = w.take_counters()
    assert counters.store_failures == 1 and counters.chunks_stored == 0
    assert all(torch.equal(before[k], kv[k]) for k in kv)


def test_unsupported_layout_disables_the_connector_instead_of_the_engine(
    pool: PoolProcess, caplog: pytest.LogCaptureFixture
) -> None:
    # no dimension of 16 blocks: unsupported
    side = worker_side(pool.address, NS, {"l0": torch.zeros(7, 3)}, block_size=8, num_blocks=16, backend=None)
    assert side.codec is None
    side.load(MaruConnectorMetadata(loads=[ChunkLoad("r1", b"k", [0, 1])]))
    assert side.take_failed_blocks() == {0, 1}  # recomputed, never loaded into an unknown layout
    side.store(MaruConnectorMetadata(stores=[ChunkStore("r2", b"k2", [2, 3], chunk_meta(0))]))
    assert side.pool.client.lookup([b"k2/r0"], namespace=NS) == [False]


# ---- fail closed: a contained error on the load path reports every planned block ---------------
def worker_connector(side: MaruWorkerSide):
    """MaruKVConnector's worker-role hooks around `side` (constructed without a VllmConfig)."""
    from maru_vllm.connector.connector import MaruKVConnector

    conn = MaruKVConnector.__new__(MaruKVConnector)
    conn.worker_side, conn.scheduler_side, conn.contained_errors = side, None, 0
    conn._connector_metadata = None
    return conn


def settle(w: MaruWorkerSide) -> None:
    """Wait until the write-behind writer has committed everything handed to it."""
    if w.writer is not None:
        assert w.writer.wait(timeout=30)


def step_with_a_pool_hit(w: MaruWorkerSide) -> MaruConnectorMetadata:
    """r1 loads two stored chunks and stores a third it computes on top; r2 only stores."""
    w.store(
        MaruConnectorMetadata(
            stores=[ChunkStore("r0", b"fc-0", [0, 1], chunk_meta(0)), ChunkStore("r0", b"fc-1", [2, 3], chunk_meta(1))]
        )
    )
    settle(w)
    w.take_counters()
    return MaruConnectorMetadata(
        loads=[ChunkLoad("r1", b"fc-0", [4, 5]), ChunkLoad("r1", b"fc-1", [6, 7])],
        stores=[
            ChunkStore("r1", b"fc-r1-2", [8, 9], chunk_meta(2)),
            ChunkStore("r2", b"fc-r2-0", [10, 11], chunk_meta(0)),
        ],
    )


@pytest.mark.parametrize("where", ["before-copy", "after-first-chunk"])
def test_start_load_kv_error_reports_every_planned_block(pool: PoolProcess, where: str) -> None:
    w, _ = make_worker(pool.address, 5)
    step = step_with_a_pool_hit(w)
    conn = worker_connector(w)
    if where == "before-copy":
        w.pool.acquire = lambda *a, **k: (_ for _ in ()).throw(KeyError("injected"))  # type: ignore[method-assign]
    else:
        # The second chunk's copy raises, on whichever path copies it: the batched kernel pass
        # (host caches with the fused kernel) or chunk by chunk.
        calls = []

        def failing_second(copy):
            def wrapped(*a, **k):
                calls.append(1)
                if len(calls) > 1:
                    raise KeyError("injected")  # not a copy error the worker expects: a bug
                return copy(*a, **k)

            return wrapped

        real_plan, real_unpack = w.codec.fused_plan(), w.codec.unpack
        if real_plan is not None:
            kernel, planner = real_plan
            fake_kernel = SimpleNamespace(copy=failing_second(kernel.copy))
            w.codec.fused_plan = lambda: (fake_kernel, planner)  # type: ignore[method-assign]
        w.codec.unpack = failing_second(real_unpack)  # type: ignore[method-assign]
    conn.bind_connector_metadata(step)
    conn.start_load_kv(None)  # contained: no exception reaches the engine
    assert conn.contained_errors == 1
    if where != "before-copy":
        assert len(calls) == 2  # the first chunk was copied, the second raised
        w.codec.__dict__.pop("unpack", None)
        w.codec.__dict__.pop("fused_plan", None)
    w.pool.__dict__.pop("acquire", None)
    conn.wait_for_save()
    settle(w)
    assert conn.get_block_ids_with_load_errors() == {4, 5, 6, 7}
    # r1's chunk 2 was computed on top of blocks nobody wrote: it never reaches the pool.
    assert w.pool.client.lookup([b"fc-r1-2/r0", b"fc-r2-0/r0"], namespace=NS) == [False, True]


def test_load_errors_hook_error_reports_every_planned_block(pool: PoolProcess) -> None:
    w, _ = make_worker(pool.address, 6)
    step = step_with_a_pool_hit(w)
    step.loads.append(ChunkLoad("r3", b"never-stored", [12, 13]))  # really fails
    conn = worker_connector(w)
    conn.bind_connector_metadata(step)
    conn.start_load_kv(None)
    assert w.failed_blocks == {12, 13}

    def broken() -> set[int]:
        raise KeyError("injected")

    w.take_failed_blocks = broken  # type: ignore[method-assign]
    assert conn.get_block_ids_with_load_errors() == {4, 5, 6, 7, 12, 13}
    assert conn.contained_errors == 1
    del w.take_failed_blocks
    assert w.take_failed_blocks() == set()  # not reported twice


def test_loads_the_scheduler_could_not_plan_are_reported_and_their_stores_dropped(pool: PoolProcess) -> None:
    from maru_vllm.connector.metadata import LoadFailure

    w, _ = make_worker(pool.address, 7)
    step = step_with_a_pool_hit(w)
    step.load_failures.append(LoadFailure("r4", [14, 15]))
    step.stores.append(ChunkStore("r4", b"fc-r4-1", [1, 2], chunk_meta(1)))
    conn = worker_connector(w)
    conn.bind_connector_metadata(step)
    conn.start_load_kv(None)
    conn.wait_for_save()
    settle(w)
    assert conn.get_block_ids_with_load_errors() == {14, 15}
    assert conn.contained_errors == 0
    assert w.pool.client.lookup([b"fc-r4-1/r0", b"fc-r1-2/r0"], namespace=NS) == [False, True]


def test_a_chunk_shared_in_part_loads_its_leading_blocks(pool: PoolProcess) -> None:
    a, a_kv = make_worker(pool.address, 5)
    b, b_kv = make_worker(pool.address, 6)
    before = {k: v.clone() for k, v in b_kv.items()}
    # a stores a 4-block chunk whose blocks hash h0..h3: part keys h0, h1, h2, key h3.
    a.store(MaruConnectorMetadata(stores=[ChunkStore("r1", b"h3", [3, 4, 5, 6], chunk_meta(0), [b"h0", b"h1", b"h2"])]))
    settle(a)
    assert a.take_counters().chunks_stored == 1
    # b has block 0 locally and shares blocks 1..2 of the chunk: it loads exactly those two.
    b.load(MaruConnectorMetadata(loads=[ChunkLoad("r9", b"h2", [10, 11], skip_blocks=1, chunk_blocks=4)]))
    assert b.take_failed_blocks() == set()
    counters = b.take_counters()
    assert (counters.chunks_loaded, counters.blocks_loaded) == (1, 2)
    for name in a_kv:
        assert torch.equal(b_kv[name][10], a_kv[name][4]) and torch.equal(b_kv[name][11], a_kv[name][5])
        rest = [i for i in range(16) if i not in (10, 11)]
        assert torch.equal(b_kv[name][rest], before[name][rest])
    # A part key naming another number of blocks than the load expects is a miss, never a copy.
    b.load(MaruConnectorMetadata(loads=[ChunkLoad("r9", b"h1", [12, 13], skip_blocks=1, chunk_blocks=4)]))
    assert b.take_failed_blocks() == {12, 13}
    # Whole chunks and parts in one step; an unknown part key is a miss for its blocks only.
    b.load(
        MaruConnectorMetadata(
            loads=[
                ChunkLoad("r9", b"h3", [0, 1, 2, 3]),
                ChunkLoad("r9", b"nope", [14], chunk_blocks=4),
                ChunkLoad("r8", b"h0", [15], chunk_blocks=4),
            ]
        )
    )
    assert b.take_failed_blocks() == {14}
    for name in a_kv:
        assert torch.equal(b_kv[name][0:4], a_kv[name][3:7]) and torch.equal(b_kv[name][15], a_kv[name][3])
    assert b.pool.client.stats()["pins"] == 0


def test_corrupt_payload_is_a_miss_recomputed_and_removed_from_the_pool(pool: PoolProcess) -> None:
    """A chunk whose bytes changed after commit fails its checksum while being copied in: its
    blocks are reported for recompute, the other chunk of the step loads, and the pool drops
    the corrupt object so nobody loads it again."""
    a, a_kv = make_worker(pool.address, 5)
    b, b_kv = make_worker(pool.address, 6)
    a.store(
        MaruConnectorMetadata(
            stores=[ChunkStore("r1", b"good", [1, 2], chunk_meta(0)), ChunkStore("r1", b"bad", [3, 4], chunk_meta(1))]
        )
    )
    settle(a)
    assert a.take_counters().chunks_stored == 2
    client = a.pool.client
    (pin,) = client.acquire([b"bad/r0"], NS, verify_payload=False)
    assert pin is not None and pin.checksum is not None
    region = client._region.view  # flip one byte of the committed payload in the shared region
    start = buffer_address(pin.data) - buffer_address(region)
    region[start + 1000] = region[start + 1000] ^ 0x40
    client.release([pin])
    b.load(MaruConnectorMetadata(loads=[ChunkLoad("r9", b"good", [10, 11]), ChunkLoad("r9", b"bad", [12, 13])]))
    assert b.take_failed_blocks() == {12, 13}
    counters = b.take_counters()
    assert counters.chunks_loaded == 1 and counters.load_failures == 1
    for name in a_kv:
        assert torch.equal(b_kv[name][10], a_kv[name][1])
    assert client.lookup([b"good/r0", b"bad/r0"], namespace=NS) == [True, False]


def test_the_layout_handed_to_the_copier_is_the_one_vllm_resolved():
    """LMCache's kernel reads pages by the layout vLLM resolved (a page's shape cannot tell heads
    from tokens); before vLLM resolves one the connector hands none rather than a guess."""
    from types import SimpleNamespace

    from vllm.config import CacheConfig

    from maru_vllm.connector.connector import _kv_layout

    cfg = SimpleNamespace(cache_config=CacheConfig())
    assert _kv_layout(cfg) is None
    cfg.cache_config.kv_cache_layout = "NHD"  # what the engine core sets once it resolves it
    assert _kv_layout(cfg) == "LBNHC"
