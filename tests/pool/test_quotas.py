"""Per-session quotas (reservations, pins), the pin cap per object, and required checksums."""

from __future__ import annotations

import pytest

from maru_vllm.pool import PoolClient
from maru_vllm.pool import index as index_mod
from maru_vllm.pool.allocator import Allocator

K300 = 300_000


def test_one_session_cannot_reserve_more_than_its_quota(pool_factory):
    p = pool_factory(size="8M", extra=["--session-reserve-limit", "1M"])
    with PoolClient.connect(p.address) as a, PoolClient.connect(p.address) as b:
        res = a.reserve([(b"a%d" % i, K300) for i in range(10)])
        got = [r for r in res if r is not None]
        assert 2 <= len(got) <= 3 and res[-1] is None  # ~1M worth, the rest refused
        assert a.put(b"big", b"x" * 2_000_000) is False  # a refused store is a clean skip
        (rb,) = b.reserve([(b"b", K300)])  # another session is unaffected
        assert rb is not None
        b.abort([rb])
        st = a.stats()
        assert st["quota_refusals"] >= 8 and st["session_reserve_limit"] == 1 << 20
        for r in got:
            r.buffer[:] = b"y" * K300
        assert a.commit(got) == [True] * len(got)
        assert a.reserve([(b"after", K300)])[0] is not None  # committing gave the quota back


def test_default_reserve_quota_is_half_the_pool(pool_factory):
    p = pool_factory(size="8M")
    with PoolClient.connect(p.address) as a:
        res = a.reserve([(b"k%d" % i, 1_000_000) for i in range(7)])
        assert 3 <= sum(r is not None for r in res) <= 4
        assert a.stats()["session_reserve_limit"] == 4 << 20


def test_one_session_cannot_pin_more_than_its_quota(pool_factory):
    p = pool_factory(size="8M", extra=["--session-pin-limit", "1M"])
    with PoolClient.connect(p.address) as a, PoolClient.connect(p.address) as b:
        keys = [b"p%d" % i for i in range(10)]
        for k in keys:
            assert a.put(k, b"z" * K300)
        pins = a.acquire(keys)
        held = [x for x in pins if x is not None]
        assert 2 <= len(held) <= 3 and pins[-1] is None  # past the quota a read is a miss
        for _ in range(40):  # other sessions' stores still find evictable space
            assert b.put(b"other%d" % _, b"w" * K300)
        assert all(bytes(x.data) == b"z" * K300 for x in held)
        a.release(held)
        assert a.stats()["pins"] == 0


def test_pins_per_object_are_capped(pool_factory):
    p = pool_factory(extra=["--max-pins-per-object", "3"])
    with PoolClient.connect(p.address) as a, PoolClient.connect(p.address) as b:
        assert a.put(b"hot", b"h" * 1000)
        pins = a.acquire([b"hot"] * 2) + b.acquire([b"hot"] * 2)
        assert sum(x is not None for x in pins) == 3
        a.release(pins[:2])
        assert b.acquire([b"hot"])[0] is not None


def test_index_quota_accounting_returns_to_zero():
    idx = index_mod.PoolIndex(
        Allocator(64 << 20),
        4096,
        None,
        index_mod.SessionLimits(reserve_bytes=1 << 20, pin_bytes=1 << 20, pins_per_object=2),
    )
    s = idx.open_session()
    objs = idx.reserve(s, "ns", [(b"k%d" % i, 400_000) for i in range(4)])
    assert [o is not None for o in objs] == [True, True, False, False]
    idx.commit(s, [o.oid for o in objs if o], [None, None], lambda o: None)
    assert idx.sessions[s].reserved_bytes == 0
    pins = idx.acquire(s, "ns", [b"k0", b"k1", b"k0", b"k0"])
    assert [o is not None for o in pins] == [True, True, True, False]  # k0's third pin hits the per-object cap
    assert idx.sessions[s].pinned_bytes >= 800_000
    idx.release(s, [o.oid for o in pins if o])
    assert idx.sessions[s].pinned_bytes == 0
    assert idx.counters["quota_refusals"] == 3


def test_checksum_readers_reject_objects_without_a_checksum(pool):
    with PoolClient.connect(pool.address) as plain, PoolClient.connect(pool.address, checksum=True) as strict:
        assert plain.put(b"unsummed", b"u" * 5000)
        assert strict.put(b"summed", b"s" * 5000)
        (pin,) = strict.acquire([b"unsummed"])
        assert pin is None  # a stale or foreign writer's bytes cannot be vouched for: a miss
        with strict.get(b"summed") as v:
            assert bytes(v) == b"s" * 5000
        with plain.get(b"summed") as v:  # a plain reader still verifies a checksum that is there
            assert bytes(v) == b"s" * 5000
        assert strict.stats()["corrupt_reads"] == 1
        assert strict.put(b"unsummed", b"u" * 5000)  # a good copy can replace it


@pytest.mark.parametrize("checksum", [True, False])
def test_connector_always_writes_checksums(pool, checksum):
    from maru_vllm.connector.pool_access import PoolAccess

    access = PoolAccess(pool.address, None, 5.0, checksum, "test")
    try:
        assert access.client.put(b"from-connector", b"c" * 4096)
    finally:
        access.close()
    with PoolClient.connect(pool.address, checksum=True) as strict, strict.get(b"from-connector") as v:
        assert v is not None and bytes(v) == b"c" * 4096


def test_a_stale_writer_cannot_hand_a_checksum_reader_bad_bytes(pool_factory):
    """A writer paused past its lease writes into space the pool gave to a newer object."""
    from maru_vllm.connector.pool_access import PoolAccess
    from tests.waiting import wait_until

    p = pool_factory(size="2M", extra=["--lease-seconds", "0.5"])
    stale = PoolClient.connect(p.address, heartbeat=False)  # "paused": sends nothing
    watcher = PoolClient.connect(p.address)
    writer = PoolAccess(p.address, None, 5.0, False, "test")  # a connector with maru_checksum=false
    try:
        (old,) = stale.reserve([(b"old", 1_000_000)])
        wait_until(lambda: watcher.stats()["sessions_expired"] >= 1, what="the stale writer's lease expired")
        assert writer.client.put(b"new", b"N" * 1_000_000)
        old.buffer[:] = b"S" * 1_000_000  # resumed: it still writes where its reservation was
        with PoolClient.connect(p.address, checksum=True) as reader, reader.get(b"new") as v:
            assert v is None or bytes(v) == b"N" * 1_000_000
            assert v is None  # the overwrite is detected, not served
    finally:
        stale.close()
        watcher.close()
        writer.close()
