"""The announce cap: a relay credits the router with at most N pool chunks, the pool's most
recently used, and every block it withdrew or the pool removed is withdrawn exactly once.

"What the router is credited with" is replayed from the announcements (stored minus removed
blocks), as Dynamo's publisher would pass them on; the pool side is the real index / service.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.packed_chunks import ChunkStores
from maru_vllm.events.pool_view import NamespaceFilter, PoolView
from maru_vllm.events.types import BlocksRemoved, PoolObject, PoolSnapshot
from maru_vllm.pool import PoolClient, chunk_codec
from maru_vllm.pool.allocator import Allocator
from maru_vllm.pool.index import PoolIndex
from tests.events.helpers import BLOCK, chunk_key, chunk_meta, ext

NS = "kv:m:1"
BLOCKS_PER_CHUNK = 2


def _obj(prefix: int, chunk: int = 0, binary: bool = False, rank: int = 0) -> PoolObject:
    meta = chunk_meta(prefix, chunk, rank=rank)
    stored: Any = msgspec.Raw(msgspec.json.encode(meta))
    if binary:
        stored = chunk_codec.encode(msgspec.convert(meta, chunk_codec.ChunkMeta))
    return PoolObject(NS, chunk_key(prefix, chunk, rank=rank).hex(), 100, stored)


class Credit:
    """The blocks a router holds for this worker, replayed from the announcements (counted:
    a store of a block it holds is idempotent, a removal of one it lacks is an error here)."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()

    def apply(self, announcements: list[Any]) -> None:
        for a in announcements:
            stores = a.announcements() if isinstance(a, ChunkStores) else [a]
            for s in stores:
                if isinstance(s, BlocksRemoved):
                    missing = set(s.block_hashes) - self.blocks
                    assert not missing, f"removal of blocks never announced: {missing}"
                    self.blocks -= set(s.block_hashes)
                else:
                    self.blocks |= set(s.block_hashes)


def _chunk_blocks(prefix: int, chunk: int = 0) -> set[int]:
    return {ext(prefix, b) for b in range(chunk * BLOCKS_PER_CHUNK, (chunk + 1) * BLOCKS_PER_CHUNK)}


def _view(cap: int) -> PoolView:
    return PoolView(NamespaceFilter.exactly(NS), block_size=BLOCK, int_hashes=True, max_objects=cap)


def test_live_stores_past_the_cap_withdraw_the_oldest_and_pool_removals_stay_exact() -> None:
    v, router = _view(3), Credit()
    for p in range(5):
        router.apply(v.stored(_obj(p)))
        assert len(v) <= 3 and len(router.blocks) <= 3 * BLOCKS_PER_CHUNK
    assert router.blocks == _chunk_blocks(2) | _chunk_blocks(3) | _chunk_blocks(4) == v.blocks
    assert v.cap_withdrawals == 2
    # the pool evicts a chunk the relay withdrew already: nothing is announced (no double removal)
    assert v.removed(_obj(0)) == []
    # ... and one it still announces: its blocks go, and a store no longer withdraws anything
    router.apply(v.removed(_obj(3)))
    assert router.blocks == _chunk_blocks(2) | _chunk_blocks(4)
    router.apply(v.stored(_obj(5)))
    assert router.blocks == _chunk_blocks(2) | _chunk_blocks(4) | _chunk_blocks(5) and v.cap_withdrawals == 2


def test_a_store_chained_on_a_prefix_keeps_that_prefix_announced() -> None:
    """A chunk stored on top of a prompt's earlier chunks means those were just used: the cap
    withdraws another chunk, not the prefix the router needs to credit the new one at all."""
    v, router = _view(3), Credit()
    for o in (_obj(1, 0), _obj(2), _obj(3)):  # the prompt's first chunk is the oldest
        router.apply(v.stored(o))
    router.apply(v.stored(_obj(1, 1)))  # its second chunk, chained on the first
    assert router.blocks == _chunk_blocks(1, 0) | _chunk_blocks(1, 1) | _chunk_blocks(3)
    router.apply(v.stored(_obj(4)))  # unrelated: the least recently used goes (chunk 3)
    assert router.blocks == _chunk_blocks(1, 0) | _chunk_blocks(1, 1) | _chunk_blocks(4)


def test_a_withdrawn_tp_rank_keeps_the_blocks_its_other_rank_holds() -> None:
    v, router = _view(2), Credit()
    router.apply(v.stored(_obj(1, rank=0)))
    router.apply(v.stored(_obj(1, rank=1)))  # same blocks, second object
    router.apply(v.stored(_obj(2)))  # past the cap: rank 0 of chunk 1 is withdrawn
    assert router.blocks == _chunk_blocks(1) | _chunk_blocks(2)  # rank 1 still holds chunk 1's blocks
    router.apply(v.stored(_obj(3)))  # rank 1 goes too: now chunk 1's blocks are withdrawn
    assert router.blocks == _chunk_blocks(2) | _chunk_blocks(3)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_a_resync_counts_at_most_the_cap_and_withdraws_what_it_no_longer_has(binary: bool) -> None:
    v, router = _view(4), Credit()
    for p in range(3):
        router.apply(v.stored(_obj(p)))
    # a snapshot of 6 objects in 2 parts (a pool that lists more than asked): the first 4 count
    objs = [_obj(p, binary=binary) for p in (2, 7, 8, 9, 10, 11)]
    router.apply(v.resync(PoolSnapshot("p", "i", 0, tuple(objs[:3]), part=0, last=False, total=6)))
    router.apply(v.resync(PoolSnapshot("p", "i", 0, tuple(objs[3:]), part=1, last=True)))
    assert len(v) == 4 and v.cap_withdrawals == 0
    assert router.blocks == set().union(*(_chunk_blocks(p) for p in (2, 7, 8, 9))) == v.blocks
    # live stores after the resync withdraw in the order the snapshot listed
    router.apply(v.stored(_obj(20)))
    assert router.blocks == set().union(*(_chunk_blocks(p) for p in (7, 8, 9, 20)))
    router.apply(v.removed(_obj(2)))  # withdrawn for the cap already: nothing
    assert router.blocks == set().union(*(_chunk_blocks(p) for p in (7, 8, 9, 20)))


def test_the_pool_lists_its_most_recently_used_objects_for_a_capped_snapshot() -> None:
    idx = PoolIndex(Allocator(4 << 20), 4096, lambda kind, obj: None)
    sid = idx.open_session()
    for i in range(10):
        (o,) = idx.reserve(sid, "ns", [(b"k%d" % i, 10)])
        idx.commit(sid, [o.oid], [b'{"a":1}'], lambda o: None)
    idx.lookup("ns", [b"k2"])  # a hit is a use: k2 is now the most recently used
    got, after = [], 0
    while True:
        objs, nxt = idx.snapshot_page("ns", after, 2, 1 << 20, recent=3)  # small pages: several of them
        got += [o.key for o in objs]
        if nxt is None:
            break
        after = nxt
    assert got == [b"k2", b"k8", b"k9"]  # commit order within a page run
    objs, _ = idx.snapshot_page("other", 0, 100, 1 << 20, recent=3)
    assert objs == []


def test_a_real_pool_serves_a_capped_snapshot_over_its_socket(pool_service) -> None:
    """`snapshot_pages(recent=N)` of a real service lists its N most recently used objects."""
    with PoolClient.connect(pool_service.address, heartbeat=False) as c:
        for i in range(12):
            assert c.put(chunk_key(i, 0), b"x", namespace=NS, meta=chunk_meta(i, 0))
        assert c.lookup([chunk_key(0, 0)], namespace=NS) == [True]  # chunk 0: most recently used
        pages = list(c.snapshot_pages(NS, page_size=3, recent=4))
        everything = list(c.snapshot_pages(NS))
    assert [o.key for pg in pages for o in pg.objects] == [chunk_key(i, 0).hex() for i in (0, 9, 10, 11)]
    assert sum(len(pg.objects) for pg in everything) == 12  # no cap: all of them


def test_the_worker_option_reaches_the_relay_and_a_bad_value_stops_it_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from maru_dynamo.components import dynamo_hooks as dynamo_hook
    from maru_dynamo.components import maru_worker
    from tests.events.test_dynamo_hook import FakePublisher, _fake_config

    ours, rest = maru_worker.build(["--maru-pool-address", "a", "--maru-pool-name", "kv"])
    assert ours.maru_announce_max_chunks is None  # default: no cap
    ours, rest = maru_worker.build(
        ["--maru-pool-address", "a", "--maru-pool-name", "kv", "--maru-announce-max-chunks", "5000"]
    )
    assert ours.maru_announce_max_chunks == 5000 and "--maru-announce-max-chunks" not in rest
    with pytest.raises(SystemExit, match=r"--maru-announce-max-chunks 0: must be a number of chunks >= 1"):
        maru_worker.build(["--maru-pool-address", "a", "--maru-announce-max-chunks", "0"])
    with pytest.raises(ValueError, match="max_announced_chunks=-1"):
        dynamo_hook.install_pool_event_relay(pool_name="p", max_announced_chunks=-1)

    import types

    fake = types.ModuleType("dynamo.vllm.main")

    def setup_kv_event_publisher(config, generate_endpoint, vllm_config):
        ep = config.engine_args.kv_events_config.endpoint.replace("*", "127.0.0.1")
        return [fake.KvEventPublisher(endpoint=generate_endpoint, kv_block_size=16, zmq_endpoint=ep, dp_rank=0)]

    fake.setup_kv_event_publisher = setup_kv_event_publisher
    fake.KvEventPublisher = FakePublisher
    monkeypatch.setitem(__import__("sys").modules, "dynamo.vllm.main", fake)
    import dynamo.vllm

    monkeypatch.setattr(dynamo.vllm, "main", fake, raising=False)
    inst = dynamo_hook.install_pool_event_relay(
        pool_name="p", nats_url="nats://127.0.0.1:1", pool_address="unix:///x.sock", max_announced_chunks=5000
    )
    try:
        config, vllm_config = _fake_config("tcp://*:5998")
        fake.setup_kv_event_publisher(config, "EP", vllm_config)
        [relay] = inst.relays
        assert relay.view.max_objects == 5000
        assert relay.source is not None and relay.source.config.snapshot_recent == 5000
    finally:
        inst.uninstall()
        dynamo_hook._installed = None


def test_a_capped_relay_takes_the_pools_recency_again_once_its_set_turned_over(pool_service, nats) -> None:
    """Reads reach the pool, not the relay: after N withdrawals the relay resyncs, and a chunk
    the pool used since comes back into what the router is credited with."""
    from maru_vllm.events.nats_source import PoolSourceConfig
    from maru_vllm.events.relay import KvEventRelay, RelayThread
    from maru_vllm.launch import free_port
    from tests.events.test_relay import Downstream
    from tests.waiting import wait_until

    thread = RelayThread("test-capped-relay")
    c = PoolClient.connect(pool_service.address)

    async def start() -> KvEventRelay:
        r = KvEventRelay(
            upstream=f"tcp://127.0.0.1:{free_port()}",
            pool=PoolSourceConfig(nats[1], pool_service.pool_name, pool_address=pool_service.address),
            namespaces=NamespaceFilter.exactly(NS),
            block_size=BLOCK,
            max_announced_chunks=3,
            reannounce_after_s=(),
        )
        await r.start()
        return r

    relay = thread.call(start())
    down = Downstream(relay.endpoint)
    router = Credit()

    def credited() -> set[int]:
        down.pump()
        router.blocks.clear()
        for _, batch, _ in down.got:
            for e in batch.events:
                (router.blocks.update if isinstance(e, vf.BlockStored) else router.blocks.difference_update)(
                    e.block_hashes
                )
        return router.blocks

    try:
        wait_until(lambda: relay.source is not None and relay.source.synced, what="relay synced")
        for p in range(5):
            assert c.put(chunk_key(p, 0), b"x", namespace=NS, meta=chunk_meta(p, 0))
        wait_until(lambda: credited() == _chunk_blocks(2) | _chunk_blocks(3) | _chunk_blocks(4), what="newest 3")
        assert relay.source.stats.resyncs == 1 and relay.view.cap_withdrawals == 2
        assert c.lookup([chunk_key(0, 0)], namespace=NS) == [True]  # the pool uses chunk 0 again
        assert c.put(chunk_key(5, 0), b"x", namespace=NS, meta=chunk_meta(5, 0))  # 3rd withdrawal: resync
        want = _chunk_blocks(0) | _chunk_blocks(4) | _chunk_blocks(5)
        wait_until(lambda: relay.source.stats.resyncs == 2 and credited() == want, what="the pool's recency back")
        assert len(relay.view) == 3 and relay.view.blocks == want
        assert [seq for seq, _, _ in down.got] == list(range(len(down.got)))
    finally:
        down.close()
        c.close()
        thread.stop([relay])


def test_a_capped_snapshot_counts_only_the_namespaces_asked_for() -> None:
    idx = PoolIndex(Allocator(4 << 20), 4096, lambda kind, obj: None)
    sid = idx.open_session()
    for ns in ("kv:m:1", "kv:other:1"):  # the other model's objects are the most recently used
        for i in range(5):
            (o,) = idx.reserve(sid, ns, [(b"k%d" % i, 10)])
            idx.commit(sid, [o.oid], [b'{"a":1}'], lambda o: None)
    objs, _ = idx.snapshot_page(None, 0, 100, 1 << 20, recent=3, prefixes=["kv:m:"])
    assert [(o.ns, o.key) for o in objs] == [("kv:m:1", b"k2"), ("kv:m:1", b"k3"), ("kv:m:1", b"k4")]
    objs, _ = idx.snapshot_page(None, 0, 100, 1 << 20, prefixes=["kv:other:", "kv:none:"])
    assert {o.ns for o in objs} == {"kv:other:1"} and len(objs) == 5


def test_a_capped_relay_over_nats_announces_its_models_most_recently_used_chunks(pool_service, nats) -> None:
    """Without a pool address the relay's snapshots come over NATS: they too list only the N most
    recently used objects, counted among the namespaces the relay follows (another model's
    objects, used since, do not push this model's out)."""
    from maru_vllm.events.nats_source import PoolSourceConfig
    from maru_vllm.events.relay import KvEventRelay, RelayThread
    from maru_vllm.launch import free_port
    from tests.events.test_relay import Downstream
    from tests.waiting import wait_until

    with PoolClient.connect(pool_service.address) as c:
        for p in range(5):
            assert c.put(chunk_key(p, 0), b"x", namespace=NS, meta=chunk_meta(p, 0))
        for p in range(5, 10):
            assert c.put(chunk_key(p, 0), b"x", namespace="kv:other:1", meta=chunk_meta(p, 0))
        assert c.lookup([chunk_key(1, 0)], namespace=NS) == [True]  # chunk 1: used again
    thread = RelayThread("test-capped-relay-nats")

    async def start() -> KvEventRelay:
        r = KvEventRelay(
            upstream=f"tcp://127.0.0.1:{free_port()}",
            pool=PoolSourceConfig(nats[1], pool_service.pool_name),  # no address: snapshots over NATS
            namespaces=NamespaceFilter(prefixes=("kv:m:",)),
            block_size=BLOCK,
            max_announced_chunks=3,
            reannounce_after_s=(),
        )
        await r.start()
        return r

    relay = thread.call(start())
    down = Downstream(relay.endpoint)
    try:
        wait_until(lambda: relay.source is not None and relay.source.synced, what="relay synced")
        assert relay.source.config.snapshot_prefixes == ("kv:m:",)
        want = _chunk_blocks(1) | _chunk_blocks(3) | _chunk_blocks(4)
        wait_until(lambda: down.pump() is None and relay.view.blocks == want, what="the 3 most recent of this model")
        stored = {h for _, batch, _ in down.got for e in batch.events for h in e.block_hashes}
        assert stored == want
    finally:
        down.close()
        thread.stop([relay])
