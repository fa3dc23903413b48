"""Relays that resync together share the pool's encoded snapshot pages, and never a stale one."""

from __future__ import annotations

from test_scale import _fill

from maru_vllm.pool import PoolClient
from maru_vllm.pool.snapshot_pages import SharedPages


def _read_all(address: str, recent: int = 0) -> list[list[str]]:
    """Every page's object keys, read by a fresh client (as a restarted relay does)."""
    with PoolClient.connect(address, heartbeat=False) as c:
        return [[o.key for o in page.objects] for page in c.snapshot_pages(recent=recent)]


def _counts(address: str) -> tuple[int, int]:
    with PoolClient.connect(address, heartbeat=False) as c:
        st = c.stats()
    return st["snapshot_pages_encoded"], st["snapshot_pages_shared"]


def test_readers_of_an_unchanged_pool_get_the_first_readers_pages_without_encoding_them_again(pool_factory) -> None:
    p = pool_factory(size="64M")
    with PoolClient.connect(p.address, heartbeat=False) as c:
        assert _fill(c, 3000, blocks=32) == 3000  # ~8 MiB of metadata: a few 4 MiB pages
    first = _read_all(p.address)
    assert len(first) >= 2 and sum(map(len, first)) == 3000
    encoded, shared = _counts(p.address)
    assert (encoded, shared) == (len(first), 0)
    for _ in range(3):
        assert _read_all(p.address) == first
    assert _counts(p.address) == (len(first), 3 * len(first))


def test_a_commit_between_two_readers_is_in_the_second_readers_snapshot(pool_factory) -> None:
    p = pool_factory(size="64M")
    with PoolClient.connect(p.address, heartbeat=False) as c:
        assert _fill(c, 3000, blocks=32) == 3000
        first = _read_all(p.address)
        assert _fill(c, 1, start=3000, blocks=32) == 1
        second = _read_all(p.address)
        c.remove([b"k%08d" % 0], "default")
        third = _read_all(p.address)
    keys = [k for page in second for k in page]
    assert len(keys) == 3001 and (b"k%08d" % 3000).hex() in keys
    assert (b"k%08d" % 0).hex() not in [k for page in third for k in page]
    assert sum(map(len, third)) == 3000
    encoded, shared = _counts(p.address)
    assert shared == 0 and encoded == len(first) + len(second) + len(third)


def test_without_shared_pages_every_reader_has_its_pages_encoded(pool_factory) -> None:
    p = pool_factory(size="64M", extra=["--shared-snapshot-pages", "0"])
    with PoolClient.connect(p.address, heartbeat=False) as c:
        assert _fill(c, 200) == 200
    assert _read_all(p.address) == _read_all(p.address)
    assert _counts(p.address) == (2, 0)


def test_pages_of_the_most_recently_used_are_encoded_for_every_reader(pool_factory) -> None:
    # reads move the LRU order without an event: such pages are never shared
    p = pool_factory(size="64M")
    with PoolClient.connect(p.address, heartbeat=False) as c:
        assert _fill(c, 200) == 200
    a, b = _read_all(p.address, recent=50), _read_all(p.address, recent=50)
    assert a == b and sum(map(len, a)) == 50
    assert _counts(p.address) == (2, 0)


def test_shared_pages_stay_within_their_page_and_byte_bounds_and_drop_the_least_recently_asked() -> None:
    pages = SharedPages(max_pages=3, max_bytes=100)
    for i in range(3):
        pages.put(i, 7, b"x" * 30)
    assert pages.get(0, 7) == b"x" * 30  # 0 is now the most recently asked for
    pages.put(3, 7, b"y" * 30)  # a fourth page: 1 goes
    assert len(pages) == 3 and pages.get(1, 7) is None and pages.get(0, 7) is not None
    pages.put(4, 7, b"z" * 60)  # past 100 bytes: the oldest go until it fits
    assert pages.nbytes <= 100 and pages.get(4, 7) == b"z" * 60
    pages.put(5, 7, b"w" * 101)  # larger than the whole budget: not kept
    assert pages.get(5, 7) is None
    assert pages.get(4, 8) is None and len(pages) == 0 and pages.nbytes == 0  # the pool changed: all stale
