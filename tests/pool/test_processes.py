"""Several client processes, crashed clients, silent clients and service restarts."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from pool_helpers import spawn_worker

from maru_vllm.pool import PoolClient, PoolUnavailable
from tests.waiting import wait_until


def _leak_free(st: dict) -> bool:
    return (
        st["reserved"] == 0
        and st["reserved_bytes"] == 0
        and st["pins"] == 0
        and st["allocated_bytes"] == st["live_object_alloc_bytes"]
        and st["allocator_consistent"]
    )


@pytest.mark.timeout(240)
def test_concurrent_client_processes_mixed_sizes_no_corruption_no_leak(pool_factory):
    # 24M pool, 4 writers x 1500 mixed objects (1 B .. 600 KiB): heavy eviction under concurrency
    p = pool_factory(size="24M")
    n, count = 4, 1500
    procs = [spawn_worker("mixed", p.address, str(w), str(n), str(count), str(1000 + w)) for w in range(n)]
    results = []
    for proc, reader in procs:
        line = reader.wait_for("{", timeout=200)
        results.append(json.loads(line))
        assert proc.wait(30) == 0, proc.stderr.read()
    assert sum(r["corrupt"] for r in results) == 0
    assert sum(r["puts"] for r in results) == n * count
    assert sum(r["stored"] for r in results) == n * count  # distinct keys: every store succeeds
    assert sum(r["verified"] for r in results) > n * count  # most reads hit and were byte-checked
    with PoolClient.connect(p.address) as c:
        st = wait_until(lambda: (s := c.stats())["sessions"] == 1 and s, what="workers' sessions closed")
        assert _leak_free(st), st
        assert st["evictions"] > 0 and st["stores"] == n * count
        # the surviving objects are intact, byte for byte
        from _worker import payload, size_of

        keys = [bytes.fromhex(o["key"]) for o in c.snapshot()]
        assert len(keys) == st["objects"] > 0
        for i in range(0, len(keys), 8):  # in batches: one session may pin at most half the pool
            batch = keys[i : i + 8]
            pins = c.acquire(batch)
            assert all(pin is not None and bytes(pin.data) == payload(k, size_of(k)) for k, pin in zip(batch, pins))
            c.release(pins)


def test_writer_killed_between_reserve_and_commit_leaks_nothing(pool):
    with PoolClient.connect(pool.address) as c:
        base = c.stats()["allocated_bytes"]
        proc, reader = spawn_worker("reserve-hang", pool.address, "crash-key", "2000000")
        reader.wait_for("RESERVED", timeout=60)
        st = c.stats()
        assert st["reserved"] == 1 and st["allocated_bytes"] >= base + 2_000_000
        assert c.lookup([b"crash-key"]) == [False]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: c.stats()["reserved"] == 0, what="reservation released")
        st = c.stats()
        assert st["allocated_bytes"] == base and _leak_free(st)
        assert c.lookup([b"crash-key"]) == [False]
        with c.get(b"crash-key") as v:
            assert v is None
        assert c.put(b"crash-key", b"fresh")  # the key is free for a new writer
        with c.get(b"crash-key") as v:
            assert bytes(v) == b"fresh"


def test_reader_killed_while_pinned_releases_pin(pool):
    with PoolClient.connect(pool.address) as c:
        assert c.put(b"pinned", b"p" * 10_000)
        proc, reader = spawn_worker("pin-hang", pool.address, "pinned")
        reader.wait_for("PINNED", timeout=60)
        assert c.stats()["pins"] == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: c.stats()["pins"] == 0, what="pin released")
        assert _leak_free(c.stats())


def test_silent_client_is_released_by_lease_expiry(pool_factory):
    # a stopped (not dead) process keeps its socket open: only the lease can free its pin
    p = pool_factory(extra=["--lease-seconds", "1"])
    with PoolClient.connect(p.address) as c:
        assert c.put(b"k", b"v" * 1000)
        my_session = c.hello["session"]
        proc, reader = spawn_worker("pin-hang", p.address, "k")
        reader.wait_for("PINNED", timeout=60)
        assert c.stats()["pins"] == 1
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            st = wait_until(lambda: (s := c.stats())["pins"] == 0 and s, timeout=30, what="lease expiry")
            assert st["sessions_expired"] == 1
            # our own client, idle between polls, kept its session thanks to its heartbeat
            time.sleep(2.5)  # > 2 leases of idleness
            assert c.stats()["sessions_expired"] == 1
            assert c.hello["session"] == my_session
        finally:
            proc.kill()
            proc.wait(10)


def test_service_restart_clients_recover_without_stale_reads(pool):
    c = PoolClient.connect(pool.address)
    try:
        assert c.put(b"old", b"from-incarnation-1")
        old_inc = c.incarnation
        held = c.acquire([b"old"])[0]
        pool.serve()

        # the next call either fails with PoolUnavailable or reconnects; it never returns old data
        def recovered():
            try:
                with c.get(b"old") as v:
                    return ("ok", None if v is None else bytes(v))
            except PoolUnavailable:
                return None

        assert wait_until(recovered, what="client reconnect") == ("ok", None)
        assert c.incarnation != old_inc
        assert bytes(held.data) == b"from-incarnation-1"  # an old pin still sees the old bytes
        c.release([held])  # inert: belongs to the old session
        assert c.put(b"old", b"from-incarnation-2")
        with c.get(b"old") as v:
            assert bytes(v) == b"from-incarnation-2"
        # reservations from before a restart can never be committed into the new region
        (r,) = c.reserve([(b"straddle", 100)])
        pool.serve()
        with pytest.raises(PoolUnavailable):
            c.commit([r])
        assert wait_until(lambda: _try(lambda: c.lookup([b"straddle"]))) == [False]
        assert c.commit([r]) == [False]
        assert _leak_free(c.stats())
    finally:
        c.close()


def _try(fn):
    try:
        return fn()
    except PoolUnavailable:
        return None
