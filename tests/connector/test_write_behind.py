"""Write-behind stores: the invariants of store_writer.py, with vLLM's real scheduler and a real pool.

The copy is slowed down where needed by holding it at a gate in front of the real page copy,
so each test sees the moment that matters (a copy still reading blocks) deterministically.
"""

from __future__ import annotations

import threading
from pathlib import Path

from maru_vllm.connector.chunks import chunk_key
from maru_vllm.connector.metadata import ChunkStore, MaruConnectorMetadata
from maru_vllm.connector.worker import MaruWorkerSide
from maru_vllm.launch.stack import PoolProcess
from maru_vllm.pool import PoolClient
from tests.connector.chunk_meta import chunk_meta
from tests.connector.sched_harness import SLOT, Sim, make_request, make_scheduler, pool_keys, tokens
from tests.connector.worker_side import model_worker

NUM_BLOCKS = 64


class Gate:
    """Holds every page copy of a writer until opened (the real copy runs after)."""

    def __init__(self, side: MaruWorkerSide) -> None:
        self.open_ = threading.Event()
        self.entered = threading.Event()

        assert side.writer is not None
        real, real_many = side.writer.pack, side.writer.pack_many

        def hold() -> None:
            self.entered.set()
            assert self.open_.wait(60), "gate never opened"

        def gated(block_ids, out):
            hold()
            return real(block_ids, out)

        def gated_many(items):
            hold()
            return real_many(items)

        # Whichever seam the writer copies through (batched where the fused kernel is built).
        side.writer.pack, side.writer.pack_many = gated, gated_many

    def open(self) -> None:
        self.open_.set()


def test_finished_request_keeps_its_blocks_until_its_copy_is_done_and_is_invisible_until_then(
    tiny_model: Path, pool: PoolProcess, client: PoolClient
) -> None:
    sched = make_scheduler(
        tiny_model,
        pool.address,
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=1024,
        extra={"maru_namespace": "wb-hold"},
    )
    worker, _caches = model_worker(pool.address, sched.connector.namespace)
    gate = Gate(worker)
    sim = Sim(sched, worker=worker)
    req = make_request("r", tokens(7, 600), max_tokens=1)  # two full chunks, done after one step
    sim.add(req)
    sim.step()
    assert "r" in sim.finished, "the request finished (its token went out) while its copy waits"
    assert gate.entered.wait(30)
    keys = pool_keys(req, 2)
    held_blocks = list(sched.kv_cache_manager.get_block_ids("r")[0])
    block_pool = sched.kv_cache_manager.block_pool

    sim.step()  # an idle step: vLLM collects finished transfers, the copy is still at the gate
    assert "r" in sched.requests and "r" not in sim.finished_sending, "blocks released while a copy reads them"
    assert all(block_pool.blocks[b].ref_cnt > 0 for b in held_blocks[:4])
    assert client.lookup(keys, sched.connector.namespace) == [False, False], "visible before its bytes"

    gate.open()
    for _ in range(20):
        if "r" not in sched.requests:
            break
        sim.step()
    assert "r" in sim.finished_sending and "r" not in sched.requests
    assert all(block_pool.blocks[b].ref_cnt == 0 for b in held_blocks)
    # Committed, and byte for byte the pages of the request's first two chunks.
    pins = client.acquire(keys, sched.connector.namespace)
    try:
        for c, pin in enumerate(pins):
            assert pin is not None
            expect = bytearray(worker.codec.chunk_nbytes(2))
            worker.codec.pack(held_blocks[2 * c : 2 * c + 2], memoryview(expect))
            assert bytes(pin.data) == bytes(expect)
    finally:
        client.release(pins)
    worker.shutdown()


def test_preemption_waits_for_the_preempted_requests_copies_only(pool: PoolProcess) -> None:
    worker, _ = model_worker(pool.address, "wb-preempt", block_size=8)
    gate = Gate(worker)
    worker.store(MaruConnectorMetadata(stores=[ChunkStore("victim", b"v0", [1, 2], chunk_meta(0))]))
    assert gate.entered.wait(30)
    # Another request's preemption does not wait for this copy.
    worker.handle_preemptions(MaruConnectorMetadata(preempted_req_ids={"other"}))
    returned = threading.Event()
    t = threading.Thread(
        target=lambda: (worker.handle_preemptions(MaruConnectorMetadata(preempted_req_ids={"victim"})), returned.set())
    )
    t.start()
    assert not returned.wait(0.5), "the forward may overwrite the victim's freed blocks while they are read"
    gate.open()
    t.join(30)
    assert returned.is_set() and not worker.writer.busy()
    assert worker.take_counters().chunks_stored == 1
    worker.shutdown()


def test_held_request_is_reported_once_and_only_after_vllm_said_it_finished(pool: PoolProcess) -> None:
    worker, _ = model_worker(pool.address, "wb-report", block_size=8)
    worker.store(MaruConnectorMetadata(stores=[ChunkStore("a", b"a0", [1, 2], chunk_meta(0))]))
    assert worker.writer.wait(timeout=30)
    # Announced but not yet in vLLM's finished ids: not reported (vLLM's contract).
    assert worker.finished_stores(set(), MaruConnectorMetadata(held_for_stores={"a"})) == set()
    assert worker.finished_stores({"a", "not-held"}, MaruConnectorMetadata()) == {"a"}
    assert worker.finished_stores({"a"}, MaruConnectorMetadata()) == set()  # never twice


def test_failed_copy_is_aborted_and_never_visible(pool: PoolProcess, client: PoolClient) -> None:
    worker, _ = model_worker(pool.address, "wb-fail", block_size=8)

    def broken(*args) -> None:
        raise RuntimeError("copy engine error")

    real, real_many = worker.writer.pack, worker.writer.pack_many
    worker.writer.pack = worker.writer.pack_many = broken
    worker.store(MaruConnectorMetadata(stores=[ChunkStore("r", b"f0", [1, 2], chunk_meta(0))]))
    assert worker.writer.wait(timeout=30)
    counters = worker.take_counters()
    assert counters.store_failures == 1 and counters.chunks_stored == 0
    assert client.lookup([chunk_key(b"f0", SLOT)], "wb-fail") == [False]
    # The reservation was aborted: the same chunk stores fine afterwards.
    worker.writer.pack, worker.writer.pack_many = real, real_many
    worker.store(MaruConnectorMetadata(stores=[ChunkStore("r", b"f0", [1, 2], chunk_meta(0))]))
    assert worker.writer.wait(timeout=30)
    assert client.lookup([chunk_key(b"f0", SLOT)], "wb-fail") == [True]


def test_inline_mode_stores_before_the_step_returns(pool: PoolProcess, client: PoolClient) -> None:
    # A producer-only engine (disaggregated prefill): the decode engine looks right after the response.
    worker, _ = model_worker(pool.address, "wb-inline", block_size=8, write_behind=False)
    worker.store(MaruConnectorMetadata(stores=[ChunkStore("r", b"i0", [1, 2], chunk_meta(0))]))
    assert client.lookup([chunk_key(b"i0", SLOT)], "wb-inline") == [True]


def test_shutdown_finishes_queued_stores(pool: PoolProcess, client: PoolClient) -> None:
    worker, _ = model_worker(pool.address, "wb-shutdown", block_size=8)
    for i in range(4):
        worker.store(
            MaruConnectorMetadata(stores=[ChunkStore(f"r{i}", f"s{i}".encode(), [2 * i, 2 * i + 1], chunk_meta(0))])
        )
    worker.shutdown()
    assert client.lookup([chunk_key(f"s{i}".encode(), SLOT) for i in range(4)], "wb-shutdown") == [True] * 4
