"""KvEventRelay end to end on real sockets: vLLM's own ZmqEventPublisher upstream, a real pool
service + nats-server for pool events, and a ZMQ subscriber standing in for Dynamo's publisher."""

from __future__ import annotations

import time

import pytest
import zmq

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.nats_source import PoolSourceConfig
from maru_vllm.events.pool_view import NamespaceFilter
from maru_vllm.events.relay import KvEventRelay, RelayThread
from maru_vllm.launch import free_port
from maru_vllm.pool import PoolClient
from tests.events.helpers import BLOCK, block_hash, chunk_key, chunk_meta
from tests.waiting import wait_until

NS = "kv:m:1"
pytestmark = pytest.mark.timeout(180)


class Downstream:
    """What Dynamo's KvEventPublisher sees: (seq, KVEventBatch, raw payload) in order."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.got: list[tuple[int, object, bytes]] = []

    def pump(self, timeout_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                _topic, seq, payload = self.sock.recv_multipart()
                self.got.append((vf.decode_seq(seq), vf.decode_batch(payload), payload))

    def events(self) -> list:
        return [ev for _, b, _ in self.got for ev in b.events]

    def wait(self, pred, timeout: float = 20.0, what: str = "events") -> None:
        def check():
            self.pump()
            return pred(self)

        wait_until(check, timeout, what, interval=0)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.destroy(linger=0)

    def __del__(self) -> None:
        # never leave a context to the garbage collector: its term() blocks the collecting thread
        if not self.ctx.closed:
            self.close()


@pytest.fixture
def vllm_pub():
    from vllm.distributed.kv_events import ZmqEventPublisher

    port = free_port()
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}")
    yield pub, f"tcp://127.0.0.1:{port}"
    pub.shutdown()


@pytest.fixture
def relay_factory():
    thread = RelayThread("test-relay")
    relays: list[KvEventRelay] = []

    def make(**kw) -> KvEventRelay:
        async def start():
            r = KvEventRelay(**kw)
            await r.start()
            return r

        r = thread.call(start())
        relays.append(r)
        return r

    yield make
    thread.stop(relays)


def gpu_batch(prefix: int, block: int):
    return vf.KVEventBatch(
        ts=1.0,
        events=[
            vf.BlockStored(
                block_hashes=[vf.external_hash(block_hash(prefix, block))],
                parent_block_hash=None,
                token_ids=list(range(BLOCK)),
                block_size=BLOCK,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
    )


def test_merged_stream(pool_service, nats, vllm_pub, relay_factory) -> None:
    pub, upstream = vllm_pub
    c = PoolClient.connect(pool_service.address)
    try:
        assert c.put(chunk_key(1, 0), b"x", namespace=NS, meta=chunk_meta(1, 0))  # before the relay: snapshot
        relay = relay_factory(
            upstream=upstream,
            medium="CPU_PINNED",
            data_parallel_rank=0,
            block_size=BLOCK,
            namespaces=NamespaceFilter(prefixes=("kv:m:",)),
            pool=PoolSourceConfig(nats_url=nats[1], pool_name=pool_service.pool_name, probe_interval_s=60),
        )
        assert relay.endpoint and relay.endpoint.startswith("tcp://127.0.0.1:")
        wait_until(lambda: relay.source is not None and relay.source.synced, what="relay synced with the pool")
        assert relay.stats.sent == 0  # held until Dynamo subscribes
        down = Downstream(relay.endpoint)
        # the snapshot's blocks, held until the subscription, arrive first with seq 0
        down.wait(lambda d: len(d.events()) >= 1, what="held snapshot batch")
        seq0, batch0, _ = down.got[0]
        assert seq0 == 0 and batch0.data_parallel_rank == 0
        [s] = batch0.events
        assert isinstance(s, vf.BlockStored) and s.medium == "CPU_PINNED" and s.parent_block_hash is None
        assert s.block_hashes == [vf.external_hash(block_hash(1, 0)), vf.external_hash(block_hash(1, 1))]
        assert s.token_ids == chunk_meta(1, 0)["token_ids"][0] + chunk_meta(1, 0)["token_ids"][1]

        # vLLM's batches pass through byte for byte, interleaved with live pool events
        time.sleep(0.3)  # our SUB to vLLM's PUB is connected by now (slow joiner)
        pub.publish(gpu_batch(5, 0))
        down.wait(lambda d: len(d.got) >= 2, what="vLLM batch")
        assert down.got[1][1].events[0].medium == "GPU"
        assert c.put(chunk_key(1, 1), b"x", namespace=NS, meta=chunk_meta(1, 1))
        down.wait(lambda d: len(d.got) >= 3, what="live pool store")
        [s1] = down.got[2][1].events
        assert s1.parent_block_hash == vf.external_hash(block_hash(1, 1)) and s1.medium == "CPU_PINNED"
        pub.publish(gpu_batch(5, 1))
        c.remove([chunk_key(1, 0)], namespace=NS)
        down.wait(lambda d: any(isinstance(e, vf.BlockRemoved) for e in d.events()), what="pool removal")
        down.pump(0.5)
        removed = [e for e in down.events() if isinstance(e, vf.BlockRemoved)]
        assert removed[0].block_hashes == [vf.external_hash(block_hash(1, 0)), vf.external_hash(block_hash(1, 1))]
        assert removed[0].medium == "CPU_PINNED"
        assert [seq for seq, _, _ in down.got] == list(range(len(down.got)))  # one gap-free counter
        assert relay.stats.vllm_batches == 2 and relay.stats.vllm_seq_gaps == 0

        # a subscriber that joins later gets every pool block again
        late = Downstream(relay.endpoint)
        late.wait(lambda d: any(isinstance(e, vf.BlockStored) for e in d.events()), what="re-announcement")
        withdrawn, again = late.events()  # withdrawn first: Dynamo's publisher counts stores per block
        assert isinstance(again, vf.BlockStored) and again.block_hashes == [
            vf.external_hash(block_hash(1, 2)),
            vf.external_hash(block_hash(1, 3)),
        ]
        assert isinstance(withdrawn, vf.BlockRemoved) and withdrawn.block_hashes == again.block_hashes
        late.close()
        down.close()
    finally:
        c.close()


def test_vllm_payload_is_forwarded_unchanged(vllm_pub, relay_factory) -> None:
    pub, upstream = vllm_pub
    relay = relay_factory(upstream=upstream)  # no pool at all: a plain pass-through
    down = Downstream(relay.endpoint)
    wait_until(lambda: relay.stats.subscribers_joined >= 1, what="subscription seen")
    time.sleep(0.3)
    for i in range(5):
        pub.publish(gpu_batch(9, i))
    down.wait(lambda d: len(d.got) == 5, what="5 batches")
    raw = [p for _, _, p in down.got]
    assert [b.events[0].block_hashes for _, b, _ in down.got] == [
        [vf.external_hash(block_hash(9, i))] for i in range(5)
    ]
    # byte-identical to vLLM's own encoding (the publisher stamps the dp rank)
    for i, p in enumerate(raw):
        expect = gpu_batch(9, i)
        expect.data_parallel_rank = 0
        assert p == vf.encode_batch(expect)


def test_unreachable_nats_only_pauses_pool_awareness(vllm_pub, relay_factory) -> None:
    pub, upstream = vllm_pub
    dead = f"nats://127.0.0.1:{free_port()}"
    relay = relay_factory(upstream=upstream, pool=PoolSourceConfig(nats_url=dead, pool_name="nope"))
    down = Downstream(relay.endpoint)
    wait_until(lambda: relay.stats.subscribers_joined >= 1, what="subscription seen")
    time.sleep(0.3)
    pub.publish(gpu_batch(3, 0))
    down.wait(lambda d: len(d.got) == 1, what="vLLM events still flow")
    assert relay.source is not None and not relay.source.connected and not relay.source.synced
    down.close()


def test_unknown_medium_is_accepted_with_a_warning(caplog, relay_factory) -> None:
    relay = relay_factory(upstream=f"tcp://127.0.0.1:{free_port()}", medium="PMEM")
    assert relay.medium == "PMEM"
    assert any("not one Dynamo's router places" in r.message for r in caplog.records)


def test_a_backlog_smaller_than_a_snapshot_page_is_refused_in_one_line() -> None:
    pool = PoolSourceConfig("nats://127.0.0.1:4222", "kv")
    with pytest.raises(
        ValueError, match=r"^max_unsent_bytes=1048576: must hold a snapshot page's batches, >= 4194304"
    ) as e:
        KvEventRelay(upstream="tcp://127.0.0.1:5557", pool=pool, max_unsent_bytes=1 << 20)
    assert "\n" not in str(e.value)
    KvEventRelay(upstream="tcp://127.0.0.1:5557", max_unsent_bytes=1 << 20)  # no pool: no snapshot pages


def test_blocks_are_announced_again_after_a_nats_outage(
    pool_service, nats, vllm_pub, relay_factory, procs, log_dir
) -> None:
    """Dynamo's own NATS client may reconnect later than ours: what we announce right after an
    outage can be lost on its way to the router, so the relay repeats the pool's blocks."""
    from maru_vllm.launch import stack

    nats_proc, url = nats
    _pub, upstream = vllm_pub
    c = PoolClient.connect(pool_service.address)
    try:
        relay = relay_factory(
            upstream=upstream,
            block_size=BLOCK,
            namespaces=NamespaceFilter(prefixes=("kv:m:",)),
            pool=PoolSourceConfig(nats_url=url, pool_name=pool_service.pool_name, probe_interval_s=60),
            reannounce_after_s=(0.5,),
        )
        down = Downstream(relay.endpoint)
        assert c.put(chunk_key(7, 0), b"x", namespace=NS, meta=chunk_meta(7, 0))
        down.wait(lambda d: len(d.events()) == 1, what="live store")
        down.pump(1.0)
        assert len(down.events()) == 1  # no repeats without a resync
        nats_proc.stop()
        wait_until(lambda: not relay.source.connected, what="outage noticed")
        assert c.put(chunk_key(8, 0), b"x", namespace=NS, meta=chunk_meta(8, 0))  # while NATS is down
        again, _ = stack.nats_server(log_dir, port=int(url.rsplit(":", 1)[1]))
        procs.start(again).wait_for_log(stack.NATS_READY_PATTERN, timeout=30)

        def stores_of(prefix: int) -> int:
            h = vf.external_hash(block_hash(prefix, 0))
            return sum(isinstance(e, vf.BlockStored) and e.block_hashes[0] == h for e in d_events())

        d_events = down.events
        # the resync announces the difference (chunk 8), then everything is repeated once
        down.wait(lambda d: stores_of(8) == 2 and stores_of(7) == 2, timeout=60, what="re-announcement")
    finally:
        c.close()
