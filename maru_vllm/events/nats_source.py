"""The pool's event stream as an ordered, gap-free sequence of snapshots and events.

`PoolEventSource` subscribes to `maru.<pool>.events` with nats-py and hands its owner either
a `PoolSnapshot` (`on_snapshot`: replace what you know) or the next `PoolEvent` (`on_event`:
apply it). It resyncs from a snapshot - and only then delivers events again - when it

* starts (a late start sees everything that is already in the pool),
* sees a `seq` gap (the pool dropped events, or NATS lost some),
* sees a new `incarnation` (the pool restarted empty),
* reconnects to NATS after an outage (events sent meanwhile never reached us),
* probes an idle pool and finds a newer incarnation or a `seq` beyond what it applied.

Snapshots come page by page (`messages.SnapshotPage`) from the socket `snapshot` op when a pool
address is known, else from the NATS request `maru.<pool>.snapshot`; either way a snapshot of any
size arrives in bounded messages, and each page is handed to `on_snapshot` as it arrives (a
`PoolSnapshot` part: `part` 0, 1, ..., `last` on the final one), so neither side ever holds the
whole snapshot. `request_resync(full=True)` asks for a resync whose parts are marked `full`
(the owner announces everything again). An owner that passes `ready` paces a resync: each page
is handed over only once `ready()` returns, so a slow consumer downstream is never run over by
the snapshot. Probes use the NATS request with a
namespace no object has, so they are cheap. Nothing here ever raises into the owner; while
NATS or the pool is unreachable the owner's view simply stays as it is ("paused").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any

import msgspec

from maru_vllm.events.types import EventFormatError, PoolEvent, PoolSnapshot
from maru_vllm.pool.events import events_subject, snapshot_subject
from maru_vllm.pool.messages import SnapshotPage, decode_snapshot_page
from maru_vllm.pool.nats_link import NatsLink

logger = logging.getLogger(__name__)

#: A namespace no pool object has: a snapshot request for it returns only incarnation and seq.
PROBE_NAMESPACE = "\x00maru-events-probe"
_RESYNC = object()  # queue marker: resync now


@dataclasses.dataclass(frozen=True)
class PoolSourceConfig:
    nats_url: str
    pool_name: str
    #: the pool service address (unix:///... or tcp://...), for snapshots of any size
    pool_address: str | None = None
    pool_token: str | None = None
    #: request snapshots of this namespace only (None: all namespaces, filtered by the owner)
    snapshot_namespace: str | None = None
    #: > 0: snapshots list only the pool's this many most recently used objects (of the
    #: namespaces asked for)
    snapshot_recent: int = 0
    #: snapshots list only namespaces starting with one of these (None: all; the relay sets
    #: its namespace filter's), and `snapshot_recent` counts only those
    snapshot_prefixes: tuple[str, ...] | None = None
    probe_interval_s: float = 10.0
    request_timeout_s: float = 5.0
    max_queue: int = 200_000


@dataclasses.dataclass
class SourceStats:
    """What the source has done since it started (the relay logs them; tests read them)."""

    events_applied: int = 0  # handed to on_event in order
    events_skipped: int = 0  # already covered by the snapshot applied
    resyncs: int = 0  # snapshots applied
    resync_failures: int = 0  # snapshots that could not be fetched (retried with backoff)
    gaps: int = 0  # missing seqs found in the stream or by a probe
    incarnation_changes: int = 0  # pool restarts noticed
    reconnects: int = 0  # NATS connections that came back
    probes: int = 0  # idle checks sent
    bad_messages: int = 0  # events that did not parse
    overflows: int = 0  # times the queue filled up and was dropped for a resync


def _next_page(pages: Generator[SnapshotPage, None, None]) -> SnapshotPage | None:
    return next(pages, None)


class PoolEventSource:
    """See module docstring. Runs on the caller's event loop: `await start()`, `await stop()`."""

    def __init__(
        self,
        config: PoolSourceConfig,
        on_snapshot: Callable[[PoolSnapshot], None],
        on_event: Callable[[PoolEvent], None],
        ready: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`ready`: awaited before each snapshot page is handed to `on_snapshot` (flow control)."""
        self.config = config
        self._on_snapshot = on_snapshot
        self._on_event = on_event
        self._ready = ready
        self.incarnation: str | None = None
        self.last_seq = 0
        self.synced = False
        self.connected = False
        self.stats = SourceStats()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._need_resync = True
        self._full_resync = False
        self._link = NatsLink(
            config.nats_url,
            f"maru-events-{config.pool_name}",
            on_disconnect=self._on_disconnect,
            on_reconnect=self._on_reconnect,
        )
        self._stopping = False
        self._synced_event = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._link.start(self._run(), name="maru-pool-events")

    async def stop(self) -> None:
        self._stopping = True
        await self._link.stop()

    async def wait_synced(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._synced_event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def request_resync(self, full: bool = False) -> None:
        """Resync from a snapshot soon; `full`: its parts ask the owner to announce everything."""
        self._need_resync = True
        self._full_resync |= full
        self._queue.put_nowait(_RESYNC)

    # -- main loop -------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._connect()
            backoff = 0.2
            while not self._stopping:
                if self._need_resync:
                    if await self._resync():
                        backoff = 0.2
                    else:
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, 5.0)
                        continue
                try:
                    item = await asyncio.wait_for(self._queue.get(), self.config.probe_interval_s)
                except asyncio.TimeoutError:
                    await self._probe()
                    continue
                if item is _RESYNC:
                    continue
                self._handle(item)
        except asyncio.CancelledError:
            raise
        except Exception:  # never let a bug here take anything else down
            logger.exception("pool event source stopped; pool awareness is off for this worker")

    async def _connect(self) -> None:
        subject = events_subject(self.config.pool_name)

        async def subscribe(nc: Any) -> None:
            await nc.subscribe(subject, cb=self._on_msg, pending_msgs_limit=self.config.max_queue)
            await nc.flush(timeout=self.config.request_timeout_s)

        if await self._link.connect(subscribe, what="subscribe to pool events", stopping=lambda: self._stopping):
            self.connected = True
            logger.info("following pool %r events on %s (%s)", self.config.pool_name, subject, self.config.nats_url)

    async def _on_msg(self, msg: Any) -> None:
        if self._queue.qsize() >= self.config.max_queue:
            # Drop everything queued: a resync covers it (and is cheaper than catching up).
            self.stats.overflows += 1
            while not self._queue.empty():
                self._queue.get_nowait()
            self.request_resync()
            return
        self._queue.put_nowait(msg.data)

    async def _on_disconnect(self) -> None:
        if self.connected and not self._stopping:
            logger.warning("NATS connection to %s lost; pool awareness paused", self.config.nats_url)
        self.connected = False

    async def _on_reconnect(self) -> None:
        self.connected = True
        self.stats.reconnects += 1
        logger.info("NATS reconnected; resyncing with pool %r", self.config.pool_name)
        self.request_resync()

    # -- events ----------------------------------------------------------------------------
    def _handle(self, data: bytes) -> None:
        try:
            ev = PoolEvent.from_json(data)
        except EventFormatError as exc:
            self.stats.bad_messages += 1
            logger.warning("ignoring a malformed pool event: %s", exc)
            return
        if not self.synced:
            return  # a resync is pending and will cover it
        if ev.incarnation != self.incarnation:
            self.stats.incarnation_changes += 1
            logger.info(
                "pool %r restarted (incarnation %s -> %s); resyncing",
                self.config.pool_name,
                self.incarnation,
                ev.incarnation,
            )
            self._need_resync = True
            return
        if ev.seq <= self.last_seq:
            self.stats.events_skipped += 1  # already in the snapshot we applied
            return
        if ev.seq != self.last_seq + 1:
            self.stats.gaps += 1
            logger.warning(
                "pool %r events %d..%d missing; resyncing", self.config.pool_name, self.last_seq + 1, ev.seq - 1
            )
            self._need_resync = True
            return
        self.last_seq = ev.seq
        self.stats.events_applied += 1
        try:
            self._on_event(ev)
        except Exception:
            logger.exception("pool event handler failed; resyncing")
            self._need_resync = True

    # -- snapshots -------------------------------------------------------------------------
    async def _resync(self) -> bool:
        if self._link.nc is None or not self.connected:
            return False
        full, self._full_resync = self._full_resync, False
        self._need_resync = False  # a request from now on (e.g. while this one runs) is another resync
        first: SnapshotPage | None = None
        part = 0
        try:
            async for page in self._snapshot_pages(self.config.snapshot_namespace):
                first = first or page
                snap = PoolSnapshot.from_page(page, first, part, full)
                part += 1
                try:
                    if self._ready is not None:
                        await self._ready()
                    self._on_snapshot(snap)
                except Exception:
                    logger.exception("pool snapshot handler failed")
        except Exception as exc:
            self.stats.resync_failures += 1
            self._need_resync = True
            self._full_resync |= full
            logger.warning(
                "pool %r snapshot failed (%s); pool awareness paused until it works", self.config.pool_name, exc
            )
            return False
        assert first is not None
        # Everything queued up to now is either in the snapshot (seq <= its seq, skipped on
        # arrival) or after it; nothing queued needs to be discarded.
        self.incarnation = first.incarnation
        self.last_seq = first.seq
        self.synced = True
        self.stats.resyncs += 1
        self._synced_event.set()
        logger.info(
            "pool %r synced at seq %d (incarnation %s, %d pages%s)",
            self.config.pool_name,
            first.seq,
            first.incarnation,
            part,
            ", everything announced again" if full else "",
        )
        return True

    async def _snapshot_pages(self, namespace: str | None) -> AsyncIterator[SnapshotPage]:
        """The snapshot's pages in order, each fetched when the previous one was handled."""
        if not self.config.pool_address:
            after = 0
            while True:  # page by page: each NATS reply stays under the server's max payload
                page = await self._nats_snapshot_page(
                    namespace, after, self.config.snapshot_recent, self.config.snapshot_prefixes
                )
                yield page
                if page.next is None:
                    return
                after = page.next
        pages = self._socket_pages(namespace)
        # the next page is fetched (the pool builds it, the thread decodes it) while this one is handled
        fetch: asyncio.Future[SnapshotPage | None] | None = asyncio.ensure_future(asyncio.to_thread(_next_page, pages))
        try:
            while fetch is not None:
                got = await fetch
                fetch = None
                if got is None:
                    return
                if got.next is not None:
                    fetch = asyncio.ensure_future(asyncio.to_thread(_next_page, pages))
                yield got
        finally:
            if fetch is not None:  # the generator must not be closed while a thread runs it
                await asyncio.wait([fetch])
                if not fetch.cancelled():
                    fetch.exception()  # retrieved: an error of a page nobody asked for is not logged
            await asyncio.to_thread(pages.close)

    def _socket_pages(self, namespace: str | None) -> Generator[SnapshotPage, None, None]:
        """Pages over one short-lived pool connection (run in a thread: it blocks)."""
        from maru_vllm.pool import PoolClient

        assert self.config.pool_address is not None
        with PoolClient.connect(
            self.config.pool_address,
            self.config.pool_token,
            timeout=self.config.request_timeout_s,
            heartbeat=False,
            populate=False,
        ) as c:
            yield from c.snapshot_pages(
                namespace, recent=self.config.snapshot_recent, prefixes=self.config.snapshot_prefixes
            )

    async def _nats_snapshot_page(
        self, namespace: str | None, after: int = 0, recent: int = 0, prefixes: tuple[str, ...] | None = None
    ) -> SnapshotPage:
        request: dict[str, Any] = {"namespace": namespace, "after": after}
        if recent > 0:
            request["recent"] = recent
        if prefixes is not None:
            request["prefixes"] = list(prefixes)
        body = msgspec.json.encode(request)
        reply = await self._link.nc.request(
            snapshot_subject(self.config.pool_name), body, timeout=self.config.request_timeout_s
        )
        return decode_snapshot_page(reply.data)

    async def _probe(self) -> None:
        """Idle check: has the pool restarted, or moved past what we applied?"""
        if self._link.nc is None or not self.connected or not self.synced:
            return
        self.stats.probes += 1
        try:
            page = await self._nats_snapshot_page(PROBE_NAMESPACE)
            incarnation, seq = page.incarnation, page.seq
        except Exception as exc:
            logger.debug("pool probe failed: %s", exc)
            return
        if incarnation != self.incarnation:
            self.stats.incarnation_changes += 1
            logger.info("pool %r has a new incarnation %s; resyncing", self.config.pool_name, incarnation)
            self._need_resync = True
        elif seq > self.last_seq and self._queue.empty():
            self.stats.gaps += 1
            logger.info("pool %r is at seq %d but we applied %d; resyncing", self.config.pool_name, seq, self.last_seq)
            self._need_resync = True
