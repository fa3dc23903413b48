"""Tier-2 credit: the capped view of the cluster's tier-2 chunks a worker announces at the disk
tier, and the relay announcing it (real nats-server, real pool service, vLLM's wire format)."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import nats as nats_py
import pytest

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.nats_source import PoolSourceConfig
from maru_vllm.events.pool_view import NamespaceFilter
from maru_vllm.events.tier2_credit import Tier2CreditConfig, Tier2CreditView
from maru_vllm.events.types import BlocksRemoved, BlocksStored
from maru_vllm.pool import PoolClient
from maru_vllm.pool.chunk_codec import ChunkMeta
from maru_vllm.pool.tier2.announce import KEYS_SUBJECT, Tier2Announcement, Tier2Entry
from tests.events.helpers import BLOCK, chunk_key, chunk_meta, ext
from tests.events.test_relay import Downstream, relay_factory, vllm_pub  # noqa: F401  (fixtures)
from tests.waiting import wait_until

NS = "kv:m:1"


def entry(prefix: int, chunk: int, ns: str = NS, meta: bool = True, block_size: int = BLOCK) -> Tier2Entry:
    m = msgspec.convert(chunk_meta(prefix, chunk, block_size=block_size), ChunkMeta) if meta else None
    return Tier2Entry(ns, chunk_key(prefix, chunk), 100, 200, m)


def view(cap: int = 8) -> Tier2CreditView:
    return Tier2CreditView(NamespaceFilter(prefixes=("kv:m:",)), BLOCK, cap, int_hashes=True)


def stored_blocks(out) -> list:
    return [h for a in out if isinstance(a, BlocksStored) for h in a.block_hashes]


def removed_blocks(out) -> list:
    return [h for a in out if isinstance(a, BlocksRemoved) for h in a.block_hashes]


def test_a_chunk_is_announced_with_its_blocks_tokens_and_parent_and_withdrawn_when_gone():
    v = view()
    out = v.stored([entry(1, 0), entry(1, 1)])
    assert stored_blocks(out) == [ext(1, b) for b in range(4)]
    first, second = out
    assert first.parent_block_hash is None
    assert list(first.token_ids) == [t for b in chunk_meta(1, 0)["token_ids"] for t in b]
    assert second.parent_block_hash == ext(1, 1)
    assert v.stored([entry(1, 1)]) == []  # announced again by another pool: nothing new
    assert removed_blocks(v.gone([entry(1, 1, meta=False)])) == [ext(1, 2), ext(1, 3)]
    assert removed_blocks(v.gone([entry(1, 1, meta=False)])) == []  # gone twice
    assert len(v) == 1 and v.block_count == 2
    assert removed_blocks(v.clear()) == [ext(1, 0), ext(1, 1)] and len(v) == 0


def test_what_is_not_this_workers_chunk_is_not_announced():
    v = view()
    assert v.stored([entry(1, 0, ns="kv:other:1")]) == []  # another model
    assert v.stored([entry(1, 0, meta=False)]) == []  # a pool without metadata
    assert v.stored([entry(1, 0, block_size=BLOCK * 2)]) == []  # another block size
    assert len(v) == 0


def test_the_cap_withdraws_the_least_recently_announced_and_counts_and_logs(caplog):
    v = view(cap=2)
    v.stored([entry(1, 0), entry(2, 0)])
    v.stored([entry(1, 0)])  # announced again: most recent now
    with caplog.at_level(logging.WARNING, logger="maru_vllm.events.tier2_credit"):
        out = v.stored([entry(3, 0)])
    assert stored_blocks(out) == [ext(3, 0), ext(3, 1)]
    assert removed_blocks(out) == [ext(2, 0), ext(2, 1)]
    assert len(v) == 2 and v.cap_dropped == 1 and v.block_count == 4
    assert "reached" in caplog.text
    again = v.reannounce()  # every block withdrawn, then stored again (Dynamo's publisher counts stores)
    assert sorted(removed_blocks(again)) == sorted([ext(1, 0), ext(1, 1), ext(3, 0), ext(3, 1)])
    assert sorted(stored_blocks(again)) == sorted(removed_blocks(again))
    assert isinstance(again[0], BlocksRemoved)


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="max_chunks=0"):
        view(cap=0)
    with pytest.raises(ValueError, match="max_chunks=0"):
        Tier2CreditConfig("nats://127.0.0.1:4222", 0)


@pytest.mark.timeout(120)
def test_the_relay_credits_other_domains_tier2_chunks_at_disk(pool_service, nats, vllm_pub, relay_factory):  # noqa: F811
    _, upstream = vllm_pub
    relay = relay_factory(
        upstream=upstream,
        medium="CPU_PINNED",
        data_parallel_rank=0,
        block_size=BLOCK,
        namespaces=NamespaceFilter(prefixes=("kv:m:",)),
        pool=PoolSourceConfig(nats_url=nats[1], pool_name=pool_service.pool_name, probe_interval_s=60),
        tier2=Tier2CreditConfig(nats[1], max_chunks=4),
    )
    wait_until(lambda: relay.source is not None and relay.source.synced, what="relay synced with the pool")
    down = Downstream(relay.endpoint)

    def publish(stored=(), gone=()) -> None:
        async def send():
            nc = await nats_py.connect(nats[1])
            msg = Tier2Announcement("127.0.0.1:1", "kv-other", "inc", list(stored), list(gone))
            await nc.publish(KEYS_SUBJECT, msgspec.msgpack.encode(msg))
            await nc.flush()
            await nc.close()

        asyncio.run(send())

    def at(medium: str, kind: type) -> list:
        return [h for e in down.events() if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]

    try:
        wait_until(lambda: relay.tier2 is not None and relay.tier2.follower._link.nc is not None, what="following")
        publish(stored=[entry(7, 0), entry(7, 1)])
        down.wait(lambda d: len(at("DISK", vf.BlockStored)) == 4, what="tier-2 chunks at DISK")
        assert at("DISK", vf.BlockStored) == [ext(7, b) for b in range(4)]
        assert at("CPU_PINNED", vf.BlockStored) == []

        publish(gone=[entry(7, 1, meta=False)])  # the tier lost it
        down.wait(lambda d: at("DISK", vf.BlockRemoved) == [ext(7, 2), ext(7, 3)], what="withdrawn at DISK")

        c = PoolClient.connect(pool_service.address)  # this worker's pool stores chunk 0 (fetched, say)
        try:
            assert c.put(chunk_key(7, 0), b"x", namespace=NS, meta=chunk_meta(7, 0))
            down.wait(lambda d: at("CPU_PINNED", vf.BlockStored) == [ext(7, 0), ext(7, 1)], what="host store")
            # the disk tier keeps it: Dynamo scores it at the host tier while the pool holds it,
            # and at the disk tier again once the pool evicts it
            down.pump(0.5)
            assert at("DISK", vf.BlockRemoved) == [ext(7, 2), ext(7, 3)]
            assert (NS, chunk_key(7, 0).hex()) in relay.tier2.view
            c.remove([chunk_key(7, 0)], namespace=NS)
            down.wait(lambda d: at("CPU_PINNED", vf.BlockRemoved) == [ext(7, 0), ext(7, 1)], what="host removal")
            down.pump(0.5)
            assert at("DISK", vf.BlockRemoved) == [ext(7, 2), ext(7, 3)]
        finally:
            c.close()
    finally:
        down.close()
