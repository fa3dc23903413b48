"""Publishing pool events (`stored` / `removed`) and serving snapshots over NATS.

Payloads are JSON: `messages.PoolEventMsg` (bytes in `meta` become base64 strings)::

    {"type": "stored"|"removed", "seq": 7, "incarnation": "<hex>", "pool": "<name>",
     "namespace": "default", "key": "<hex>", "size": 123, "meta": {...}, "ts": 1.7e9}

`seq` starts at 1 for each incarnation and has no gaps. Ops never wait on NATS: events go
into an in-process queue that a background task drains. While NATS is unreachable the queue
holds events (up to `max_queue`) and they are published in order after reconnecting; if the
queue overflows, the oldest events are dropped (counted in `dropped`), which subscribers see
as a gap in `seq` - they then resync with a snapshot (request on `maru.<pool>.snapshot`, or the
socket `snapshot` op), which carries the `seq` it is consistent with. Snapshots come in pages
(`messages.SnapshotPage`): a NATS request body `{"namespace": ..., "after": <cursor>}` gets the
page after that cursor, sized to fit the server's max payload.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from maru_vllm.pool import messages as M
from maru_vllm.pool.nats_link import NatsLink

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()


class SnapshotRequest(msgspec.Struct):
    """The body of a NATS snapshot request (all fields optional; `{}` asks for the first page)."""

    namespace: str | None = None
    after: int = 0
    limit: int = 16384
    recent: int = 0  # > 0: only the `recent` most recently used objects (of the namespaces asked for)
    prefixes: list[str] | None = None  # only namespaces starting with one of these


_request_decoder = msgspec.json.Decoder(SnapshotRequest)


def events_subject(pool_name: str) -> str:
    """The NATS subject a pool publishes its stored/removed events on."""
    return f"maru.{pool_name}.events"


def snapshot_subject(pool_name: str) -> str:
    """The NATS request subject that answers with the pool's current object set."""
    return f"maru.{pool_name}.snapshot"


class EventPublisher:
    """Queue + background NATS publisher; `emit` never blocks and never raises."""

    def __init__(
        self,
        url: str,
        pool: str,
        snapshot: Callable[[str | None, int, int, int, int, list[str] | None], M.SnapshotPage],
        *,
        max_queue: int = 200_000,
    ) -> None:
        self.url = url
        self.pool = pool
        self.subject = events_subject(pool)
        self._snapshot = snapshot
        self._queue: collections.deque[bytes] = collections.deque()
        self._max_queue = max_queue
        self._wake = asyncio.Event()
        self._link = NatsLink(
            url, f"maru-pool-{pool}", on_disconnect=self._on_disconnect, on_reconnect=self._on_reconnect
        )
        self._stopping = False
        self.published = 0
        self.dropped = 0
        self.connected = False

    def emit(self, event: bytes) -> None:
        """Queue one encoded event (`messages.encode_event`)."""
        if len(self._queue) >= self._max_queue:
            self._queue.popleft()
            self.dropped += 1
        self._queue.append(event)
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._link.start(self._run(), name="maru-events")

    async def _connect(self) -> None:
        async def serve_snapshots(nc: Any) -> None:
            await nc.subscribe(snapshot_subject(self.pool), cb=self._on_snapshot_request)

        if await self._link.connect(serve_snapshots, what="connect to NATS", stopping=lambda: self._stopping):
            self.connected = True
            logger.info("publishing pool events to %s on %s", self.url, self.subject)

    async def _run(self) -> None:
        await self._connect()
        while not self._stopping:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            payload = self._queue[0]
            try:
                await self._link.nc.publish(self.subject, payload)
            except Exception as exc:  # nats-py: outbound buffer full / connection closed
                logger.debug("event publish deferred: %s", exc)
                await asyncio.sleep(0.2)
                continue
            self._queue.popleft()
            self.published += 1
            if self.published % 256 == 0:
                await asyncio.sleep(0)  # let ops run between large bursts

    async def _on_snapshot_request(self, msg: Any) -> None:
        try:
            req = _request_decoder.decode(msg.data) if msg.data else SnapshotRequest()
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            req = None
            body = _json.encode(M.ErrorMsg("bad_request", f"invalid snapshot request: {exc}"))
        if req is not None:
            max_payload = getattr(self._link.nc, "max_payload", 1 << 20)
            # leave room for the page envelope; a page stops once its objects pass the budget
            # (a page may pass its byte budget by one object, at most ~17 KiB of JSON)
            budget = max(max_payload // 2, max_payload - 64 * 1024)
            page = self._snapshot(
                req.namespace,
                max(0, req.after),
                max(1, min(req.limit, 16384)),
                budget,
                max(0, req.recent),
                req.prefixes[: M.MAX_SNAPSHOT_PREFIXES] if req.prefixes is not None else None,
            )
            body = _json.encode(page)
            if len(body) > max_payload:
                body = _json.encode(
                    M.ErrorMsg("too_large", "a snapshot page exceeds the NATS max payload; use the socket snapshot op")
                )
        try:
            await msg.respond(body)
        except Exception as exc:  # the requester may be gone
            logger.debug("snapshot reply failed: %s", exc)

    async def _on_disconnect(self) -> None:
        self.connected = False
        logger.warning("NATS disconnected; events are queued until it is back")

    async def _on_reconnect(self) -> None:
        self.connected = True
        logger.info("NATS reconnected; resuming event publishing")

    async def close(self, flush_timeout: float = 2.0) -> None:
        """Publish what is queued (bounded by `flush_timeout`), then disconnect."""
        if self._link.nc is not None and self.connected:
            try:
                await asyncio.wait_for(self._drain_queue(), flush_timeout)
            except asyncio.TimeoutError:
                logger.warning("%d events not published at shutdown", len(self._queue))
        self._stopping = True
        self._wake.set()
        await self._link.stop(flush_timeout)

    async def _drain_queue(self) -> None:
        # Polls until _run has published the backlog (only at shutdown, under stop()'s timeout); an
        # "emptied" event would be one more thing every emit() has to signal.
        while self._queue:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        await self._link.nc.flush(timeout=1)
