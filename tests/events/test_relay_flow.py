"""A resync runs at the pace of Dynamo's publisher: while the publisher takes nothing, the relay
reads no further into the pool's snapshot than about one page, keeps what the pipe refuses in
order, and everything arrives - numbered without gaps - once the publisher reads again."""

from __future__ import annotations

import collections
import hashlib
import time

import pytest
import zmq

from maru_vllm.connector.chunks import ChunkGeometry, chunk_key
from maru_vllm.events import vllm_format as vf
from maru_vllm.events.nats_source import PoolSourceConfig
from maru_vllm.events.pool_view import NamespaceFilter
from maru_vllm.launch import free_port
from maru_vllm.pool import PoolClient
from maru_vllm.pool import protocol as P
from tests.events.test_relay import relay_factory  # noqa: F401  (a fixture)
from tests.waiting import wait_until

NS = "kv:m:1"
GEOMETRY = ChunkGeometry(block_size=64, blocks_per_chunk=16)  # ~4.6 KiB of metadata per chunk
CHUNKS = 3000  # ~4 snapshot pages, ~16 MiB of KV event batches
pytestmark = pytest.mark.timeout(240)


def _raw_hashes(p: int) -> list[bytes]:
    return [hashlib.blake2b(b"%d/%d" % (p, b), digest_size=32).digest() for b in range(16)]


def _fill(address: str, chunks: int) -> int:
    """`chunks` one-chunk prompts with binary connector metadata (empty payloads)."""
    return _fill_range(address, 0, chunks)


def _fill_range(address: str, start: int, end: int) -> int:
    """One-chunk prompts `start`..`end` - 1 (see `_fill`)."""
    g = GEOMETRY
    stored = 0
    with PoolClient.connect(address, heartbeat=False) as c:
        for lo in range(start, end, 250):
            items = []
            for p in range(lo, min(lo + 250, end)):
                hashes = _raw_hashes(p)
                tokens = [(p * 7 + t) % 150_000 for t in range(g.chunk_tokens)]
                items.append((chunk_key(g.chunk_hash(hashes, 0), 0), g.chunk_meta(hashes, tokens, 0, None)))
            res = c.reserve([(k, 0) for k, _ in items], NS)
            stored += sum(c.commit([r for r in res if r], [m for (_, m), r in zip(items, res) if r]))
    return stored


class SlowPublisher:
    """Dynamo's publisher's socket, read only when the test says so (tiny buffers: a full pipe)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 64 << 10)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.seqs: list[int] = []
        self.stored: set[int] = set()

    def read(self, timeout_s: float = 0.2) -> int:
        """Read whatever arrives within `timeout_s` of the last message; how many were read."""
        n = 0
        while self.sock.poll(int(timeout_s * 1000)):
            _topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(vf.decode_seq(seq))
            for ev in vf.decode_batch(payload).events:
                if type(ev).__name__ == "BlockStored":
                    self.stored.update(ev.block_hashes)
            n += 1
        return n

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.destroy(linger=0)


def _relay(relay_factory, pool_service, nats, **kw):  # noqa: F811
    _, url = nats
    return relay_factory(
        upstream=f"tcp://127.0.0.1:{free_port()}",
        pool=PoolSourceConfig(url, pool_service.pool_name, pool_address=pool_service.address),
        namespaces=NamespaceFilter.exactly(NS),
        block_size=GEOMETRY.block_size,
        **kw,
    )


def test_a_resync_waits_for_a_publisher_that_takes_nothing_and_delivers_everything_after(
    pool_service,
    nats,
    relay_factory,  # noqa: F811
) -> None:
    assert _fill(pool_service.address, CHUNKS) == CHUNKS
    relay = _relay(relay_factory, pool_service, nats, downstream_hwm=1, max_page_wait_s=600)
    pub = SlowPublisher(relay.endpoint)
    try:
        wait_until(lambda: relay.subscribed.is_set(), 20, "the publisher subscribed")
        wait_until(lambda: relay.unsent_bytes > 0, 60, "the pipe to the publisher is full")
        # The publisher reads nothing: the resync stays at about the page it is on. Without flow
        # control it would read every page and finish within this second.
        for _ in range(10):
            time.sleep(0.1)
            assert relay.unsent_bytes <= 2 * P.SNAPSHOT_PAGE_BYTES
        assert relay.source is not None and not relay.source.synced
        assert relay.stats.pool_blocks_stored < CHUNKS * GEOMETRY.blocks_per_chunk
        # Reading again: every block arrives, the batches numbered without a gap.
        wait_until(
            lambda: pub.read() >= 0 and relay.source.synced and relay.unsent_bytes == 0 and pub.read() == 0,
            120,
            "the resync finished and was read",
            interval=0,
        )
        assert pub.seqs == list(range(len(pub.seqs))) and len(pub.seqs) == relay.stats.sent
        assert len(pub.stored) == CHUNKS * GEOMETRY.blocks_per_chunk == relay.view.block_count
        assert relay.stats.unsent_dropped == 0 and relay.stats.send_errors == 0
        assert 0 < relay.stats.unsent_max_bytes <= 2 * P.SNAPSHOT_PAGE_BYTES
    finally:
        pub.close()


def test_batches_dropped_while_the_publisher_lags_are_announced_again_once_it_reads(
    pool_service,
    nats,
    relay_factory,  # noqa: F811
) -> None:
    """Past `max_unsent_bytes` the relay drops batches rather than hold them; the pool's blocks
    it dropped reach the publisher anyway, by a full announcement once the pipe drains (a
    backlog that holds a snapshot page's batches: a full announcement is paced by the page)."""
    assert _fill(pool_service.address, CHUNKS) == CHUNKS
    backlog = 2 * P.SNAPSHOT_PAGE_BYTES
    relay = _relay(relay_factory, pool_service, nats, downstream_hwm=1, max_unsent_bytes=backlog, max_page_wait_s=0.2)
    pub = SlowPublisher(relay.endpoint)
    try:
        wait_until(lambda: relay.subscribed.is_set(), 20, "the publisher subscribed")
        wait_until(lambda: relay.stats.unsent_dropped > 0, 60, "batches dropped while the publisher lags")
        assert relay.unsent_bytes <= backlog
        wait_until(
            lambda: pub.read() >= 0 and len(pub.stored) == CHUNKS * GEOMETRY.blocks_per_chunk,
            180,
            "every pool block announced after all",
            interval=0,
        )
        # made good by one full announcement, or a few: not one after another while the publisher reads
        assert 1 <= relay.stats.full_announcements <= 3
        assert pub.seqs == list(range(len(pub.seqs)))
    finally:
        pub.close()


class CountingPublisher(SlowPublisher):
    """SlowPublisher that also keeps, per block, the reference count Dynamo's publisher keeps: a
    store adds one, a removal takes one away and reaches the router only at zero (a removal of a
    block it does not count passes and leaves it at zero). The router credits a block while its
    count is above zero."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.net: collections.Counter[int] = collections.Counter()

    def read(self, timeout_s: float = 0.2) -> int:
        n = 0
        while self.sock.poll(int(timeout_s * 1000)):
            _topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(vf.decode_seq(seq))
            for ev in vf.decode_batch(payload).events:
                kind = type(ev).__name__
                for h in ev.block_hashes if kind in ("BlockStored", "BlockRemoved") else ():
                    self.net[h] = self.net[h] + 1 if kind == "BlockStored" else max(0, self.net[h] - 1)
            n += 1
        return n


def _chunk_blocks(p: int) -> list[int]:
    """The block hashes (as the relay announces them) of one-chunk prompt `p` of `_fill`."""
    return [vf.external_hash(h) for h in _raw_hashes(p)]


def test_removals_dropped_while_the_publisher_lags_are_withdrawn_again(
    pool_service,
    nats,
    relay_factory,  # noqa: F811
) -> None:
    """The router never keeps credit for a removed chunk: removals the relay had to drop past its
    backlog reach the publisher once it reads again, before the pool is announced again."""
    # the first fit in the relay's backlog; the next overflow it and the socket buffers (a page of a
    # resync fits in it: a resync waits for the pipe and never overflows it)
    first, more = 200, 6000
    assert _fill(pool_service.address, first) == first
    relay = _relay(relay_factory, pool_service, nats, downstream_hwm=1, max_unsent_bytes=8 << 20, max_page_wait_s=30)
    pub = CountingPublisher(relay.endpoint)
    try:
        wait_until(
            lambda: pub.read() >= 0 and relay.source.synced and relay.unsent_bytes == 0 and pub.read() == 0,
            120,
            "the first resync read",
            interval=0,
        )
        assert all(pub.net[h] == 1 for p in range(first) for h in _chunk_blocks(p))
        # The publisher stops reading: new stores fill the backlog, then half the pool goes.
        assert _fill_range(pool_service.address, first, first + more) == more
        gone = list(range(0, first, 2))
        with PoolClient.connect(pool_service.address, heartbeat=False) as c:
            keys = [chunk_key(GEOMETRY.chunk_hash(_raw_hashes(p), 0), 0) for p in gone]
            assert c.remove(keys, NS) == len(gone)
        wait_until(lambda: relay.stats.removals_lost > 0, 60, "removal batches dropped while the publisher lags")
        # Reading again: the lost removals arrive, then the pool's blocks again.
        kept = [p for p in range(first + more) if p not in set(gone)]

        def settled() -> bool:
            pub.read()
            return (
                relay.unsent_bytes == 0
                and relay.source.synced
                and all(pub.net[h] == 0 for p in gone for h in _chunk_blocks(p))
                and all(pub.net[h] >= 1 for p in kept for h in _chunk_blocks(p))
            )

        wait_until(settled, 180, "removed blocks withdrawn and the rest announced", interval=0)
        assert relay.stats.removals_forgotten == 0
        assert pub.seqs == list(range(len(pub.seqs)))
    finally:
        pub.close()
