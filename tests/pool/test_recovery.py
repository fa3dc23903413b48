"""Warm restarts: a pool service started on the region a killed or stopped one left recovers it.

Real pool processes (SIGKILLed, SIGTERMed, started again with the same command line) and real
clients; the region's bytes are damaged directly where a test needs a torn object.
"""

from __future__ import annotations

import mmap
import os
import random
import signal

import pytest
from pool_helpers import pool_cli

from maru_vllm.pool import PoolClient, PoolUnavailable
from maru_vllm.pool.allocator import PAGE, Allocator
from maru_vllm.pool.catalog import Catalog
from maru_vllm.pool.chunk_codec import ChunkMeta
from maru_vllm.pool.index import PoolIndex
from maru_vllm.pool.records import MetaIO
from maru_vllm.pool.region import EXT_AT
from tests.waiting import wait_until

NS = "kv:restart"


def _payload(i: int, size: int = 3000) -> bytes:
    return random.Random(i).randbytes(size)


def _meta(i: int) -> ChunkMeta:
    return ChunkMeta(
        v=1,
        chunk=i,
        block_size=4,
        block_hashes=[f"{i:016x}{b:016x}" for b in range(2)],
        parent_block_hash=None,
        token_ids=[[i, i + 1, i + 2, i + 3]] * 2,
    )


def _put(c: PoolClient, key: bytes, i: int, size: int = 3000) -> None:
    (r,) = c.reserve([(key, size)], NS)
    assert r is not None
    r.buffer[:] = _payload(i, size)
    assert c.commit([r], [_meta(i)], [[key + b"/p0"]]) == [True]


def _damage(path, needle: bytes, at: int = 0) -> None:
    """Flip one byte of the region file at the first place `needle` occurs (+ `at`)."""
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        pos = mm.find(needle)
        assert pos >= 0, needle
        mm[pos + at] ^= 0xFF


def _leak_free(st: dict) -> bool:
    return (
        st["reserved"] == 0
        and st["pins"] == 0
        and st["allocated_bytes"] == st["live_object_alloc_bytes"]
        and st["allocator_consistent"]
    )


def _connect(address: str, **kw) -> PoolClient:
    return wait_until(lambda: _try(lambda: PoolClient.connect(address, write_checksum=True, **kw)), 30, "connect")


def _try(fn):
    try:
        return fn()
    except PoolUnavailable:
        return None


@pytest.mark.timeout(180)
def test_sigkilled_pool_restarts_warm_serving_what_verifies_and_freeing_the_rest(pool_factory):
    p = pool_factory(size="16M")
    old = PoolClient.connect(p.address, write_checksum=True, checksum=True)
    keys = [b"chunk-%03d" % i for i in range(40)]
    for i, k in enumerate(keys):
        _put(old, k, i)
    _put(old, b"torn-payload", 100)
    _put(old, b"torn-record!", 101)
    _put(old, b"removed", 102)
    assert old.remove([b"removed"], NS) == 1
    held = old.acquire([keys[0]], NS)[0]  # a reader mid-copy when the service dies
    assert held is not None
    (straddle,) = old.reserve([(b"half-written", 3000)], NS)  # a writer mid-copy when it dies
    straddle.buffer[:1000] = _payload(103, 1000)
    before = old.stats()
    old_inc = old.incarnation

    p.kill()  # SIGKILL: no clean stop
    _damage(p.region_path, _payload(100)[:64], 10)  # a payload byte changed after its commit
    _damage(p.region_path, b"torn-record!", 0)  # its record no longer verifies
    p.restart()
    p.wait_ready()

    c = _connect(p.address, checksum=True, local_lookups=True)
    try:
        st = c.stats()
        assert st["last_stop"] == "unclean"
        assert st["recovered_objects"] == len(keys) and st["recovery_dropped"] == 2, st
        assert st["objects"] == len(keys) and st["incarnation"] != old_inc
        assert st["region_path"] == before["region_path"]
        assert _leak_free(st), st
        # every recovered object reads back byte for byte, with its metadata and part key
        pins = c.acquire(keys, NS)
        assert all(pin is not None and bytes(pin.data) == _payload(i) for i, pin in enumerate(pins))
        c.release(pins)
        assert c.lookup_parts([keys[5] + b"/p0"], NS) == [1]
        metas = {o["key"]: o["meta"] for o in c.snapshot(NS)}
        assert metas[keys[7].hex()]["chunk"] == 7 and len(metas) == len(keys)
        # what did not verify, was removed, or was never committed is gone - for lookups from the
        # presence table too, which the new service rebuilt before it answered anyone
        gone = [b"torn-payload", b"torn-record!", b"removed", b"half-written"]
        assert c.lookup(gone, NS) == [False] * 4
        assert c.lookup_prefix(keys[:3], NS) == 3 and c.lookups_local >= 1
        assert c.lookup_prefix([b"torn-payload"], NS) == 0
        # new objects get new oids (no stale header can match them) and fill the freed space
        _put(c, b"after", 7)
        with c.get(b"after", NS) as v:
            assert v is not None and bytes(v) == _payload(7)

        # the old client: its pin is inert but still shows the recovered (same) bytes; its
        # half-written reservation can never be committed; it reconnects to the new service
        assert bytes(held.data) == _payload(0)
        assert old.commit([straddle]) == [False]  # the header names another incarnation: nothing written
        old.release([held])
        assert wait_until(lambda: _try(lambda: old.lookup([keys[1]], NS))) == [True]
        assert old.incarnation == st["incarnation"]
        assert c.lookup([b"half-written"], NS) == [False]
        assert _leak_free(c.stats())
    finally:
        c.close()
        old.close()


@pytest.mark.timeout(120)
def test_clean_stop_with_keep_region_restarts_warm_and_the_header_says_it_was_clean(pool_factory):
    p = pool_factory(size="8M", extra=["--keep-region"])
    with PoolClient.connect(p.address, write_checksum=True) as c:
        _put(c, b"kept", 1)
    p.serve()  # SIGTERM, then the same command again
    with _connect(p.address) as c:
        st = c.stats()
        assert st["last_stop"] == "clean" and st["recovered_objects"] == 1
        with c.get(b"kept", NS) as v:
            assert v is not None and bytes(v) == _payload(1)
    p.proc.send_signal(signal.SIGTERM)
    p.proc.wait(30)
    assert p.region_path.exists()  # --keep-region


@pytest.mark.timeout(120)
def test_recover_refuses_a_region_it_cannot_recover_in_one_line(pool_factory, sockdir):
    p = pool_factory(size="8M", extra=["--keep-region"])
    with PoolClient.connect(p.address, write_checksum=True) as c:
        _put(c, b"x", 1)
    p.stop()
    base = ["serve", "--name", p.pool_name, "--listen", f"unix://{sockdir}/other.sock"]

    def refused(*args: str) -> str:
        out = pool_cli(*base, *args, "--recover", timeout=60)
        err = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(err) == 1, out.stderr
        assert str(p.region_path) in err[0]
        return err[0]

    assert "asks for 16777216 (--size)" in refused("--size", "16M")
    assert "--max-objects" in refused("--size", "8M", "--max-objects", "100")
    assert "--presence-buckets" in refused("--size", "8M", "--presence-buckets", "64")
    # a region of another layout version or catalog format (another release's): refused, and kept
    for at, field, says in ((8, "layout version", "layout version is 99"), (EXT_AT + 8, "format", "format 99")):
        with open(p.region_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            was = bytes(mm[at : at + 4])
            mm[at : at + 4] = (99).to_bytes(4, "little")
        assert says in refused("--size", "8M"), field
        with open(p.region_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            mm[at : at + 4] = was
    os.truncate(p.region_path, 4096)  # not a region any more: too short to hold one
    assert "--size" in refused("--size", "8M")
    p.region_path.unlink()
    assert "there is no region there" in refused("--size", "8M")


def test_allocator_restore_claims_blocks_where_they_were_and_refuses_overlaps() -> None:
    pages = 512
    a = Allocator(pages * PAGE)
    big = [a.alloc(70 * PAGE), a.alloc(80 * PAGE)]  # page runs (over 256 KiB)
    small = [a.alloc(100) for _ in range(5)]  # slots of one slab
    assert all(x is not None for x in big + small) and small[0].slab is not None
    blocks = [(x.offset, x.capacity, x.slab.start_page if x.slab else -1) for x in big + small]
    b = Allocator(pages * PAGE)
    bad = [
        (big[0].offset + PAGE, PAGE, -1),  # overlaps the first run: both go
        ((pages - 1) * PAGE, 2 * PAGE, -1),  # past the end
        (small[0].offset, small[0].capacity, blocks[2][2]),  # the same slot twice: both go
    ]
    got = b.restore(blocks + bad)
    assert got[0] is None and got[1] is not None and got[1].offset == big[1].offset
    assert got[2] is None and all(g is not None for g in got[3:7]) and got[7:] == [None, None, None]
    b.check()
    assert b.allocated_bytes == 80 * PAGE + 4 * small[0].capacity
    assert b.alloc(70 * PAGE) is not None  # the refused run's pages are free again
    for g in got[1:2] + got[3:7]:
        b.free(g)
    b.check()
    assert b.pages.free_pages == pages - 70


def test_catalog_names_exactly_the_visible_objects() -> None:
    heap = 1 << 20
    region = bytearray(4096 + heap)
    cat = Catalog(memoryview(region), 0, 64)
    idx = PoolIndex(Allocator(heap), 4096, meta_io=MetaIO(memoryview(region)), catalog=cat)
    sid = idx.open_session()
    objs = idx.reserve(sid, "ns", [(b"k%d" % i, 100) for i in range(6)])
    assert cat.entries() == []  # reserved is not visible
    idx.commit(sid, [o.oid for o in objs], [b'{"a": 1}', None, None, None, None, None], lambda o: None)
    assert sorted(oid for *_, oid in cat.entries()) == sorted(o.oid for o in objs)
    (pinned,) = idx.acquire(sid, "ns", [b"k0"])
    idx.remove("ns", [b"k0", b"k1"])  # k0 is pinned: hidden now, freed at release
    assert {oid for *_, oid in cat.entries()} == {o.oid for o in objs[2:]}
    idx.release(sid, [pinned.oid])
    assert idx.meta_of(objs[2]) is None and cat.used == 4
