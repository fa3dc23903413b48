"""A relay across a warm pool restart: the router keeps credit for what survived, loses it for
what did not.

A real pool service (killed and started again on its region) and nats-server, the relay, and a
ZMQ subscriber standing in for Dynamo's publisher, whose credit is replayed from what it got
(a store adds a block, a removal takes it away).
"""

from __future__ import annotations

import mmap

import pytest

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.nats_source import PoolSourceConfig
from maru_vllm.events.pool_view import NamespaceFilter
from maru_vllm.events.relay import KvEventRelay, RelayThread
from maru_vllm.launch import free_port
from maru_vllm.pool import PoolClient
from tests.events.helpers import BLOCK, chunk_key, chunk_meta, ext
from tests.events.test_relay import Downstream
from tests.waiting import wait_until

NS = "kv:m:1"
pytestmark = pytest.mark.timeout(180)


def _blocks(prefix: int) -> set[int]:
    return {ext(prefix, b) for b in range(2)}


def test_a_relay_keeps_the_credit_for_what_a_warm_restart_recovered(pool_service, nats) -> None:
    with PoolClient.connect(pool_service.address, write_checksum=True) as c:
        for p in range(6):
            assert c.put(chunk_key(p, 0), b"chunk %d" % p * 100, namespace=NS, meta=chunk_meta(p, 0))
    thread = RelayThread("test-relay-pool-restart")

    async def start() -> KvEventRelay:
        r = KvEventRelay(
            upstream=f"tcp://127.0.0.1:{free_port()}",
            pool=PoolSourceConfig(
                nats[1], pool_service.pool_name, pool_address=pool_service.address, probe_interval_s=0.5
            ),
            namespaces=NamespaceFilter.exactly(NS),
            block_size=BLOCK,
            reannounce_after_s=(),
        )
        await r.start()
        return r

    relay = thread.call(start())
    down = Downstream(relay.endpoint)
    credit: set[int] = set()

    def credited() -> set[int]:
        down.pump()
        credit.clear()
        for _, batch, _ in down.got:
            for e in batch.events:
                (credit.update if isinstance(e, vf.BlockStored) else credit.difference_update)(e.block_hashes)
        return credit

    try:
        everything = set().union(*(_blocks(p) for p in range(6)))
        wait_until(lambda: credited() == everything, what="the pool announced")
        incarnation = relay.source.incarnation
        pool_service.kill()
        with open(pool_service.region_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            at = mm.find(b"chunk 4" * 10)  # a payload byte of chunk 4 changes after its commit
            assert at > 0
            mm[at] ^= 0xFF
        pool_service.restart()
        pool_service.wait_ready()
        wait_until(lambda: relay.source.incarnation not in (None, incarnation), 30, "the relay saw the new incarnation")
        survived = everything - _blocks(4)
        wait_until(lambda: credited() == survived, 30, "the torn chunk withdrawn, the rest still credited")
        removals = [e for _, b, _ in down.got for e in b.events if isinstance(e, vf.BlockRemoved)]
        assert {h for e in removals for h in e.block_hashes} == _blocks(4)  # what survived was never withdrawn
        with PoolClient.connect(pool_service.address) as c:
            st = c.stats()
            assert st["recovered_objects"] == 5 and st["recovery_dropped"] == 1 and st["last_stop"] == "unclean"
            assert c.put(chunk_key(9, 0), b"after", namespace=NS, meta=chunk_meta(9, 0))
        wait_until(lambda: credited() == survived | _blocks(9), 30, "a store after the restart announced")
        assert [seq for seq, _, _ in down.got] == list(range(len(down.got)))
    finally:
        down.close()
        thread.stop([relay])
