"""The merged KV-event stream one Dynamo worker publishes: vLLM's own events plus the pool's.

```
 vLLM EngineCore ──ZMQ PUB tcp://*:N──▶ KvEventRelay ──XPUB tcp://127.0.0.1:M──▶ Dynamo KvEventPublisher
 pool service ──NATS maru.<pool>.events──▶ ┘   (one stream, one seq counter)        (relays to the router)
```

* vLLM's batches pass through byte for byte; only the ZMQ `seq` frame is renumbered, because
  the merged stream has one gap-free counter.
* Pool changes (`PoolView` over a `PoolEventSource`) become `BlockStored` / `BlockRemoved`
  batches at `medium` (default `CPU_PINNED`: Dynamo's host tier).
* Nothing is sent before Dynamo's subscriber has joined (an XPUB socket tells us), so the
  first batches - typically the pool's initial snapshot - are not lost to ZMQ's slow-joiner
  effect. Pool batches are held only up to `max_held_pool_blocks`; past that they are dropped
  and the whole pool is announced once the subscriber joins (a full resync: the relay keeps no
  token ids to announce from). A subscriber that joins later gets every pool block again the
  same way. A full resync withdraws each block it announces again right before its store:
  Dynamo 1.6.1's publisher counts stores per block and passes a removal on only when the
  count reaches zero, so a repeated store alone would keep the router crediting the block
  after the pool removed it (`PoolView`).
* The relay never blocks or fails the engine: sends are non-blocking, every error is logged
  and swallowed, and a NATS outage only pauses pool awareness.
* An announce cap (`max_announced_chunks` N): the relay announces at most N pool objects, the
  N most recently used when it resyncs (the pool serves those, `PoolSourceConfig.snapshot_recent`)
  and the newest stores after that, withdrawing the least recently used counted object for
  each store past N (`PoolView`; a store counts as use of the prefix it is chained on). Other
  reads do not reach the relay, so once N objects were withdrawn it resyncs again, which
  brings back what the pool has used most recently. What a resync costs and what
  the router holds then grow with N, not with the pool.
* Tier-2 credit (`tier2`, off by default): the cluster's tier-2 chunks of this worker's
  namespaces, announced at the disk tier (`tier2_credit`), in the same stream.
* Flow control (`downstream.DownstreamPipe`): the pipe to Dynamo's publisher holds at most
  `downstream_hwm` batches; what it refuses waits in the relay, in order, up to
  `max_unsent_bytes`, and a resync reads its next snapshot page only once nothing waits. Pool
  batches dropped past that are made good once the pipe drains: the blocks whose removal was
  dropped are withdrawn again, then the pool is announced again in full. So a
  resync of any size runs at the pace of Dynamo's publisher with about one page of batches in
  flight. Once a resync's batches are sent the relay asks glibc's malloc to return the memory
  the resync freed (`release_free_memory`).

`KvEventRelay` lives on an asyncio loop; `RelayThread` runs such a loop in a daemon thread
for code (like Dynamo's synchronous set-up function) that is not on a loop of ours.

Size: the relay's inputs (vLLM's stream, the pool's view, the tier-2 credit) share one output
stream, one sequence counter and one flow control; the views and the pipe live in modules of
their own, what is left here is their ordering into that one stream.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.downstream import DownstreamPipe, Lost, SendStats
from maru_vllm.events.nats_source import PoolEventSource, PoolSourceConfig
from maru_vllm.events.packed_chunks import ChunkStores
from maru_vllm.events.pool_view import NamespaceFilter, PoolView
from maru_vllm.events.tier2_credit import Tier2Credit, Tier2CreditConfig
from maru_vllm.events.types import (
    DEFAULT_MEDIUM,
    KNOWN_MEDIUMS,
    Announcement,
    BlocksRemoved,
    PoolEvent,
    PoolSnapshot,
)
from maru_vllm.pool.messages import SNAPSHOT_PAGE_BYTES

logger = logging.getLogger(__name__)

T = TypeVar("T")
MAX_BATCH_BLOCKS = 1024  # blocks per KVEventBatch the relay sends (a removal of many blocks is split too)


async def _received(receive: Callable[[], Awaitable[T]], what: str, level: int) -> AsyncIterator[T]:
    """Every message `receive()` returns; a failed receive is logged at `level` and retried."""
    while True:
        try:
            msg = await receive()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a socket error: the next receive may work
            logger.log(level, "%s receive failed: %s", what, exc)
            await asyncio.sleep(0.1)
            continue
        yield msg


@dataclasses.dataclass
class RelayStats(SendStats):
    """What one relay has passed on since it started (and, from `SendStats`, what the pipe to
    Dynamo's publisher took)."""

    vllm_batches: int = 0  # batches received from vLLM's publisher
    vllm_seq_gaps: int = 0  # breaks in vLLM's sequence numbers (batches that never arrived)
    pool_batches: int = 0  # batches of pool blocks announced
    pool_blocks_stored: int = 0  # blocks announced as stored at the pool's tier
    pool_blocks_removed: int = 0  # blocks announced as removed from it
    held_dropped: int = 0  # batches dropped while no subscriber had joined (the hold was full)
    full_announcements: int = 0  # times every pool block was announced again (late subscriber, after a resync)
    subscribers_joined: int = 0  # (re)subscriptions seen on the downstream socket


class KvEventRelay:
    """One merged stream for one DP rank (see module docstring)."""

    def __init__(
        self,
        *,
        upstream: str,
        downstream: str = "tcp://127.0.0.1:0",
        pool: PoolSourceConfig | None = None,
        namespaces: NamespaceFilter = NamespaceFilter(),
        block_size: int | None = None,
        medium: str = DEFAULT_MEDIUM,
        data_parallel_rank: int | None = None,
        topic: str = "",
        max_held: int = 100_000,
        max_held_pool_blocks: int = 65536,
        hwm: int = 100_000,
        downstream_hwm: int = 16,
        max_unsent_bytes: int = 64 << 20,
        max_page_wait_s: float = 30.0,
        reannounce_after_s: tuple[float, ...] = (3.0, 10.0),
        max_announced_chunks: int | None = None,
        tier2: Tier2CreditConfig | None = None,
    ) -> None:
        """`hwm`: messages the socket from vLLM queues; `downstream_hwm`: batches the pipe to
        Dynamo's publisher holds before the relay keeps them, `max_unsent_bytes`: bytes of
        batches the relay keeps at most (see `downstream`; with a pool, at least a snapshot page,
        `SNAPSHOT_PAGE_BYTES`, or every full announcement after a drop overruns it again); a
        resync waits at most `max_page_wait_s` for the pipe before it reads its next page anyway;
        `max_announced_chunks`: the announce cap (see module docstring; None: no cap); `tier2`:
        tier-2 credit (None: off)."""
        if downstream_hwm < 1:
            raise ValueError(f"downstream_hwm={downstream_hwm}: must be >= 1")
        if pool is not None and max_unsent_bytes < SNAPSHOT_PAGE_BYTES:
            raise ValueError(
                f"max_unsent_bytes={max_unsent_bytes}: must hold a snapshot page's batches, "
                f">= {SNAPSHOT_PAGE_BYTES} bytes (a smaller backlog overruns on every full announcement)"
            )
        if medium not in KNOWN_MEDIUMS:
            logger.warning(
                "medium %r is not one Dynamo's router places in a tier %s; its blocks will be ignored by the router",
                medium,
                KNOWN_MEDIUMS,
            )
        self.upstream = upstream
        self.downstream = downstream
        self.medium = medium
        self.dp_rank = data_parallel_rank
        self.topic = topic.encode()
        self.view = PoolView(namespaces, block_size, max_objects=max_announced_chunks)
        if max_announced_chunks is not None and pool is not None:
            pool = dataclasses.replace(pool, snapshot_recent=max_announced_chunks)
        if pool is not None and pool.snapshot_prefixes is None:  # snapshots of what this relay follows
            pool = dataclasses.replace(pool, snapshot_prefixes=namespaces.snapshot_prefixes)
        self.stats = RelayStats()
        self.endpoint: str | None = None
        self._pool_cfg = pool
        self.source: PoolEventSource | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._pipe = DownstreamPipe(self.topic, self.stats, max_unsent_bytes, self._on_drained)
        self._downstream_hwm = downstream_hwm
        self._max_page_wait_s = max_page_wait_s
        self._trim_when_sent = False  # a resync ended: return the memory it freed once its batches are sent
        self._announce_when_drained = False  # pool batches were dropped: announce the pool once drained
        self._open = False  # a subscriber has joined: send instead of holding
        self._held: collections.deque[bytes] = collections.deque(maxlen=max_held)
        self._held_pool: list[bytes] = []  # pool batches held until the first subscriber joins
        self._held_pool_blocks = 0
        self._max_held_pool_blocks = max_held_pool_blocks
        self._announce_on_join = False  # pool batches were dropped before the join: announce all then
        self._hwm = hwm
        self._last_vllm_seq: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.subscribed = asyncio.Event()
        self._reannounce_after_s = reannounce_after_s
        self._reannounce_timers: list[asyncio.TimerHandle] = []
        self._resyncs = 0
        self.tier2: Tier2Credit | None = None
        if tier2 is not None:
            self.tier2 = Tier2Credit(
                tier2,
                namespaces,
                block_size,
                lambda out: self._announce(out, tier2.medium),
            )

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> str:
        """Bind the downstream socket, connect upstream, start following the pool.

        Returns the downstream endpoint Dynamo's publisher must subscribe to.
        """
        self._ctx = zmq.asyncio.Context()
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every (re)subscription, not only the first
        DownstreamPipe.configure(pub, self._downstream_hwm)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.downstream)
        self._pub = self._pipe.socket = pub
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self._hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.upstream)
        self._sub = sub
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._vllm_loop(), name="maru-relay-vllm"),
            loop.create_task(self._subscription_loop(), name="maru-relay-subs"),
        ]
        if self._pool_cfg is not None:
            self.source = PoolEventSource(
                self._pool_cfg, self._on_pool_snapshot, self._on_pool_event, ready=self._downstream_ready
            )
            await self.source.start()
        if self.tier2 is not None:
            self.tier2.start()
        logger.info(
            "KV event relay: vLLM %s + pool %s -> %s (pool blocks at medium %s)",
            self.upstream,
            self._pool_cfg.pool_name if self._pool_cfg else None,
            self.endpoint,
            self.medium,
        )
        return self.endpoint

    async def stop(self) -> None:
        for timer in self._reannounce_timers:
            timer.cancel()
        if self.source is not None:
            await self.source.stop()
        if self.tier2 is not None:
            await self.tier2.stop()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        await self._pipe.stop()
        self.close_sockets()

    def close_sockets(self) -> None:
        """Close both sockets and the ZMQ context without waiting (safe once the loop is idle).

        A context left to the garbage collector calls a blocking `term()` from whatever thread
        happens to collect it; closing explicitly, with linger 0, never blocks.
        """
        for s in (self._sub, self._pub):
            if s is not None and not s.closed:
                s.close(linger=0)
        if self._ctx is not None and not self._ctx.closed:
            self._ctx.destroy(linger=0)

    # -- inputs ----------------------------------------------------------------------------
    async def _vllm_loop(self) -> None:
        assert self._sub is not None
        async for frames in _received(self._sub.recv_multipart, "vLLM KV event", logging.WARNING):
            if len(frames) != 3:
                logger.warning("ignoring a vLLM KV event message of %d frames", len(frames))
                continue
            _topic, seq_frame, payload = frames
            seq = vf.decode_seq(seq_frame)
            if self._last_vllm_seq is not None and seq != self._last_vllm_seq + 1:
                self.stats.vllm_seq_gaps += 1
                logger.warning("vLLM KV events %d..%d were not received", self._last_vllm_seq + 1, seq - 1)
            self._last_vllm_seq = seq
            self.stats.vllm_batches += 1
            self._emit(payload)

    async def _subscription_loop(self) -> None:
        assert self._pub is not None
        async for msg in _received(self._pub.recv, "XPUB", logging.DEBUG):
            if not msg or msg[0] != 1:
                continue  # an unsubscription
            self.stats.subscribers_joined += 1
            if not self._open:
                self._open = True
                held = [(p, True) for p in self._held_pool] + [(p, False) for p in self._held]
                self._held.clear()
                self._held_pool = []
                logger.info(
                    "Dynamo subscribed to the KV event relay at %s; sending %d held batches%s",
                    self.endpoint,
                    len(held),
                    ", then every pool block" if self._announce_on_join else "",
                )
                for payload, pool in held:
                    self._pipe.send(payload, pool=pool)
                if self._announce_on_join:
                    self._announce_everything()
            else:
                logger.info(
                    "another subscriber joined the KV event relay; re-announcing %d pool blocks", self.view.block_count
                )
                self._announce_everything()
            self.subscribed.set()

    def _announce_everything(self) -> None:
        """Announce every pool block again: a full resync from the pool (each block withdrawn and
        stored again, see module docstring)."""
        if self.source is not None and (self.view.block_count or self.view.resyncing):
            self.stats.full_announcements += 1
            self.source.request_resync(full=True)
        if self.tier2 is not None:
            self.tier2.reannounce()

    def _on_pool_snapshot(self, snap: PoolSnapshot) -> None:
        self._announce(self.view.resync(snap))
        if snap.last:
            self._trim_when_sent = True
            if self._pipe.drained:
                asyncio.get_running_loop().call_soon(self._on_drained, Lost())
        if not snap.last or snap.full:
            return  # a full resync is itself a re-announcement
        self._resyncs += 1
        if self._resyncs > 1:  # the first one is the start-up sync, delivered via the held batches
            self._schedule_reannounce()

    def _schedule_reannounce(self) -> None:
        """Announce every pool block again a few seconds after a resync.

        A resync follows a NATS outage, a pool restart or a gap - moments when Dynamo's own
        event-plane client may still be reconnecting, and what our publisher hands it then is
        lost (seen with Dynamo 1.6.1: the router kept no credit for blocks announced in the
        first second after NATS came back). Each block is withdrawn and stored again, so
        repeating them costs only messages.
        """
        for timer in self._reannounce_timers:
            timer.cancel()
        loop = asyncio.get_running_loop()
        self._reannounce_timers = [loop.call_later(delay, self._reannounce) for delay in self._reannounce_after_s]

    def _reannounce(self) -> None:
        logger.debug("re-announcing %d pool blocks after a resync", self.view.block_count)
        self._announce_everything()

    def _on_pool_event(self, ev: PoolEvent) -> None:
        self._announce(self.view.apply(ev))
        cap = self.view.max_objects
        if cap is not None and self.view.cap_withdrawals >= cap and self.source is not None:
            # the announced set has turned over once by stores alone: take the pool's recency again
            self.view.cap_withdrawals = 0
            self.source.request_resync()

    # -- output ----------------------------------------------------------------------------
    def _announce(self, announcements: Sequence[Announcement | ChunkStores], medium: str | None = None) -> None:
        """Send announcements (at `medium`, default the pool's) as KVEventBatches of at most
        MAX_BATCH_BLOCKS blocks each (a resync of 10^6 chunks must not become one gigabyte-sized
        message for Dynamo's publisher)."""
        batch: list[Announcement | ChunkStores] = []
        blocks = 0
        for a in _split(announcements):
            if batch and blocks + _blocks_of(a) > MAX_BATCH_BLOCKS:
                self._announce_batch(batch, medium)
                batch, blocks = [], 0
            batch.append(a)
            blocks += _blocks_of(a)
            if blocks >= MAX_BATCH_BLOCKS:
                self._announce_batch(batch, medium)
                batch, blocks = [], 0
        if batch:
            self._announce_batch(batch, medium)

    def _announce_batch(self, announcements: list[Announcement | ChunkStores], medium: str | None = None) -> None:
        medium = medium or self.medium
        try:
            payload = vf.encode_announcements(announcements, medium, data_parallel_rank=self.dp_rank)
        except Exception:
            logger.exception("could not encode pool KV events")
            return
        self.stats.pool_batches += 1
        logger.debug(
            "announcing pool blocks at %s: %s",
            medium,
            ", ".join(f"{type(a).__name__}x{_blocks_of(a)}" for a in announcements),
        )
        blocks = 0
        removed: list[Any] = []
        for a in announcements:
            blocks += _blocks_of(a)
            if isinstance(a, BlocksRemoved):
                self.stats.pool_blocks_removed += _blocks_of(a)
                removed += a.block_hashes
            else:
                self.stats.pool_blocks_stored += _blocks_of(a)
        if self._open:  # a lost removal is withdrawn again at the pool's medium; tier-2 ones by re-announcing
            self._pipe.send(payload, pool=True, removed=removed if medium == self.medium else ())
        elif self._held_pool_blocks + blocks <= self._max_held_pool_blocks and not self._announce_on_join:
            self._held_pool.append(payload)
            self._held_pool_blocks += blocks
        else:  # too much to hold: announce everything from the pool once Dynamo is there
            self._announce_on_join = True
            self._held_pool = []
            self._held_pool_blocks = 0

    def _emit(self, payload: bytes) -> None:
        if not self._open:
            if len(self._held) == self._held.maxlen:
                self.stats.held_dropped += 1
            self._held.append(payload)
            return
        self._pipe.send(payload)

    # -- flow control ----------------------------------------------------------------------
    async def _downstream_ready(self) -> None:
        """A resync's pace: its next page is read once every batch before it went to ZMQ."""
        await self._pipe.ready(self._max_page_wait_s)

    def _on_drained(self, lost: Lost) -> None:
        if lost.removed:
            # Withdrawn again first: the publisher still counts their stores, and announcing the
            # pool again only adds stores (a block the pool holds again is stored again right after)
            logger.info("withdrawing %d pool blocks again whose removal was dropped", len(lost.removed))
            self._announce([BlocksRemoved(tuple(lost.removed))])
        self._announce_when_drained |= lost.pool  # pool batches were dropped while the publisher lagged
        if not self._pipe.drained:
            return
        if self._announce_when_drained:
            self._announce_when_drained = False
            self._announce_everything()
        if self._trim_when_sent:
            self._trim_when_sent = False
            release_free_memory()

    @property
    def unsent_bytes(self) -> int:
        """Bytes of batches waiting in the relay for room in the pipe to Dynamo's publisher."""
        return self._pipe.unsent_bytes


def _blocks_of(a: Announcement | ChunkStores) -> int:
    return a.block_count if isinstance(a, ChunkStores) else len(a.block_hashes)


def _split(announcements: Sequence[Announcement | ChunkStores]) -> Iterator[Announcement | ChunkStores]:
    """`announcements` with every removal and run of chunk stores cut to MAX_BATCH_BLOCKS blocks."""
    for a in announcements:
        if isinstance(a, BlocksRemoved) and len(a.block_hashes) > MAX_BATCH_BLOCKS:
            for i in range(0, len(a.block_hashes), MAX_BATCH_BLOCKS):
                yield BlocksRemoved(a.block_hashes[i : i + MAX_BATCH_BLOCKS])
        elif isinstance(a, ChunkStores):
            yield from a.split(MAX_BATCH_BLOCKS)
        else:
            yield a


def release_free_memory() -> bool:
    """Ask glibc's malloc to return free heap pages to the system (`malloc_trim(0)`); False where
    there is no such call. A resync frees its pages' arrays and batches in pieces that malloc
    otherwise keeps."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim is False:
        return False
    _malloc_trim(0)
    return True


_malloc_trim: Any = None  # libc's malloc_trim once looked up; False where there is none


class RelayThread:
    """An asyncio loop in a daemon thread, for relays started from synchronous code."""

    def __init__(self, name: str = "maru-kv-event-relay") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30.0) -> T:
        """Run `coro` on the relay loop and wait for its result."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def stop(self, relays: list[KvEventRelay] | None = None, timeout: float = 5.0) -> None:
        if not self._thread.is_alive() or self.loop.is_closed():
            return
        for r in relays or []:
            try:
                self.call(r.stop(), timeout)
            except Exception as exc:
                logger.debug("relay stop: %s", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            for r in relays or []:
                r.close_sockets()  # relays whose stop timed out: the loop no longer uses them
