"""In-process tests of the pool's building blocks (allocator, index, region, protocol)."""

from __future__ import annotations

import itertools
import random
import uuid
from pathlib import Path

import msgspec
import pytest

from maru_vllm.pool import protocol as P
from maru_vllm.pool.address import parse_address
from maru_vllm.pool.allocator import PAGE, SMALL_MAX, Allocator
from maru_vllm.pool.errors import InvalidArgument
from maru_vllm.pool.index import PoolIndex
from maru_vllm.pool.objects import OBJ_HEADER_SIZE, key_digest, validate, write_header
from maru_vllm.pool.region import Region, RegionError, dax_geometry, parse_size, resolve_region_path


# -- sizes and addresses ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,value", [("4G", 4 << 30), ("512M", 512 << 20), ("2097152", 2 << 20), ("1.5G", 3 << 29), ("64MiB", 64 << 20)]
)
def test_parse_size_accepts_suffixes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["4X", "-5M", "", "G", "12 apples"])
def test_parse_size_rejects_with_value_and_allowed_forms(text):
    with pytest.raises(ValueError) as e:
        parse_size(text)
    assert repr(text) in str(e.value) and "512M" in str(e.value)


def test_parse_size_rejects_tiny_pool():
    with pytest.raises(ValueError, match="at least 1M"):
        parse_size("1000")


def test_addresses():
    assert parse_address("/tmp/x.sock").path == "/tmp/x.sock"
    assert parse_address("unix:///tmp/x.sock").kind == "unix"
    a = parse_address("tcp://127.0.0.1:5555")
    assert (a.kind, a.host, a.port) == ("tcp", "127.0.0.1", 5555)
    for bad in ["tcp://host", "tcp://h:99999", "http://x", "relative.sock", "unix://" + "/a" * 80]:
        with pytest.raises(InvalidArgument, match="invalid address"):
            parse_address(bad)


# -- allocator --------------------------------------------------------------------------------
def test_allocator_one_size_churn_never_fragments():
    """KV chunks of one size: after heavy random churn, the pool still holds as many as fit."""
    a = Allocator(64 << 20)
    size = 300_000 + OBJ_HEADER_SIZE
    live = []
    while (x := a.alloc(size)) is not None:
        live.append(x)
    full = len(live)
    assert full == (64 << 20) // ((size + PAGE - 1) // PAGE * PAGE)
    rng = random.Random(1)
    for _ in range(20_000):
        if live and rng.random() < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            x = a.alloc(size)
            if x is not None:
                live.append(x)
    while (x := a.alloc(size)) is not None:
        live.append(x)
    assert len(live) == full
    a.check()
    for x in live:
        a.free(x)
    assert a.allocated_bytes == 0 and a.pages.free_pages * PAGE == a.capacity
    assert a.pages.largest_free() * PAGE == a.capacity  # fully coalesced again


def test_allocator_mixed_sizes_returns_empty_slabs_and_blocks_do_not_overlap():
    a = Allocator(32 << 20)
    rng = random.Random(7)
    live = {}
    for _ in range(30_000):
        if live and rng.random() < 0.45:
            k = rng.choice(list(live))
            a.free(live.pop(k))
        else:
            size = rng.choice([100, 5000, 70_000, SMALL_MAX, SMALL_MAX + 1, 2_000_000])
            x = a.alloc(size)
            if x is not None:
                assert x.capacity >= size
                live[object()] = x
    spans = sorted((x.offset, x.offset + x.capacity) for x in live.values())
    for (_, e1), (s2, _) in itertools.pairwise(spans):
        assert e1 <= s2, "two live blocks overlap"
    assert spans[-1][1] <= a.capacity
    a.check()
    for x in list(live.values()):
        a.free(x)
    # every slab went back to the page runs: nothing stranded in a size class
    assert a.slab_bytes == 0 and a.allocated_bytes == 0
    assert a.pages.largest_free() * PAGE == a.capacity


def test_small_class_waste_is_bounded():
    a = Allocator(16 << 20)
    for size in [65, 1000, 3000, 50_000, 200_000]:
        x = a.alloc(size)
        assert size <= x.capacity <= size * 1.125 + 64


# -- index ------------------------------------------------------------------------------------
def _index(capacity=1 << 20, events=None):
    def sink(kind, obj):
        if events is not None:
            events.append((kind, obj.key))

    return PoolIndex(Allocator(capacity), 4096, sink)


def _ok(obj):
    return None


def test_index_write_once_and_duplicate_frees_space():
    idx = _index()
    s1, s2 = idx.open_session(), idx.open_session()
    (a,) = idx.reserve(s1, "ns", [(b"k", 1000)])
    (b,) = idx.reserve(s2, "ns", [(b"k", 1000)])
    assert idx.commit(s1, [a.oid], [b'{"m":1}'], _ok) == [True]
    used = idx.alloc.allocated_bytes
    assert idx.commit(s2, [b.oid], [None], _ok) == [False]
    assert idx.alloc.allocated_bytes < used
    assert idx.reserve(s2, "ns", [(b"k", 10)]) == [None]  # already committed
    assert [(o.namespace, o.key, o.size, bytes(o.meta)) for o in idx.snapshot()] == [
        ("ns", b"k".hex(), 1000, b'{"m":1}')
    ]


def test_index_lru_evicts_oldest_unpinned_and_never_pinned():
    events = []
    idx = _index(capacity=8 * 80 * PAGE, events=events)
    s = idx.open_session()
    size = 80 * PAGE - OBJ_HEADER_SIZE  # 8 objects fill the pool
    for i in range(8):
        (o,) = idx.reserve(s, "d", [(b"%d" % i, size)])
        assert idx.commit(s, [o.oid], [None], _ok) == [True]
    (pinned,) = idx.acquire(s, "d", [b"0"])  # oldest, but pinned
    idx.lookup("d", [b"1"])  # use: 1 becomes most recent
    (o,) = idx.reserve(s, "d", [(b"new", size)])
    assert o is not None
    assert ("removed", b"2") in events  # 0 is pinned, 1 was used, so 2 is the LRU victim
    assert idx.lookup("d", [b"0", b"1", b"2"]) == [True, True, False]
    # a pool full of pinned + reserved objects cannot take more: the store is skipped cleanly
    pins = idx.acquire(s, "d", [b"%d" % i for i in range(8)])
    assert idx.reserve(s, "d", [(b"x", size)]) == [None]
    idx.release(s, [p.oid for p in pins if p] + [pinned.oid])
    assert idx.reserve(s, "d", [(b"x", size)])[0] is not None


def test_index_session_close_releases_reservations_and_pins():
    idx = _index()
    s = idx.open_session()
    (_o,) = idx.reserve(s, "d", [(b"a", 5000)])
    w = idx.open_session()
    (c,) = idx.reserve(w, "d", [(b"b", 5000)])
    idx.commit(w, [c.oid], [None], _ok)
    idx.acquire(s, "d", [b"b", b"b"])
    assert idx.stats()["pins"] == 2 and idx.stats()["reserved"] == 1
    assert idx.close_session(s) == (1, 2)
    st = idx.stats()
    assert st["pins"] == 0 and st["reserved"] == 0 and st["objects"] == 1
    assert st["allocated_bytes"] == st["live_object_alloc_bytes"] and st["allocator_consistent"]


def test_index_corrupt_report_hides_object_and_frees_after_last_pin():
    idx = _index()
    s = idx.open_session()
    (o,) = idx.reserve(s, "d", [(b"a", 5000)])
    idx.commit(s, [o.oid], [None], _ok)
    (p1,) = idx.acquire(s, "d", [b"a"])
    (p2,) = idx.acquire(s, "d", [b"a"])
    idx.release(s, [p1.oid], bad=[p1.oid])
    assert idx.lookup("d", [b"a"]) == [False]
    assert idx.stats()["doomed"] == 1
    idx.release(s, [p2.oid])
    assert idx.stats()["allocated_bytes"] == 0


# -- object header ----------------------------------------------------------------------------
def test_object_header_detects_every_mismatch():
    buf = memoryview(bytearray(OBJ_HEADER_SIZE + 100))
    hdr, payload = buf[:OBJ_HEADER_SIZE], buf[OBJ_HEADER_SIZE:]
    payload[:] = b"x" * 100
    d = key_digest("ns", b"k")
    write_header(hdr, 7, 100, d, payload, checksum=True)
    assert validate(hdr, payload, 7, 100, d) is None
    assert "id" in validate(hdr, payload, 8, 100, d)
    assert "digest" in validate(hdr, payload, 7, 100, key_digest("ns", b"other"))
    payload[5] = 0
    assert "checksum" in validate(hdr, payload, 7, 100, d)
    hdr[0] = 0
    assert "magic" in validate(hdr, payload, 7, 100, d)


# -- region -----------------------------------------------------------------------------------
def test_region_create_attach_verify_and_mode():
    name = f"u-{uuid.uuid4().hex[:8]}"
    r = Region.create(name, 2 << 20)
    try:
        assert Path(r.info.path).stat().st_mode & 0o777 == 0o600
        c = Region.attach(r.info.path, size=r.size, region_uuid=r.info.region_uuid, incarnation=r.info.incarnation)
        c.close()
        with pytest.raises(RegionError, match="not the one the service announced"):
            Region.attach(r.info.path, size=r.size, region_uuid=r.info.region_uuid, incarnation="00" * 16)
        with pytest.raises(RegionError, match="in use by another"):
            Region.create(name, 2 << 20)
    finally:
        r.close(unlink=True)
    assert not Path(r.info.path).exists()


@pytest.mark.parametrize("path", ["../etc/passwd", "/dev/shm/../tmp/x", "/tmp/x", "/dev/shm/a/b", ".."])
def test_shm_path_traversal_rejected(path):
    with pytest.raises(RegionError, match="inside /dev/shm"):
        resolve_region_path("shm", "p", path)


def test_dax_geometry_from_sysfs(tmp_path):
    dev = tmp_path / "dax0.0"
    dev.mkdir()
    (dev / "size").write_text("4294967296\n")
    (dev / "align").write_text("2097152\n")
    assert dax_geometry(Path("/dev/dax0.0"), tmp_path) == (4 << 30, 2 << 20)
    with pytest.raises(RegionError, match="dax path"):
        resolve_region_path("dax", "p", "/dev/sda1")
    with pytest.raises(RegionError, match="exceeds DAX device"):
        Region.create("p", 8 << 30, backend="dax", path="/dev/dax0.0", sysfs=tmp_path)


# -- protocol ---------------------------------------------------------------------------------
def test_protocol_validates_args():
    raw = msgspec.msgpack.encode({"items": [[b"k", -1]]})
    with pytest.raises(P.FrameError) as e:
        P.decode_args("reserve", msgspec.Raw(raw))
    assert e.value.code == "bad_request"
    with pytest.raises(P.FrameError) as e:
        P.decode_args("frobnicate", msgspec.Raw(msgspec.msgpack.encode({})))
    assert e.value.code == "unknown_op"
    raw = msgspec.msgpack.encode({"keys": [b"x" * 257]})
    with pytest.raises(P.FrameError, match=r"257|256"):
        P.decode_args("lookup", msgspec.Raw(raw))


# -- part index -------------------------------------------------------------------------------
def test_part_index_finds_leading_parts_and_forgets_them_with_the_object():
    events = []
    idx = _index(capacity=4 * 80 * PAGE, events=events)
    s = idx.open_session()
    size = 80 * PAGE - OBJ_HEADER_SIZE  # 4 objects fill the pool
    (a,) = idx.reserve(s, "d", [(b"A", size)])
    (b,) = idx.reserve(s, "d", [(b"B", size)])
    # A and B share their first part (p0) and differ after it.
    assert idx.commit(s, [a.oid, b.oid], [None, None], _ok, [[b"p0", b"a1"], [b"p0", b"b1"]]) == [True, True]
    assert idx.lookup_parts("d", [b"p0", b"a1", b"b1", b"zz"]) == [1, 2, 2, 0]
    assert idx.lookup_parts("other", [b"p0"]) == [0]  # namespaces are separate
    ((obj, units),) = idx.acquire_parts(s, "d", [b"p0"])
    assert (obj.key, units) == (b"B", 1)  # the most recent holder
    idx.release(s, [obj.oid])
    assert idx.stats()["part_keys"] == 3
    # B removed: p0 still names A's first part; b1 is gone.
    assert idx.remove("d", [b"B"]) == 1
    assert idx.lookup_parts("d", [b"p0", b"a1", b"b1"]) == [1, 2, 0]
    ((obj, units),) = idx.acquire_parts(s, "d", [b"p0"])
    assert obj.key == b"A"
    # A is pinned: evicting everything else leaves it; once unpinned and evicted, nothing is left.
    for i in range(6):
        idx.commit(s, [idx.reserve(s, "d", [(b"%d" % i, size)])[0].oid], [None], _ok)
    assert idx.lookup_parts("d", [b"a1"]) == [2]
    idx.release(s, [obj.oid])
    for i in range(6, 10):
        idx.commit(s, [idx.reserve(s, "d", [(b"%d" % i, size)])[0].oid], [None], _ok)
    assert ("removed", b"A") in events
    assert idx.lookup_parts("d", [b"p0", b"a1"]) == [0, 0]
    assert idx.parts == {} and idx.stats()["part_keys"] == 0


def test_part_index_is_bounded_per_object():
    idx = _index()
    s = idx.open_session()
    (o,) = idx.reserve(s, "d", [(b"big", 100)])
    many = [b"%d" % i for i in range(P.MAX_PARTS + 50)]
    assert idx.commit(s, [o.oid], [None], _ok, [many]) == [True]
    assert len(idx.parts) == P.MAX_PARTS
    # the wire refuses more than MAX_PARTS keys for one object
    raw = msgspec.msgpack.encode({"oids": [1], "parts": [many]})
    with pytest.raises(P.FrameError, match="invalid arguments for 'commit'"):
        P.decode_args("commit", msgspec.Raw(raw))
