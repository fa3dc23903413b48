"""The presence table: lookups answered from the region agree with the service, and never claim
what the pool does not hold beyond what a lookup's reply could (an object evicted right after)."""

from __future__ import annotations

import random
import signal

import pytest
from pool_helpers import pool_cli

from maru_vllm.pool import PoolClient, PoolError
from maru_vllm.pool.allocator import Allocator
from maru_vllm.pool.catalog import NO_META, BlockRef, Identity
from maru_vllm.pool.index import PoolIndex
from maru_vllm.pool.presence import STALE_S, PresenceReader, PresenceTable, table_bytes
from tests.waiting import wait_until

DATA = 4096


def _index(buckets: int, capacity: int = 1 << 20) -> tuple[PoolIndex, PresenceReader, PresenceTable]:
    region = memoryview(bytearray(DATA + table_bytes(buckets) + capacity))
    table = PresenceTable(region, DATA, buckets)
    idx = PoolIndex(Allocator(capacity), DATA + table_bytes(buckets), presence=table)
    return idx, PresenceReader(region, DATA, buckets), table


def _store(idx: PoolIndex, sid: int, key: bytes, parts: list[bytes]) -> bool:
    (o,) = idx.reserve(sid, "ns", [(key, 1000)])
    if o is None:
        return False
    return idx.commit(sid, [o.oid], [None], lambda _: None, [parts]) == [True]


def _agrees(idx: PoolIndex, reader: PresenceReader, probes: list[bytes]) -> int:
    """Check every answer the table gives against the index; returns how many it could not give."""
    unknown = 0
    for key in probes:
        local = reader.lookup_prefix("ns", [key])
        if local is None:
            unknown += 1
        else:
            assert local == idx.lookup_prefix("ns", [key]), key
        parts = reader.lookup_parts("ns", [key])
        if parts is None:
            unknown += 1
        else:
            assert parts == idx.lookup_parts("ns", [key]), key
    return unknown


def test_table_follows_commits_evictions_and_removals_exactly():
    rng = random.Random(7)
    idx, reader, table = _index(buckets=4096, capacity=64 * 4096)  # room for ~60 objects: evictions
    sid = idx.open_session()
    keys = [rng.randbytes(16) for _ in range(300)]
    parts = {k: [rng.randbytes(16) for _ in range(rng.randrange(0, 6))] for k in keys}
    stored = evicted = 0
    for step in range(1500):
        key = rng.choice(keys)
        if rng.random() < 0.1:
            idx.remove("ns", [key])
        elif _store(idx, sid, key, parts[key]):
            stored += 1
        if step % 50 == 0:
            probes = rng.sample(keys, 40) + [p for k in rng.sample(keys, 10) for p in parts[k]]
            assert _agrees(idx, reader, probes) == 0  # a table this size never has to say "ask"
    evicted = idx.counters["evictions"]
    assert stored > 300 and evicted > 100
    assert table.entries == len(idx.objects) + len(idx.parts)
    # what the pool holds is what the table says, key for key
    held = [k for k in keys if ("ns", k) in idx.objects]
    assert held and all(reader.lookup_prefix("ns", [k]) == 1 for k in held)
    assert reader.lookup_prefix("ns", held[:5] + [b"absent"] + held[5:]) == 5


def test_full_bucket_answers_ask_the_service_never_a_false_miss():
    idx, reader, table = _index(buckets=1)  # one bucket of 8 slots
    sid = idx.open_session()
    keys = [bytes([i]) * 8 for i in range(12)]
    for k in keys:
        assert _store(idx, sid, k, [])
    assert table.spilled_entries == 4
    answers = [reader.lookup_prefix("ns", [k]) for k in keys]
    assert answers.count(1) == 8 and answers.count(None) == 4  # the spilled four: "ask"
    assert reader.lookup_prefix("ns", [b"absent"]) is None  # a full bucket cannot say "absent"
    # a freed slot takes a spilled key at once: every held key stays findable or unknown
    idx.remove("ns", [keys[0]])
    assert table.spilled_entries == 3
    for k in keys[1:]:
        assert reader.lookup_prefix("ns", [k]) in (1, None)
    for k in keys[1:6]:
        idx.remove("ns", [k])
    assert table.spilled_entries == 0 and table.entries == 6
    assert [reader.lookup_prefix("ns", [k]) for k in keys] == [0] * 6 + [1] * 6


def test_part_units_follow_the_newest_holder():
    idx, reader, _ = _index(buckets=64)
    sid = idx.open_session()
    part = b"p" * 16
    assert _store(idx, sid, b"a" * 16, [b"x" * 16, part])  # part names 2 units of a
    assert reader.lookup_parts("ns", [part, b"x" * 16, b"none"]) == [2, 1, 0]
    assert _store(idx, sid, b"b" * 16, [part])  # and 1 unit of b, the newest
    assert reader.lookup_parts("ns", [part]) == idx.lookup_parts("ns", [part]) == [1]
    idx.remove("ns", [b"b" * 16])
    assert reader.lookup_parts("ns", [part]) == [2]
    idx.remove("ns", [b"a" * 16])
    assert reader.lookup_parts("ns", [part, b"x" * 16]) == [0, 0]


def test_a_restored_index_fills_the_table_as_the_commits_did():
    """A warm restart refills the table in bulk; every answer equals the one the live pool gave,
    part keys named by several objects included (the newest holder's units)."""
    rng = random.Random(11)
    idx, reader, table = _index(buckets=4096, capacity=16 * 4096)
    sid = idx.open_session()
    shared = [rng.randbytes(16) for _ in range(8)]  # part keys several objects name
    keys = [rng.randbytes(16) for _ in range(200)]
    parts = {k: rng.sample(shared, rng.randrange(0, 4)) + [rng.randbytes(16)] for k in keys}
    for _ in range(600):
        key = rng.choice(keys)
        if rng.random() < 0.1:
            idx.remove("ns", [key])
        else:
            _store(idx, sid, key, parts[key])
    assert idx.counters["evictions"] > 0
    found = [
        (
            Identity(o.oid, o.cseq, o.size, o.ns, o.key, o.parts, NO_META, BlockRef(0, 0, -1), BlockRef(0, 0, -1)),
            o.alloc,
            o.alloc,
            -1,
        )
        for o in idx.objects.values()
    ]
    rng.shuffle(found)  # restore orders them by commit itself
    again, reader2, table2 = _index(buckets=4096, capacity=16 * 4096)
    again.restore(found)
    assert table2.entries == table.entries == len(idx.objects) + len(idx.parts)
    probes = keys + shared + [p for k in keys for p in parts[k]] + [b"absent" * 3]
    for key in probes:
        assert reader2.lookup_prefix("ns", [key]) == reader.lookup_prefix("ns", [key]), key
        assert reader2.lookup_parts("ns", [key]) == reader.lookup_parts("ns", [key]), key
    assert any(len(h) > 1 for h in idx.parts.values())  # the case the test is about happened
    held_shared = [p for p in shared if ("ns", p) in idx.parts]
    assert held_shared and reader2.lookup_parts("ns", held_shared) == idx.lookup_parts("ns", held_shared)


def test_client_lookups_need_no_round_trip_and_stop_when_the_pool_dies(pool_factory):
    p = pool_factory()
    keys = [bytes([i]) * 16 for i in range(6)]
    with PoolClient.connect(p.address) as writer, PoolClient.connect(p.address, local_lookups=True) as reader:
        for i, k in enumerate(keys[:4]):
            assert writer.put(k, b"v" * 4096, "ns", parts=[bytes([i]) * 15])
        assert reader.presence is not None
        hits_before = writer.stats()["hits"]
        assert reader.lookup_prefix(keys, "ns") == 4 == writer.lookup_prefix(keys, "ns")
        assert reader.lookup_parts([bytes([1]) * 15, b"none"], "ns") == [1, 0]
        assert reader.lookups_local == 2 and reader.lookups_asked == 0
        # the service never saw those two lookups (only the writer's own)
        assert writer.stats()["hits"] == hits_before + 4
        writer.remove([keys[0]], "ns")
        assert reader.lookup_prefix(keys, "ns") == 0  # another process's removal, seen at once
        p.proc.send_signal(signal.SIGKILL)
        p.proc.wait(10)
        # a killed service's table stops answering within STALE_S: lookups ask the service and
        # find it gone, instead of claiming what a dead pool held
        wait_until(lambda: not reader.presence.live, timeout=STALE_S + 5, what="table goes stale")
        with pytest.raises(PoolError):
            reader.lookup_prefix(keys, "ns")


def test_told_to_ask_the_service_lookups_skip_the_table_until_the_time_is_up(pool_factory):
    p = pool_factory()
    with PoolClient.connect(p.address, local_lookups=True) as c:
        assert c.put(b"k" * 16, b"v" * 100, "ns")
        assert c.lookup_prefix([b"k" * 16], "ns") == 1 and (c.lookups_local, c.lookups_asked) == (1, 0)
        c.ask_service_for(30)
        assert c.lookup_prefix([b"k" * 16], "ns") == 1 and (c.lookups_local, c.lookups_asked) == (1, 1)
        c.ask_service_for(0)  # never shortens a pause already asked for
        assert c.lookup_parts([b"none"], "ns") == [0] and c.lookups_asked == 2


def test_pool_without_a_table_answers_every_lookup_itself(pool_factory):
    p = pool_factory(extra=["--presence-buckets", "0"])
    with PoolClient.connect(p.address, local_lookups=True) as c:
        assert c.put(b"k" * 16, b"v" * 100, "ns")
        assert c.presence is None
        assert c.lookup_prefix([b"k" * 16], "ns") == 1 and c.lookups_asked == 1 and c.lookups_local == 0


@pytest.mark.parametrize(
    "value,message",
    [("3", "invalid bucket count '3': use 0 (no table) or a power of two"), ("lots", "invalid bucket count 'lots'")],
)
def test_bad_bucket_count_is_one_clear_line(value, message):
    out = pool_cli("serve", "--name", "bad-presence", "--size", "16M", "--presence-buckets", value)
    assert out.returncode != 0 and message in out.stderr
    assert len([line for line in out.stderr.splitlines() if "invalid bucket count" in line]) == 1


def test_table_larger_than_half_the_region_is_refused(pool_factory, sockdir):
    out = pool_cli(
        "serve",
        "--name",
        "big-presence",
        "--size",
        "16M",
        "--listen",
        f"unix://{sockdir}/big.sock",
        "--presence-buckets",
        str(1 << 20),
    )
    assert out.returncode == 1
    assert "presence table of 1048576 buckets" in out.stderr and "0 for none" in out.stderr
