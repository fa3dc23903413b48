"""The relay's side of the pipe to Dynamo's publisher: batches numbered gap-free, in order, paced.

Dynamo 1.6.1's `KvEventPublisher` subscribes to the relay's XPUB socket; every batch carries the
next `seq` (ZMQ frames `topic`, `seq`, `payload`, as vLLM's own publisher sends them).

Flow control: the socket is `XPUB_NODROP` with a small `SNDHWM`, so a pipe that Dynamo has not
read refuses a batch instead of dropping it. A refused batch waits here - and so does every batch
after it, to keep the order - until the pipe takes it, retried with a short backoff. At most
`max_unsent_bytes` wait; past that a batch is dropped and counted, `on_drained(lost_pool=True)`
tells the owner once the pipe has caught up when a pool batch was among them (the relay then
announces the pool again in full). `ready()` returns once nothing waits (or after a deadline): a
resync reads its next snapshot page only then, so it runs at the pace of Dynamo's publisher and
keeps about one page of batches in memory, however large the pool.

A batch is numbered when ZMQ takes it, so the numbers Dynamo sees have no gaps whatever is
refused or dropped. Not thread-safe: it runs on the relay's event loop.

What a dropped batch cannot be made good by announcing the pool again is a removal: the
publisher still counts the block's store, and a later full announcement only adds stores. So a
batch sent with the blocks it removes (`send(..., removed=...)`) leaves them in `Lost.removed`
when it is dropped (at most `max_unsent_bytes // 64` distinct blocks; past that they are counted
in `removals_forgotten`), for the owner to withdraw again once the pipe drains.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import zmq
import zmq.asyncio

from maru_vllm.events import vllm_format as vf

logger = logging.getLogger(__name__)

_RETRY_FIRST_S = 0.001
_RETRY_MAX_S = 0.05


@dataclasses.dataclass
class SendStats:
    """What the pipe to Dynamo's publisher has taken and refused."""

    sent: int = 0  # batches sent to Dynamo's publisher
    send_errors: int = 0  # batches the downstream socket refused with an error (dropped)
    unsent_dropped: int = 0  # batches dropped because Dynamo's publisher fell max_unsent_bytes behind
    unsent_max_bytes: int = 0  # the most bytes of batches that ever waited for room in the pipe
    removals_lost: int = 0  # pool block removals in dropped batches (withdrawn again once drained)
    removals_forgotten: int = 0  # ... past the bound on how many are remembered


@dataclasses.dataclass
class Lost:
    """What the batches dropped since the pipe last drained carried (`on_drained`'s argument)."""

    pool: bool = False  # a pool batch: announce the pool again
    removed: set[Any] = dataclasses.field(default_factory=set)  # pool blocks whose removal was dropped

    def __bool__(self) -> bool:
        return self.pool or bool(self.removed)


class DownstreamPipe:
    """Ordered, numbered, flow-controlled sends on one XPUB socket (see module docstring)."""

    def __init__(
        self,
        topic: bytes,
        stats: SendStats,
        max_unsent_bytes: int,
        on_drained: Callable[[Lost], None],
    ) -> None:
        """`on_drained(lost)`: called each time the batches that waited have all been sent, with
        what the batches dropped meanwhile carried."""
        if max_unsent_bytes < 1:
            raise ValueError(f"max_unsent_bytes={max_unsent_bytes}: must be >= 1")
        self.topic = topic
        self.stats = stats
        self.socket: zmq.asyncio.Socket | None = None
        self.seq = 0  # the number of the next batch
        self._max_unsent_bytes = max_unsent_bytes
        self._on_drained = on_drained
        self._unsent: collections.deque[tuple[bytes, bool, Sequence[Any]]] = collections.deque()
        self._unsent_bytes = 0
        self._lost = Lost()
        self._failed = False  # the last `_try_send` was refused with an error
        self._max_lost_removals = max(1024, max_unsent_bytes // 64)
        self._drained = asyncio.Event()
        self._drained.set()
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def configure(socket: zmq.asyncio.Socket, hwm: int) -> None:
        """Make `socket` (an XPUB, before bind) refuse rather than drop once `hwm` batches wait."""
        if hwm < 1:
            raise ValueError(f"downstream_hwm={hwm}: must be >= 1")
        socket.setsockopt(zmq.XPUB_NODROP, 1)
        socket.setsockopt(zmq.SNDHWM, hwm)

    @property
    def unsent_bytes(self) -> int:
        """Bytes of batches waiting here for room in the pipe."""
        return self._unsent_bytes

    @property
    def drained(self) -> bool:
        return not self._unsent

    def send(self, payload: bytes, pool: bool = False, removed: Sequence[Any] = ()) -> None:
        """Send `payload` as the next batch, or keep it (behind any that wait) while the pipe is full.
        `pool`: it carries pool blocks (a drop of it is made good by a full announcement);
        `removed`: the pool blocks it withdraws (a drop of it is made good by withdrawing them again)."""
        if self._unsent or not self._try_send(payload):
            self._keep(payload, pool, removed)
        elif self._failed:  # nothing waits, so no drain follows: report the loss on its own
            self._dropped(pool, removed)
            asyncio.get_running_loop().call_soon(self._report_lost)

    async def ready(self, max_wait_s: float) -> None:
        """Until nothing waits here, or `max_wait_s` passed."""
        if self._drained.is_set():
            return
        try:
            await asyncio.wait_for(self._drained.wait(), max_wait_s)
        except asyncio.TimeoutError:
            logger.info("Dynamo's KV publisher has taken no batch for %.0f s; the resync reads on", max_wait_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    # -- internals -------------------------------------------------------------------------
    def _try_send(self, payload: bytes) -> bool:
        """Hand `payload` to ZMQ as batch `seq`; False when the pipe is full. `_failed` says whether
        the socket refused it with an error (it is dropped: True is returned all the same)."""
        assert self.socket is not None
        self._failed = False
        try:
            # pyzmq types the result as Awaitable; on a zmq.asyncio socket it is an asyncio Future.
            fut = cast(
                "asyncio.Future[Any]",
                self.socket.send_multipart((self.topic, vf.encode_seq(self.seq), payload), flags=zmq.NOBLOCK),
            )
            error = fut.exception() if fut.done() else None
            if error is not None:
                raise error
        except zmq.Again:
            return False
        except Exception as exc:
            self.stats.send_errors += 1
            logger.warning("KV event batch %d not sent: %s", self.seq, exc)
            self._failed = True
            return True  # dropped: the next batch takes its number
        self.seq += 1
        self.stats.sent += 1
        return True

    def _report_lost(self) -> None:
        if self._unsent or not self._lost:
            return  # the drain under way reports it
        lost, self._lost = self._lost, Lost()
        try:
            self._on_drained(lost)
        except Exception:
            logger.exception("relay drain callback failed")

    def _dropped(self, pool: bool, removed: Sequence[Any]) -> None:
        lost = self._lost
        lost.pool |= pool
        self.stats.removals_lost += len(removed)
        room = self._max_lost_removals - len(lost.removed)
        if len(removed) > room:
            if not self.stats.removals_forgotten:
                logger.error(
                    "more than %d pool block removals dropped before Dynamo's KV publisher caught up; the "
                    "router may credit this worker with blocks the pool no longer holds (loads of them miss)",
                    self._max_lost_removals,
                )
            self.stats.removals_forgotten += len(removed) - max(room, 0)
            removed = removed[: max(room, 0)]
        lost.removed.update(removed)

    def _keep(self, payload: bytes, pool: bool, removed: Sequence[Any]) -> None:
        if self._unsent_bytes + len(payload) > self._max_unsent_bytes:
            if not self.stats.unsent_dropped:
                logger.warning(
                    "Dynamo's KV publisher is %d bytes of batches behind; dropping batches%s",
                    self._unsent_bytes,
                    " (the pool's blocks are announced again once it catches up)" if pool else "",
                )
            self.stats.unsent_dropped += 1
            self._dropped(pool, removed)
            return
        self._unsent.append((payload, pool, removed))
        self._unsent_bytes += len(payload)
        self.stats.unsent_max_bytes = max(self.stats.unsent_max_bytes, self._unsent_bytes)
        self._drained.clear()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain(), name="maru-relay-drain")

    async def _drain(self) -> None:
        """Send what waits, then report the drain; again while the report itself queued batches
        (this task is still running then, so `_keep` starts no other)."""
        while self._unsent:
            await self._send_waiting()
            self._drained.set()
            lost, self._lost = self._lost, Lost()
            try:
                self._on_drained(lost)
            except Exception:
                logger.exception("relay drain callback failed")

    async def _send_waiting(self) -> None:
        delay = _RETRY_FIRST_S
        while self._unsent:
            payload, pool, removed = self._unsent[0]
            if self._try_send(payload):
                self._unsent.popleft()
                self._unsent_bytes -= len(payload)
                if self._failed:
                    self._dropped(pool, removed)
                delay = _RETRY_FIRST_S
            else:
                await asyncio.sleep(delay)
                delay = min(2 * delay, _RETRY_MAX_S)
