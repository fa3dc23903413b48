"""PoolEventSource against a real nats-server and a real pool service: late start, live events,
gaps, pool restarts (new incarnation, noticed live and while idle), NATS outages, a hung pool."""

from __future__ import annotations

import json
import os
import signal

import pytest

from maru_vllm.events.nats_source import PoolEventSource, PoolSourceConfig
from maru_vllm.events.pool_view import NamespaceFilter, PoolView
from maru_vllm.events.relay import RelayThread
from maru_vllm.events.types import BlocksRemoved, BlocksStored
from maru_vllm.launch import stack
from maru_vllm.pool import PoolClient, events_subject
from maru_vllm.pool.breaker import forget_breakers
from tests.events.conftest import restart_pool
from tests.events.helpers import BLOCK, chunk_key, chunk_meta, ext
from tests.waiting import wait_until

NS = "kv:m:1"

pytestmark = pytest.mark.timeout(180)


class Follower:
    """A PoolView kept by a PoolEventSource on a loop thread; records every announcement."""

    def __init__(self, cfg: PoolSourceConfig) -> None:
        self.thread = RelayThread("test-follower")
        self.view = PoolView(NamespaceFilter(prefixes=("kv:m:",)), block_size=BLOCK)
        self.announced: list = []
        self.snapshots = 0

        def on_snapshot(snap):
            self.snapshots += 1
            self.announced.extend(self.view.resync(snap))

        def on_event(ev):
            self.announced.extend(self.view.apply(ev))

        async def make():
            src = PoolEventSource(cfg, on_snapshot, on_event)
            await src.start()
            return src

        # generous: once, in a full CI run on a loaded 2-core machine, this took over 30 s
        self.source: PoolEventSource = self.thread.call(make(), timeout=120)

    def keys(self) -> set[str]:
        """The keys of NS the view holds, among every key a test stored (the view keeps digests
        only); an extra "?" when it holds objects beyond those."""

        async def get():
            held = {k for k in PUT_KEYS if (NS, k) in self.view}
            return held | ({"?"} if len(self.view) > len(held) else set())

        return self.thread.call(get())

    def blocks(self) -> frozenset[bytes]:
        async def get():
            return self.view.blocks

        return self.thread.call(get())

    def close(self) -> None:
        self.thread.call(self.source.stop())
        self.thread.stop()


PUT_KEYS: set[str] = {"ff"}  # every key a test stored, and the fake one of the gap test


def put(c, prefix: int, chunk: int, namespace: str = NS) -> str:
    key = chunk_key(prefix, chunk)
    PUT_KEYS.add(key.hex())
    assert c.put(key, b"x" * 64, namespace=namespace, meta=chunk_meta(prefix, chunk))
    return key.hex()


def live_keys(c) -> set[str]:
    return {o["key"] for o in c.snapshot(NS)}


@pytest.fixture
def follower_factory():
    made: list[Follower] = []

    def make(**kw) -> Follower:
        f = Follower(PoolSourceConfig(**kw))
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


@pytest.mark.parametrize("via_socket", [False, True], ids=["nats-snapshot", "socket-snapshot"])
def test_late_start_then_live_events(pool_service, follower_factory, nats, via_socket: bool) -> None:
    with PoolClient.connect(pool_service.address) as c:
        early = {put(c, 1, 0), put(c, 1, 1)}
        c.put(b"other", b"x", namespace="kv:other:1", meta=chunk_meta(7, 0))
        f = follower_factory(
            nats_url=nats[1],
            pool_name=pool_service.pool_name,
            pool_address=pool_service.address if via_socket else None,
        )
        wait_until(lambda: f.keys() == early, what="snapshot applied")
        assert f.snapshots == 1 and f.source.last_seq == c.stats()["event_seq"]
        # stored announcements came parent-first from the snapshot
        assert [a.block_hashes[0] for a in f.announced] == [ext(1, 0), ext(1, 2)]
        late = put(c, 2, 0)
        wait_until(lambda: f.keys() == early | {late}, what="live stored event applied")
        c.remove([chunk_key(1, 1)], namespace=NS)
        wait_until(lambda: f.keys() == (early | {late}) - {chunk_key(1, 1).hex()}, what="live removed event applied")
        assert f.announced[-1] == BlocksRemoved((ext(1, 2), ext(1, 3)))
        assert f.snapshots == 1 and f.source.stats.gaps == 0


def test_gap_triggers_resync(pool_service, follower_factory, nats) -> None:
    import asyncio

    import nats as nats_py

    with PoolClient.connect(pool_service.address) as c:
        k = put(c, 1, 0)
        f = follower_factory(nats_url=nats[1], pool_name=pool_service.pool_name)
        wait_until(lambda: f.keys() == {k}, what="synced")
        st = c.stats()
        # an event from the future of this incarnation: events in between went missing
        fake = {
            "type": "stored",
            "seq": st["event_seq"] + 5,
            "incarnation": st["incarnation"],
            "pool": pool_service.pool_name,
            "namespace": NS,
            "key": "ff",
            "size": 1,
            "meta": chunk_meta(9, 0),
        }

        async def publish():
            nc = await nats_py.connect(nats[1])
            await nc.publish(events_subject(pool_service.pool_name), json.dumps(fake).encode())
            await nc.flush()
            await nc.close()

        asyncio.run(publish())
        wait_until(lambda: f.source.stats.gaps == 1 and f.snapshots == 2, what="resync after the gap")
        assert f.keys() == {k}  # the fake object is not in the pool's snapshot, so never announced
        k2 = put(c, 2, 0)
        wait_until(lambda: f.keys() == {k, k2}, what="events flow again")


def test_pool_restart_is_noticed_from_the_next_event(pool_service, follower_factory, nats) -> None:
    with PoolClient.connect(pool_service.address) as c:
        put(c, 1, 0)
        put(c, 1, 1)
    f = follower_factory(nats_url=nats[1], pool_name=pool_service.pool_name, probe_interval_s=60)
    wait_until(lambda: len(f.keys()) == 2, what="synced")
    old_blocks = f.blocks()
    restart_pool(pool_service)
    with PoolClient.connect(pool_service.address) as c:
        k = put(c, 3, 0)
    wait_until(lambda: f.keys() == {k}, what="resynced to the new incarnation")
    assert f.source.stats.incarnation_changes >= 1
    removed = {h for a in f.announced if isinstance(a, BlocksRemoved) for h in a.block_hashes}
    assert old_blocks <= removed  # everything of the old incarnation was withdrawn


def test_idle_pool_restart_is_noticed_by_the_probe(pool_service, follower_factory, nats) -> None:
    with PoolClient.connect(pool_service.address) as c:
        put(c, 1, 0)
    f = follower_factory(nats_url=nats[1], pool_name=pool_service.pool_name, probe_interval_s=0.5)
    wait_until(lambda: len(f.keys()) == 1, what="synced")
    restart_pool(pool_service)  # restarts empty and stays idle: no event will tell
    wait_until(lambda: f.keys() == set(), timeout=30, what="probe noticed the new incarnation")
    assert f.source.stats.probes >= 1


def test_nats_outage_pauses_and_resyncs(pool_service, follower_factory, nats, procs, log_dir) -> None:
    nats_proc, url = nats
    port = int(url.rsplit(":", 1)[1])
    with PoolClient.connect(pool_service.address) as c:
        k1 = put(c, 1, 0)
        f = follower_factory(nats_url=url, pool_name=pool_service.pool_name, probe_interval_s=60)
        wait_until(lambda: f.keys() == {k1}, what="synced")
        nats_proc.stop()
        wait_until(lambda: not f.source.connected, what="outage noticed")
        # the pool keeps working without NATS
        k2 = put(c, 2, 0)
        c.remove([chunk_key(1, 0)], namespace=NS)
        assert live_keys(c) == {k2}
        assert f.keys() == {k1}  # paused: nothing changes while NATS is down
        again, _ = stack.nats_server(log_dir, port=port)
        procs.start(again)
        again.wait_for_log(stack.NATS_READY_PATTERN, timeout=30)
        wait_until(lambda: f.keys() == {k2}, timeout=60, what="caught up after NATS came back")
        assert f.source.stats.reconnects >= 1
        k3 = put(c, 3, 0)
        wait_until(lambda: f.keys() == {k2, k3}, what="live again")
        stored = [a for a in f.announced if isinstance(a, BlocksStored)]
        assert stored[-1].block_hashes[0] == ext(3, 0)


@pytest.mark.parametrize("via_socket", [False, True], ids=["nats-snapshot", "socket-snapshot"])
def test_a_hung_pool_pauses_pool_awareness_and_events_flow_again_after(
    pool_service, follower_factory, nats, via_socket: bool
) -> None:
    with PoolClient.connect(pool_service.address) as c:
        k1 = put(c, 1, 0)
    f = follower_factory(
        nats_url=nats[1],
        pool_name=pool_service.pool_name,
        pool_address=pool_service.address if via_socket else None,
        probe_interval_s=0.5,
        request_timeout_s=1.0,
    )
    try:
        wait_until(lambda: f.keys() == {k1}, what="synced")

        async def resync() -> None:
            f.source.request_resync()

        os.kill(pool_service.proc.pid, signal.SIGSTOP)
        try:
            f.thread.call(resync())
            wait_until(lambda: f.source.stats.resync_failures >= 2, timeout=60, what="snapshots of the hung pool fail")
            assert f.keys() == {k1}  # the loop answers; the view is kept as it was
        finally:
            os.kill(pool_service.proc.pid, signal.SIGCONT)
        wait_until(lambda: f.source.synced and not f.source._need_resync, timeout=60, what="resynced")
        with PoolClient.connect(pool_service.address) as c:
            k2 = put(c, 2, 0)
        wait_until(lambda: f.keys() == {k1, k2}, timeout=60, what="live events after the hang")
    finally:
        forget_breakers()
