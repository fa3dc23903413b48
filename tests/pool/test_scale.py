"""Pools of real size: snapshots above one frame, bounded service memory, untrusted frames."""

from __future__ import annotations

import asyncio
import subprocess

import msgspec
import pytest
from pool_helpers import REPO, child_env, pool_cli

from maru_vllm.launch import stack
from maru_vllm.pool import PoolClient, PoolProtocolError
from maru_vllm.pool import protocol as P
from maru_vllm.pool.allocator import Allocator
from maru_vllm.pool.chunk_codec import ChunkMeta, decode_chunk_meta
from maru_vllm.pool.index import PoolIndex
from maru_vllm.pool.messages import decode_snapshot_page, encode_meta_json

BLOCK = 16


def _meta(i: int, blocks: int = 16) -> ChunkMeta:
    """Connector-shaped chunk metadata (~2.5 KiB as JSON: 16 blocks of 16 tokens)."""
    return ChunkMeta(
        v=1,
        chunk=0,
        block_size=BLOCK,
        block_hashes=[f"{i:08x}{b:024x}" for b in range(blocks)],
        parent_block_hash=None,
        token_ids=[[100_000 + i + t for t in range(BLOCK)] for _ in range(blocks)],
    )


def _fill(c: PoolClient, n: int, ns: str = "default", batch: int = 500, start: int = 0, blocks: int = 16) -> int:
    stored = 0
    for lo in range(start, start + n, batch):
        ids = range(lo, min(lo + batch, start + n))
        res = c.reserve([(b"k%08d" % i, 0) for i in ids], ns)
        ok = c.commit([r for r in res if r], [_meta(i, blocks) for i, r in zip(ids, res) if r])
        stored += sum(ok)
    return stored


def test_snapshot_larger_than_a_frame_is_paged_and_the_connection_stays_usable(pool_factory) -> None:
    """8,000 connector chunks of 32 blocks are ~21 MiB of (binary) metadata: more than one 16 MiB
    frame, so the snapshot comes in pages and the client stays in step with the connection (no
    "reply frame of N bytes")."""
    p = pool_factory(size="64M")
    with PoolClient.connect(p.address, heartbeat=False) as c:
        assert _fill(c, 4000, "a", blocks=32) + _fill(c, 4000, "b", start=4000, blocks=32) == 8000
        st = c.stats()
        assert st["metadata_bytes"] > P.MAX_FRAME
        pages = list(c.snapshot_pages())
        assert len(pages) >= 5  # 4 MiB pages
        assert {len(x.objects) for x in pages[:-1]} != {0}
        keys = [o.key for page in pages for o in page.objects]
        assert len(keys) == len(set(keys)) == 8000
        assert decode_chunk_meta(pages[0].objects[0].bmeta) == _meta(0, 32)  # committed binary, read back exactly
        assert len(c.snapshot("b")) == 4000  # the dict form still works, namespace-filtered
        assert c.stats()["objects"] == 8000  # same connection, still in step
    # `pool clear --all` lists namespaces from the paged snapshot
    out = pool_cli("clear", "--address", p.address, "--all", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "removed 8000 objects from 2 namespace(s)" in out.stdout


def test_socket_resync_of_the_event_source_reads_every_page(pool_factory) -> None:
    from maru_vllm.events.nats_source import PoolEventSource, PoolSourceConfig

    p = pool_factory(size="64M")
    with PoolClient.connect(p.address, heartbeat=False) as c:
        assert _fill(c, 7000, "kv:m:1") == 7000
    src = PoolEventSource(
        PoolSourceConfig("nats://127.0.0.1:1", "x", pool_address=p.address), lambda s: None, lambda e: None
    )
    pages = list(src._socket_pages(None))
    assert len(pages) > 1 and sum(len(p.objects) for p in pages) == 7000 and pages[0].total == 7000
    from maru_vllm.events.types import PoolChunk

    chunk = PoolChunk.from_meta(pages[0].objects[0].bmeta)
    assert chunk is not None and len(chunk.block_hashes) == 16


def test_a_frame_the_client_cannot_accept_drops_the_connection_and_the_next_call_reconnects(
    pool_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = pool_factory(size="16M")
    with PoolClient.connect(p.address, heartbeat=False) as c:
        _fill(c, 50)
        session = c.hello["session"]
        monkeypatch.setattr(P, "MAX_FRAME", 1000)  # this client now refuses the page the pool sends
        with pytest.raises(
            PoolProtocolError, match=r"reply frame of \d+ bytes to snapshot exceeds 1000; connection dropped"
        ):
            c.snapshot_full()
        assert not c.connected
        monkeypatch.setattr(P, "MAX_FRAME", 16 * 1024 * 1024)
        assert c.stats()["objects"] == 50  # a fresh connection, not the rest of the old frame
        assert c.hello["session"] != session


def test_a_reply_of_the_wrong_shape_is_refused_with_a_clear_error_and_the_connection_dropped(
    pool_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from maru_vllm.pool import messages as M

    p = pool_factory(size="16M")
    with PoolClient.connect(p.address, heartbeat=False) as c:
        # a client built against another definition of the stats reply (a drifted field)
        monkeypatch.setitem(M._result_decoders, "stats", msgspec.msgpack.Decoder(list[int]))
        with pytest.raises(
            PoolProtocolError,
            match=r"malformed 'stats' reply from the pool: Expected `array`, "
            r"got `object`; connection dropped",
        ):
            c.stats()
        assert not c.connected
        monkeypatch.undo()
        assert c.stats()["objects"] == 0


def test_malformed_messages_name_what_is_wrong() -> None:
    from maru_vllm.pool import messages as M

    with pytest.raises(M.MessageError, match=r"malformed 'reserve' reply.*length 3, got 2 - at `\$\[0\]`"):
        M.decode_result("reserve", msgspec.msgpack.encode([[1, 2]]))
    with pytest.raises(M.MessageError, match=r"malformed pool event: Object missing required field `seq`"):
        M.decode_event(b'{"type":"stored","incarnation":"i","pool":"p","namespace":"n","key":"00","size":1}')
    with pytest.raises(M.MessageError, match=r"malformed pool event: Invalid enum value 'gone' - at `\$.type`"):
        M.decode_event(b'{"type":"gone","seq":1,"incarnation":"i","pool":"p","namespace":"n","key":"00","size":1}')
    good = msgspec.to_builtins(_meta(1, blocks=2))
    assert decode_chunk_meta(msgspec.json.encode(good)) == _meta(1, blocks=2)
    for change, why in [
        ({"v": 7}, r"chunk metadata version 7 is not supported \(supported: \[1\]\)"),
        ({"token_ids": [[1, 2]] * 2}, "every token block must hold block_size=16 tokens"),
        ({"token_ids": [[0] * 16]}, "1 token blocks for 2 block hashes"),
        ({"block_hashes": ["xyz", "00"]}, r"Expected `str` matching regex"),
        ({"block_size": 0}, r"Expected `int` >= 1 - at `\$.block_size`"),
    ]:
        with pytest.raises(M.MessageError, match="not MaruKVConnector chunk metadata: " + why):
            decode_chunk_meta(msgspec.json.encode({**good, **change}))


def test_index_object_cap_evicts_lru_and_refuses_only_when_everything_is_pinned() -> None:
    idx = PoolIndex(Allocator(1 << 20), 4096, max_objects=10)
    sid = idx.open_session()
    for i in range(25):
        (o,) = idx.reserve(sid, "ns", [(b"k%d" % i, 100)])
        assert o is not None and idx.commit(sid, [o.oid], [None], lambda o: None) == [True]
    st = idx.stats()
    assert st["objects"] == st["live_objects"] == 10 and st["evictions"] == 15 and st["max_objects"] == 10
    assert (st["evictions_object_cap"], st["evictions_space"], st["evictions_metadata_budget"]) == (15, 0, 0)
    assert [o is not None for o in idx.acquire(sid, "ns", [b"k%d" % i for i in range(15, 25)])] == [True] * 10
    assert idx.reserve(sid, "ns", [(b"new", 100)]) == [None]  # every object pinned: a clean refusal
    assert idx.stats()["object_cap_refusals"] == 1
    idx.release(sid, [o.oid for o in idx.live.values()])
    assert idx.reserve(sid, "ns", [(b"new", 100)])[0] is not None


def test_index_metadata_budget_evicts_lru_and_refuses_a_commit_only_when_everything_is_pinned() -> None:
    meta = encode_meta_json(_meta(0))
    budget = 10 * (len(meta) + 8)
    idx = PoolIndex(Allocator(1 << 20), 4096, metadata_budget=budget)
    sid = idx.open_session()
    for i in range(30):
        (o,) = idx.reserve(sid, "ns", [(b"k%07d" % i, 10)])
        assert idx.commit(sid, [o.oid], [meta], lambda o: None) == [True]
        assert idx.metadata_bytes <= budget
    assert idx.stats()["objects"] == 10 and idx.stats()["metadata_bytes"] == 10 * (len(meta) + 8)
    assert idx.stats()["evictions_metadata_budget"] == idx.stats()["evictions"] == 20
    idx.acquire(sid, "ns", [b"k%07d" % i for i in range(20, 30)])
    (o,) = idx.reserve(sid, "ns", [(b"x%07d" % 1, 10)])
    used = idx.alloc.allocated_bytes
    assert idx.commit(sid, [o.oid], [meta], lambda o: None) == [False]  # clean skip, space given back
    assert idx.alloc.allocated_bytes < used and idx.counters["metadata_budget_refusals"] == 1
    assert idx.commit(sid, [], [], lambda o: None) == []


def test_paged_snapshot_plus_later_events_is_exact_while_the_pool_changes() -> None:
    """The fuzzy-snapshot rule of SnapshotPage: first page's seq + every later event = live set."""
    events: list[tuple[int, str, tuple[str, bytes]]] = []
    seq = [0]

    def on_event(kind, obj):
        seq[0] += 1
        events.append((seq[0], kind, (obj.ns, obj.key)))

    idx = PoolIndex(Allocator(4 << 20), 4096, on_event)
    sid = idx.open_session()

    def store(key: bytes) -> None:
        (o,) = idx.reserve(sid, "ns", [(key, 10)])
        if o is not None:
            idx.commit(sid, [o.oid], [b'{"a":1}'], lambda o: None)

    for i in range(300):
        store(b"k%d" % i)
    first_seq = seq[0]
    got: set[tuple[str, bytes]] = set()
    after, page_no = 0, 0
    while True:
        objs, nxt = idx.snapshot_page(None, after, 40, 1 << 20)
        got |= {(o.ns, o.key) for o in objs}
        page_no += 1
        # between pages: remove some already-read and some not-yet-read objects, store new ones,
        # and re-store a removed key
        idx.remove("ns", [b"k%d" % (page_no * 7), b"k%d" % (299 - page_no * 5)])
        store(b"new%d" % page_no)
        store(b"k%d" % (page_no * 7))
        if nxt is None:
            break
        after = nxt
    assert page_no > 5
    for s, kind, oid in events:
        if s > first_seq:
            (got.add if kind == "stored" else got.discard)(oid)
    assert got == set(idx.objects)


def test_service_reports_budget_and_cap_in_stats_and_metrics(pool_factory) -> None:
    import urllib.request

    from maru_vllm.launch import free_port

    port = free_port()
    p = pool_factory(size="16M", extra=["--max-objects", "100", "--metadata-budget", "1M", "--metrics-port", str(port)])
    with PoolClient.connect(p.address, heartbeat=False) as c:
        assert _fill(c, 300, batch=50) == 300  # every store succeeds: LRU objects make room
        st = c.stats()
    assert st["objects"] == 100 and st["max_objects"] == 100 and st["metadata_budget_bytes"] == 1 << 20
    assert 0 < st["metadata_bytes"] <= 1 << 20 and st["evictions"] == 200
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f'maru_pool_max_objects{{pool="{p.pool_name}"}} 100.0' in text
    assert "maru_pool_metadata_bytes{" in text and "maru_pool_metadata_budget_refusals_total{" in text


@pytest.mark.parametrize(
    "flag,value,why",
    [
        ("--max-objects", "0", "use an integer >= 1"),
        ("--metadata-budget", "12Q", "invalid size"),
        ("--shared-snapshot-pages", "-1", "use an integer >= 0"),
    ],
)
def test_bad_budget_flags_are_refused_in_one_line(flag: str, value: str, why: str) -> None:
    out = subprocess.run(
        stack.pool_command("x", "4M", extra_args=[flag, value]),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env(),
        timeout=60,
    )
    assert out.returncode == 2 and why in out.stderr and value in out.stderr


def test_nats_snapshot_pages_fit_the_max_payload(pool_factory, nats) -> None:
    _, nats_url = nats
    import nats as nats_py

    p = pool_factory(size="64M", extra=["--nats", nats_url])
    with PoolClient.connect(p.address, heartbeat=False) as c:
        assert _fill(c, 1500, blocks=32) == 1500  # ~5 MiB of metadata as base64: above NATS's default 1 MiB payload

    async def main():
        nc = await nats_py.connect(nats_url)
        try:
            keys, after, pages = set(), 0, 0
            while True:
                reply = await nc.request(
                    f"maru.{p.pool_name}.snapshot", msgspec.json.encode({"after": after}), timeout=10
                )
                assert len(reply.data) <= nc.max_payload
                page = decode_snapshot_page(reply.data)
                keys |= {o.key for o in page.objects}
                pages += 1
                if page.next is None:
                    break
                after = page.next
            bad = await nc.request(f"maru.{p.pool_name}.snapshot", b'{"after": "x"}', timeout=10)
            with pytest.raises(ValueError, match="bad_request: invalid snapshot request: Expected `int`, got `str`"):
                decode_snapshot_page(bad.data)
            return keys, pages
        finally:
            await nc.close()

    keys, pages = asyncio.run(main())
    assert len(keys) == 1500 and pages >= 4
