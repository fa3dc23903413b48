"""Object metadata kept in region blocks beside the payloads, not in the service's memory."""

from __future__ import annotations

import logging

import msgspec
import pytest

from maru_vllm.pool import chunk_codec
from maru_vllm.pool.allocator import Allocation, Allocator
from maru_vllm.pool.chunk_codec import ChunkMeta
from maru_vllm.pool.index import PoolIndex
from maru_vllm.pool.records import META_HEADER, MetaIO

DATA = 4096


def _meta(i: int) -> bytes:
    m = ChunkMeta(
        v=1,
        chunk=i,
        block_size=4,
        block_hashes=[f"{i:016x}{b:016x}" for b in range(2)],
        parent_block_hash=None,
        token_ids=[[i, i + 1, i + 2, i + 3]] * 2,
    )
    data = chunk_codec.encode(m)
    assert data is not None
    return data


def _index(capacity: int = 1 << 20, events: list | None = None, **kw) -> tuple[PoolIndex, bytearray]:
    region = bytearray(DATA + capacity)

    def sink(kind, obj):
        if events is not None:
            events.append((kind, obj.key, idx.meta_of(obj)))

    idx = PoolIndex(Allocator(capacity), DATA, sink, meta_io=MetaIO(memoryview(region)), **kw)
    return idx, region


def _store(idx: PoolIndex, sid: int, key: bytes, meta: bytes | None) -> bool:
    (o,) = idx.reserve(sid, "ns", [(key, 100)])
    assert o is not None
    return idx.commit(sid, [o.oid], [meta], lambda o: None) == [True]


def test_metadata_lives_in_the_region_and_is_served_from_it_until_the_object_goes() -> None:
    events: list = []
    idx, region = _index(events=events)
    sid = idx.open_session()
    base = idx.alloc.allocated_bytes
    for i in range(5):
        assert _store(idx, sid, b"k%d" % i, _meta(i))
    obj = idx.objects[("ns", b"k3")]
    assert isinstance(obj.meta, Allocation)  # the index holds where, not the bytes
    at = DATA + obj.meta.offset + META_HEADER
    assert bytes(region[at : at + len(_meta(3))]) == _meta(3)
    assert [o.bmeta for o in idx.snapshot()] == [_meta(i) for i in range(5)]
    assert [e[2] for e in events] == [_meta(i) for i in range(5)]  # stored events carry it
    st = idx.stats()
    assert st["allocated_bytes"] == st["live_object_alloc_bytes"]  # payload and metadata blocks
    assert idx.metadata_bytes == sum(len(b"k%d" % i) + len(_meta(i)) for i in range(5))
    assert idx.remove("ns", None) == 5
    assert [e[0] for e in events[5:]] == ["removed"] * 5 and [e[2] for e in events[5:]] == [_meta(i) for i in range(5)]
    assert idx.alloc.allocated_bytes == base and idx.metadata_bytes == 0


def test_a_damaged_metadata_block_reads_as_no_metadata_in_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    idx, region = _index()
    sid = idx.open_session()
    assert _store(idx, sid, b"k", _meta(1))
    obj = idx.objects[("ns", b"k")]
    assert isinstance(obj.meta, Allocation)
    region[DATA + obj.meta.offset + META_HEADER + 40] ^= 0xFF  # a stray write into the block
    with caplog.at_level(logging.WARNING, logger="maru_vllm.pool.metastore"):
        (info,) = idx.snapshot()
    assert info.bmeta is None and bytes(info.meta) == b"null" and idx.counters["metadata_unreadable"] == 1
    assert [r.getMessage() for r in caplog.records] == ["metadata of ns/6b in the region is damaged; served without it"]


def test_no_region_space_for_the_metadata_refuses_the_commit_and_gives_the_space_back() -> None:
    idx, _ = _index(capacity=256 * 1024)
    sid = idx.open_session()
    (o,) = idx.reserve(sid, "ns", [(b"big", 256 * 1024 - 64)])  # the whole region
    assert o is not None
    assert idx.commit(sid, [o.oid], [_meta(0)], lambda o: None) == [False]
    assert idx.counters["metadata_space_refusals"] == 1 and idx.alloc.allocated_bytes == 0
    assert _store(idx, sid, b"small", _meta(0))  # with room it works


def test_metadata_budget_still_bounds_the_metadata_kept_in_the_region() -> None:
    per = len(b"k0000000") + len(_meta(0))
    idx, _ = _index(metadata_budget=10 * per)
    sid = idx.open_session()
    for i in range(30):
        assert _store(idx, sid, b"k%07d" % i, _meta(0))
        assert idx.metadata_bytes <= 10 * per
    st = idx.stats()
    assert st["objects"] == 10 and st["evictions"] == 20
    assert st["allocated_bytes"] == st["live_object_alloc_bytes"]


def test_a_pool_that_predates_binary_metadata_gets_json_and_a_new_one_binary(pool_factory) -> None:
    from maru_vllm.pool import PoolClient

    meta = chunk_codec.decode(_meta(7))
    p = pool_factory(size="16M")
    with PoolClient.connect(p.address, heartbeat=False) as c:
        assert c.hello["chunk_meta_format"] == chunk_codec.FORMAT
        (r,) = c.reserve([(b"new", 10)], "ns")
        assert c.commit([r], [meta]) == [True]
        c.hello["chunk_meta_format"] = 0  # as an older pool's hello reads (the field absent)
        (r,) = c.reserve([(b"old", 10)], "ns")
        assert c.commit([r], [meta]) == [True]
        (page,) = list(c.snapshot_pages("ns"))
        new, old = page.objects
        assert new.bmeta == _meta(7) and bytes(new.meta) == b"null"
        assert old.bmeta is None and msgspec.json.decode(old.meta, type=ChunkMeta) == meta
        assert [o["meta"] for o in c.snapshot("ns")] == [msgspec.to_builtins(meta)] * 2  # the same to every reader


def test_events_carry_binary_metadata_as_base64_and_the_relay_reads_it() -> None:
    from maru_vllm.events.types import PoolChunk, PoolEvent
    from maru_vllm.pool import messages as M

    ev = M.PoolEventMsg("stored", 1, "inc", "pool", "ns", "6b", 10, bmeta=_meta(2))
    data = M.encode_event(ev)
    assert b'"meta":null' in data  # a relay that predates bmeta sees no metadata: it announces nothing
    got = PoolEvent.from_json(data)
    chunk = PoolChunk.from_meta(got.obj.meta)
    assert got.obj.meta == _meta(2) and chunk is not None and chunk.chunk_index == 2
