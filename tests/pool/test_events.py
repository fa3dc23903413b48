"""stored/removed events on a real nats-server, seen by a nats-py subscriber."""

from __future__ import annotations

import asyncio
import json

import nats as nats_py
import pytest

from maru_vllm.launch import stack
from maru_vllm.pool import PoolClient, events_subject, snapshot_subject
from tests.waiting import wait_until


async def _wait(pred, timeout=20.0, what="condition"):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout}s")


@pytest.mark.timeout(120)
def test_events_gap_free_with_meta_and_snapshot_matches_live_set(pool_factory, nats):
    _, nats_url = nats
    p = pool_factory(size="4M", extra=["--nats", nats_url])
    assert events_subject(p.pool_name) == f"maru.{p.pool_name}.events"

    async def main():
        nc, events = await _subscribe(nats_url, p.pool_name)
        c = PoolClient.connect(p.address)
        try:
            await _wait(lambda: c.stats()["nats_connected"], what="pool connected to NATS")

            def work():
                for i in range(40):  # 40 x 300K into 4M: stores and evictions
                    assert c.put(b"blk%d" % i, bytes([i]) * 300_000, namespace="m", meta={"block": i, "model": "x"})

            await asyncio.to_thread(work)
            st = c.stats()
            await _wait(lambda: len(events) >= st["event_seq"], what="all events delivered")
            assert [e["seq"] for e in events] == list(range(1, st["event_seq"] + 1))  # gap-free, in order
            assert {e["incarnation"] for e in events} == {st["incarnation"]}
            assert {e["pool"] for e in events} == {p.pool_name}
            stored = [e for e in events if e["type"] == "stored"]
            removed = [e for e in events if e["type"] == "removed"]
            assert len(stored) == 40 and len(removed) == st["evictions"] > 0
            for e in stored + removed:  # the committer's meta rides on both event types
                i = int(bytes.fromhex(e["key"])[3:])
                assert e["meta"] == {"block": i, "model": "x"} and e["namespace"] == "m" and e["size"] == 300_000
            live = set()
            for e in events:
                (live.add if e["type"] == "stored" else live.discard)((e["namespace"], e["key"]))
            snap = c.snapshot_full()
            assert snap["seq"] == st["event_seq"]
            assert {(o["namespace"], o["key"]) for o in snap["objects"]} == live
            # the same snapshot over NATS request/reply
            reply = await nc.request(snapshot_subject(p.pool_name), b"", timeout=10)
            nsnap = json.loads(reply.data)
            assert nsnap["seq"] == st["event_seq"] and nsnap["incarnation"] == st["incarnation"]
            assert {(o["namespace"], o["key"]) for o in nsnap["objects"]} == live
        finally:
            c.close()
            await nc.close()

    asyncio.run(main())


async def _subscribe(nats_url: str, pool_name: str):
    """A nats-py connection subscribed to the pool's events, and the list they arrive in."""
    nc = await nats_py.connect(nats_url)
    events = []

    async def collect(msg):
        events.append(json.loads(msg.data))

    await nc.subscribe(events_subject(pool_name), cb=collect)
    await nc.flush()
    return nc, events


@pytest.mark.timeout(120)
def test_ops_continue_while_nats_is_down_and_events_resume(pool_factory, nats):
    nats_proc, nats_url = nats
    p = pool_factory(size="16M", extra=["--nats", nats_url])
    with PoolClient.connect(p.address) as c:
        wait_until(lambda: c.stats()["nats_connected"], what="pool connected to NATS")
        assert c.put(b"before", b"1")
        nats_proc.stop()
        for i in range(20):  # the pool keeps serving without NATS
            assert c.put(b"during%d" % i, b"x" * 1000)
        with c.get(b"during3") as v:
            assert bytes(v) == b"x" * 1000
        queued = c.stats()
        assert queued["event_seq"] == 21
        nats_proc.restart().wait_for_log(stack.NATS_READY_PATTERN, timeout=30)

        async def main():
            nc, events = await _subscribe(nats_url, p.pool_name)
            await _wait(lambda: c.stats()["nats_connected"], timeout=30, what="pool reconnected to NATS")
            await asyncio.to_thread(c.put, b"after", b"2")
            await _wait(
                lambda: any(e["type"] == "stored" and e["key"] == b"after".hex() for e in events),
                what="event after reconnect",
            )
            after = next(e for e in events if e["key"] == b"after".hex())
            assert after["seq"] == 22  # numbering continued across the outage
            # a subscriber that missed events resyncs from the snapshot and its seq
            snap = json.loads((await nc.request(snapshot_subject(p.pool_name), b"", timeout=10)).data)
            assert snap["seq"] >= 22 and len(snap["objects"]) == 22
            await nc.close()

        asyncio.run(main())


@pytest.mark.timeout(120)
def test_remove_hides_objects_emits_removed_and_frees_space(pool_factory, nats):
    _, nats_url = nats
    p = pool_factory(size="4M", extra=["--nats", nats_url])

    async def main():
        nc, events = await _subscribe(nats_url, p.pool_name)
        c = PoolClient.connect(p.address)
        try:
            await _wait(lambda: c.stats()["nats_connected"], what="pool connected to NATS")
            for i in range(4):
                assert c.put(b"k%d" % i, bytes([i]) * 100_000, namespace="a", meta={"i": i})
            assert c.put(b"k0", b"x" * 1000, namespace="b")
            used = c.stats()["allocated_bytes"]
            pin = c.acquire([b"k1"], namespace="a")[0]
            assert pin is not None
            assert c.remove([b"k1", b"missing"], namespace="a") == 1
            assert c.lookup([b"k0", b"k1"], namespace="a") == [True, False]
            assert bytes(pin.data[:10]) == bytes([1]) * 10  # a pinned reader keeps valid bytes
            c.release([pin])
            assert c.remove(None, namespace="a") == 3  # the rest of the namespace
            assert c.lookup([b"k0", b"k2", b"k3"], namespace="a") == [False] * 3
            assert c.lookup([b"k0"], namespace="b") == [True]  # other namespaces untouched
            assert c.stats()["allocated_bytes"] < used
            await _wait(lambda: sum(e["type"] == "removed" for e in events) == 4, what="4 removed events")
            removed = sorted(e["meta"]["i"] for e in events if e["type"] == "removed")
            assert removed == [0, 1, 2, 3]
        finally:
            c.close()
            await nc.close()

    asyncio.run(main())
