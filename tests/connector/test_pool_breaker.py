"""A hung pool (SIGSTOP) costs the connector one deadline; loads fail closed, stores are skipped,
nothing waits for it, and pool caching resumes by itself once it answers.

The connector's three links of one engine process - scheduler lookups, worker loads, the store
writer's own connection - over one real pool service process. "Did not wait" is told by the
outage line each link logs: the link that waited says the pool "did not answer" in time, a link
the process-wide breaker turned away says the pool is "marked down". No wall-clock gates.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator

import pytest

from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
from maru_vllm.connector.pool_access import PoolAccess
from maru_vllm.pool import PoolClient
from maru_vllm.pool.breaker import forget_breakers
from tests.connector.chunk_meta import chunk_meta
from tests.connector.worker_side import small_worker
from tests.running_pool import running_pool
from tests.waiting import wait_until

NS = "kv:test:breaker"
DEADLINE_S = 0.3


@pytest.fixture(autouse=True)
def _fresh_breakers() -> Iterator[None]:
    yield
    forget_breakers()


def test_a_hung_pool_costs_one_deadline_then_every_link_serves_without_it_until_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="maru_vllm")
    with running_pool("32M") as pool:
        sched = PoolAccess(pool.address, None, DEADLINE_S, True, "scheduler", connect_timeout_s=30)
        writer_link = PoolAccess(pool.address, None, DEADLINE_S, True, "worker-store", connect_timeout_s=30)
        w, _kv = small_worker(pool.address, 7, NS)  # its load link: PoolAccess "test", deadline 5 s
        w.store_pool = writer_link
        assert w.writer is not None
        w.writer.pool = writer_link
        admin = PoolClient(pool.address, timeout=30.0)
        try:
            w.store(MaruConnectorMetadata(stores=[ChunkStore("r1", b"c0", [3, 4], chunk_meta(0))]))
            assert w.writer.wait(timeout=30) and w.take_counters().chunks_stored == 1
            assert sched.lookup_prefix([b"c0/r0"], NS) == 1

            assert pool.proc is not None
            os.kill(pool.proc.pid, signal.SIGSTOP)
            try:
                # the scheduler's lookups read the region's presence table, which a hung service
                # stops vouching for within its staleness bound: then they ask the service
                table = sched.client.presence
                assert table is not None
                wait_until(lambda: not table.live, timeout=30, what="presence table goes stale")
                assert sched.lookup_prefix([b"c0/r0"], NS) == 0  # the one deadline: a miss
                assert not sched.available and not writer_link.available and not w.pool.available
                # a load is a miss, reported for recompute, without waiting for the pool
                w.load(MaruConnectorMetadata(loads=[ChunkLoad("r2", b"c0", [10, 11])]))
                assert w.take_failed_blocks() == {10, 11}
                # a store is skipped; the writer thread is not stuck behind the pool
                w.store(MaruConnectorMetadata(stores=[ChunkStore("r3", b"c1", [5, 6], chunk_meta(1))]))
                assert w.writer.wait(timeout=30)
                assert w.take_counters().store_failures == 1
                assert sched.lookup_parts([b"c0/r0"], NS) == []
            finally:
                os.kill(pool.proc.pid, signal.SIGCONT)
            lines = [
                r.getMessage()
                for r in caplog.records
                if r.name == "maru_vllm.connector.pool_access" and r.levelno >= logging.WARNING
            ]
            assert len(lines) == 3, lines  # one outage line per link
            assert "did not answer lookup_prefix within 300 ms" in lines[0]
            assert all("marked down" in line for line in lines[1:]), lines

            # pool caching resumes by itself
            wait_until(lambda: sched.lookup_prefix([b"c0/r0"], NS) == 1, timeout=60, what="lookups answered again")
            w.load(MaruConnectorMetadata(loads=[ChunkLoad("r4", b"c0", [12, 13])]))
            assert w.take_failed_blocks() == set()
            w.store(MaruConnectorMetadata(stores=[ChunkStore("r5", b"c1", [5, 6], chunk_meta(1))]))
            assert w.writer.wait(timeout=30) and w.take_counters().chunks_stored == 1
            assert sched.lookup_prefix([b"c0/r0", b"c1/r0"], NS) == 2
            assert sched.available and writer_link.available and w.pool.available
            st = wait_until(lambda: (s := admin.stats())["pins"] == 0 and s, timeout=30, what="pins released")
            assert st["reserved"] == 0
        finally:
            admin.close()
            w.shutdown()
            for link in (sched, writer_link, w.pool):
                link.close()


def test_a_load_that_misses_its_deadline_is_a_miss_and_its_pins_are_released() -> None:
    with running_pool("32M") as pool:
        w, _kv = small_worker(pool.address, 8, NS)
        admin = PoolClient(pool.address, timeout=30.0)
        try:
            w.store(MaruConnectorMetadata(stores=[ChunkStore("r1", b"c0", [3, 4], chunk_meta(0))]))
            assert w.writer is not None and w.writer.wait(timeout=30)
            w.load(MaruConnectorMetadata(loads=[ChunkLoad("r2", b"c0", [10, 11])]))
            assert w.take_failed_blocks() == set()
            w.pool.client.timeout = DEADLINE_S  # the load link's deadline (small_worker's is 5 s)
            assert pool.proc is not None
            os.kill(pool.proc.pid, signal.SIGSTOP)
            try:
                # the load's acquire waits one deadline, then the step recomputes the blocks
                w.load(MaruConnectorMetadata(loads=[ChunkLoad("r3", b"c0", [12, 13])]))
                assert w.take_failed_blocks() == {12, 13}
                assert not w.pool.available
            finally:
                os.kill(pool.proc.pid, signal.SIGCONT)
            wait_until(lambda: w.pool.client._breaker.wait_closed(0) or None, timeout=60, what="breaker closed")
            w.load(MaruConnectorMetadata(loads=[ChunkLoad("r4", b"c0", [12, 13])]))
            assert w.take_failed_blocks() == set()
            # the timed-out acquire's pins (taken when the service resumed) went with its session
            st = wait_until(lambda: (s := admin.stats())["pins"] == 0 and s, timeout=30, what="pins released")
            assert st["reserved"] == 0
        finally:
            admin.close()
            w.shutdown()
            w.pool.close()
