"""The client API against a real service process."""

from __future__ import annotations

import json
import os
import threading
import urllib.request

import pytest
from pool_helpers import pool_cli, service_in_process

from maru_vllm.launch import free_port
from maru_vllm.pool import InvalidArgument, PoolClient, PoolError, PoolProtocolError
from maru_vllm.pool.protocol import MAX_META_DEPTH


def test_put_get_lookup_and_write_once(pool):
    with PoolClient.connect(pool.address) as c:
        assert c.put(b"a", b"hello", meta={"block": 1}) is True
        assert c.put(b"a", b"other") is False  # write-once: the first commit wins
        with c.get(b"a") as v:
            assert bytes(v) == b"hello"
            assert v.readonly
            with pytest.raises(TypeError):
                v[0] = 0
        with c.get(b"missing") as v:
            assert v is None
        assert c.put(b"a", b"x", namespace="other") is True  # namespaces are separate
        assert c.lookup([b"a", b"b", b"a"]) == [True, False, True]
        c.put(b"b", b"2")
        assert c.lookup_prefix([b"a", b"b", b"c", b"a"]) == 2
        snap = {(o["namespace"], o["key"]): o for o in c.snapshot()}
        assert snap[("default", b"a".hex())]["meta"] == {"block": 1}
        assert snap[("default", b"a".hex())]["size"] == 5
        assert [o["namespace"] for o in c.snapshot("other")] == ["other"]
        st = c.stats()
        assert st["objects"] == 3 and st["stores"] == 3 and st["reserve_existing"] == 1


def test_batched_reserve_commit_acquire_release(pool):
    with PoolClient.connect(pool.address) as c:
        keys = [b"k%03d" % i for i in range(50)]
        res = c.reserve([(k, 1000 + i) for i, k in enumerate(keys)], namespace="m")
        assert all(r is not None and len(r.buffer) == r.size for r in res)
        for i, r in enumerate(res):
            r.buffer[:] = bytes([i]) * r.size
        assert c.lookup(keys, namespace="m") == [False] * 50  # reserved objects are invisible
        assert c.commit(res, [{"i": i} for i in range(50)]) == [True] * 50
        assert c.reserve([(keys[0], 10)], namespace="m") == [None]  # already committed
        pins = c.acquire(keys + [b"nope"], namespace="m")
        assert pins[-1] is None
        assert all(bytes(p.data) == bytes([i]) * (1000 + i) for i, p in enumerate(pins[:-1]))
        assert c.stats()["pinned"] == 50
        c.release(pins)
        assert c.stats()["pinned"] == 0
        # abort: the space comes back and nothing becomes visible
        before = c.stats()["allocated_bytes"]
        ab = c.reserve([(b"abort-me", 100_000)])
        assert c.stats()["allocated_bytes"] > before
        c.abort(ab)
        assert c.stats()["allocated_bytes"] == before
        assert c.lookup([b"abort-me"]) == [False]
        with c.acquire([keys[1]], namespace="m")[0] as pin:
            assert bytes(pin.data[:1]) == b"\x01"
        assert c.stats()["pins"] == 0


def test_checksum_mode_and_duplicate_commit_frees_space(pool):
    with PoolClient.connect(pool.address, checksum=True) as a, PoolClient.connect(pool.address) as b:
        ra = a.reserve([(b"dup", 50_000)])[0]
        rb = b.reserve([(b"dup", 50_000)])[0]
        ra.buffer[:] = b"A" * 50_000
        rb.buffer[:] = b"B" * 50_000
        used = a.stats()["allocated_bytes"]
        assert a.commit([ra]) == [True]
        assert b.commit([rb]) == [False]
        assert a.stats()["allocated_bytes"] < used
        with b.get(b"dup") as v:
            assert bytes(v) == b"A" * 50_000


def test_client_rejects_bad_arguments(pool):
    with PoolClient.connect(pool.address) as c:
        with pytest.raises(InvalidArgument, match="257 bytes is too long"):
            c.lookup([b"x" * 257])
        with pytest.raises(InvalidArgument, match="size -1"):
            c.reserve([(b"k", -1)])
        with pytest.raises(InvalidArgument, match="namespace"):
            c.lookup([b"k"], namespace="n" * 129)
        c.ping()  # still usable


def test_eviction_keeps_pinned_objects_intact(pool_factory):
    p = pool_factory(size="8M")
    size = 300_000
    with PoolClient.connect(p.address) as c:
        pinned_keys = [b"pin%d" % i for i in range(5)]
        for i, k in enumerate(pinned_keys):
            assert c.put(k, bytes([i + 1]) * size)
        pins = c.acquire(pinned_keys)
        assert all(pins)
        stored = 0
        for i in range(200):  # ~60 MB into an 8 MB pool
            assert c.put(b"fill%d" % i, bytes([i % 251]) * size), f"store {i} failed"
            stored += 1
        st = c.stats()
        assert st["evictions"] >= stored - 30
        assert st["evictions_space"] == st["evictions"]  # the region was full, not the object cap
        for i, pin in enumerate(pins):  # pinned objects survived every eviction round, byte-exact
            assert bytes(pin.data) == bytes([i + 1]) * size
        assert c.lookup(pinned_keys) == [True] * 5
        assert c.lookup([b"fill0", b"fill199"]) == [False, True]  # LRU went first, newest stays
        c.release(pins)


def test_full_pool_of_pinned_objects_fails_store_cleanly(pool_factory):
    p = pool_factory(size="2M", extra=["--session-pin-limit", "2M"])  # lift the per-session quota
    with PoolClient.connect(p.address) as c:
        pins = []
        for i in range(50):  # store and pin until nothing can be evicted any more
            if not c.put(b"p%d" % i, bytes([i]) * 300_000):
                break
            (pin,) = c.acquire([b"p%d" % i])
            assert pin is not None, "a fresh store was evicted while everything else is pinned"
            pins.append(pin)
        else:
            pytest.fail("a 2M pool took 50 pinned 300K objects")
        assert 3 <= len(pins) <= 7
        assert c.put(b"one-more", b"y" * 300_000) is False  # skipped, not an error
        assert c.reserve([(b"x", 300_000)]) == [None]
        assert c.stats()["reserve_failures"] >= 2
        for i, pin in enumerate(pins):
            assert bytes(pin.data) == bytes([i]) * 300_000
        c.release(pins)
        assert c.put(b"one-more", b"y" * 300_000) is True


def test_metrics_and_status_cli(pool_factory):
    port = free_port()
    p = pool_factory(extra=["--metrics-port", str(port)])
    with PoolClient.connect(p.address) as c:
        c.put(b"m", b"1" * 1000)
        c.lookup([b"m", b"n"])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f'maru_pool_objects{{pool="{p.pool_name}"}} 1.0' in text
    assert f'maru_pool_capacity_bytes{{pool="{p.pool_name}"}}' in text
    assert 'maru_pool_op_latency_seconds_count{op="lookup"' in text or 'op="lookup",pool=' in text
    assert f'maru_pool_hits_total{{pool="{p.pool_name}"}} 1.0' in text
    for reason in ("space", "object_cap", "metadata_budget"):  # every reason there from the start
        assert f'maru_pool_evictions_by_reason_total{{pool="{p.pool_name}",reason="{reason}"}} 0.0' in text
    out = pool_cli("status", "--address", p.address, "--json")
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["pool"] == p.pool_name and st["objects"] == 1
    out = pool_cli("status", "--address", p.address)
    # 64M less the presence table and the catalog
    assert out.returncode == 0 and "capacity" in out.stdout and "63.6 MiB" in out.stdout
    assert "presence table     1 keys in 16384 slots" in out.stdout
    with PoolClient.connect(p.address) as c:
        c.put(b"other", b"2" * 10, namespace="ns2")
    out = pool_cli("clear", "--address", p.address, "--namespace", "default")
    assert out.returncode == 0 and "removed 1 objects from 1 namespace(s)" in out.stdout, out.stderr
    with PoolClient.connect(p.address) as c:
        assert c.lookup([b"m"]) == [False] and c.lookup([b"other"], namespace="ns2") == [True]


def test_serve_cleans_up_region_and_socket_on_sigterm_and_keep_region(pool_factory):
    p = pool_factory()
    sock = p.address.removeprefix("unix://")
    assert os.path.exists(p.region_path) and os.path.exists(sock)
    assert os.stat(p.region_path).st_mode & 0o777 == 0o600
    assert p.stop() == 0
    assert not os.path.exists(p.region_path) and not os.path.exists(sock)
    k = pool_factory(extra=["--keep-region"])
    assert k.stop() == 0
    assert os.path.exists(k.region_path)


def test_one_client_shared_by_threads(pool):
    errors = []
    with PoolClient.connect(pool.address) as c:

        def work(t):
            try:
                for i in range(150):
                    k = b"t%d-%d" % (t, i)
                    data = bytes([t, i % 256]) * (500 + i)
                    assert c.put(k, data)
                    with c.get(k) as v:
                        assert v is not None and bytes(v) == data
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert c.stats()["objects"] == 600


def test_parts_lookup_and_acquire_through_the_service(pool):
    with PoolClient.connect(pool.address) as c:
        assert c.put(b"chunk-a", b"A" * 300, namespace="p", meta={"m": 1}, parts=[b"h0", b"h1"])
        assert c.put(b"chunk-b", b"B" * 300, namespace="p", parts=[b"h0", b"x1", b"x2"])
        assert c.lookup_parts([b"h0", b"h1", b"x2", b"nope"], namespace="p") == [1, 2, 3, 0]
        pins = c.acquire_parts([b"h1", b"x2", b"nope"], namespace="p")
        assert pins[2] is None
        assert (pins[0].key, pins[0].units, bytes(pins[0].data)) == (b"chunk-a", 2, b"A" * 300)
        assert (pins[1].key, pins[1].units, bytes(pins[1].data[:1])) == (b"chunk-b", 3, b"B")
        assert c.stats()["pinned"] == 2
        c.release(pins)
        assert c.stats()["pinned"] == 0
        assert c.remove([b"chunk-a"], namespace="p") == 1
        assert c.lookup_parts([b"h0", b"h1"], namespace="p") == [1, 0]
        # part keys count against the per-object metadata budget: a clear one-line refusal
        (res,) = c.reserve([(b"chunk-c", 10)], namespace="p")
        with pytest.raises(PoolError, match=r"part keys of .* bytes exceed 16384 bytes per object"):
            c.commit([res], None, [[b"k" * 200] * 100])
        with pytest.raises(InvalidArgument, match="at most 256"):
            c.commit([res], None, [[b"k"] * 300])


def test_release_without_waiting_unpins_and_later_calls_still_match_their_replies(pool):
    """`release(wait=False)` sends the release and returns; its reply is read before the next
    request's, so every later call still gets its own answer, and the pins are gone."""
    with PoolClient.connect(pool.address) as c:
        assert c.put(b"k-nowait", b"x" * 4096)
        (pin,) = c.acquire([b"k-nowait"])
        assert pin is not None and c.stats()["pins"] == 1
        c.release([pin], wait=False)
        c.release([pin], wait=False)  # already released: nothing is sent
        assert c.stats()["pins"] == 0
        (pin2,) = c.acquire([b"k-nowait"])
        c.release([pin2], wait=False)
        assert c.lookup([b"k-nowait", b"absent"]) == [True, False]
        assert c.stats()["pins"] == 0


def test_commit_depth_limit_counts_nesting_not_brackets(pool):
    """Metadata may hold any number of lists (a chunk's token ids are one list per block) and
    brackets inside strings; only nesting deeper than MAX_META_DEPTH levels is refused."""
    wide = {"token_ids": [[i] * 4 for i in range(200)], "note": "[[[{{{" * 20}
    deep: object = 1
    for _ in range(MAX_META_DEPTH - 1):  # the enclosing object is a level too
        deep = [deep]
    with PoolClient.connect(pool.address) as c:
        res = c.reserve([(b"wide", 8), (b"deep", 8)], namespace="d")
        assert c.commit(res, [wide, {"x": deep}]) == [True, True]
        (info,) = [o for o in c.snapshot("d") if o["key"] == b"wide".hex()]
        assert info["meta"] == wide
        too_deep = c.reserve([(b"too-deep", 8)], namespace="d")
        with pytest.raises(PoolProtocolError, match=f"meta nests deeper than {MAX_META_DEPTH} levels"):
            c.commit(too_deep, [{"x": [deep]}])
        assert c.lookup([b"wide", b"deep", b"too-deep"], namespace="d") == [True, True, False]


def test_meta_too_deep_to_encode_is_a_bad_request_not_an_internal_error(sockdir, monkeypatch):
    """A meta the frame decoder just accepted can still be too deep to encode a few frames
    further down (both count the same recursion limit): the client gets the nesting error."""
    from maru_vllm.pool import messages

    def too_deep(meta):
        raise RecursionError("maximum recursion depth exceeded")

    with service_in_process(f"enc{os.getpid()}", f"unix://{sockdir}/e.sock"):
        monkeypatch.setattr(messages, "encode_meta_json", too_deep)
        with PoolClient.connect(f"unix://{sockdir}/e.sock", heartbeat=False) as c:
            res = c.reserve([(b"k", 8)])
            with pytest.raises(PoolProtocolError, match=f"bad_request.*meta nests deeper than {MAX_META_DEPTH}"):
                c.commit(res, [{"a": 1}])
            assert c.lookup([b"k"]) == [False]


def test_ready_lines_are_whole_single_writes():
    """A launcher reads the ready line from a log that other threads write to too; each line
    must reach the stream in one write, newline included, so nothing can land inside it."""
    from maru_vllm.pool.service import READY_LINE, announce_ready

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)
            return len(text)

        def flush(self):
            self.writes.append(None)

    stream = Recorder()
    addresses = ["unix:///tmp/a.sock", "tcp://127.0.0.1:5000"]
    announce_ready(addresses, stream)
    texts = [w for w in stream.writes if w is not None]
    assert texts == [READY_LINE.format(address=a) + "\n" for a in addresses]
    assert stream.writes[-1] is None  # flushed after the last line
