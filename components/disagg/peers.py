"""Which workers of a role are alive, seen from one worker, without waiting for discovery to expire.

Dynamo's file discovery keeps a SIGKILLed worker's registration until its lease expires (~10 s),
and the frontend fails requests it routes to that worker meanwhile. A worker that is to stand in
for a dead peer cannot wait that long, so liveness is read from a stream instead:

* every disaggregated Maru worker serves `WATCH` (`maru_watch`) on its own component
  (`serve_watch`): a stream that says who it is at once and then sends a heartbeat every
  `HEARTBEAT_S` for as long as the caller listens;
* `PeerWatch` opens one such stream to every instance of the watched role that discovery lists.
  When the peer's process dies, the kernel closes its sockets and the stream ends within a round
  trip; when the peer stops on purpose, Dynamo unregisters its `generate` instance first.

A peer is **live** while its stream is open *and* its `generate` instance is registered in
discovery. Both come from Dynamo's own request plane and discovery client; nothing here reads
Dynamo's files or parses its addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from maru_dynamo.components.disagg.roles import COMPONENT, GENERATE, WATCH, endpoint_path

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # far below any response-inactivity timeout on Dynamo's response plane
POLL_S = 0.1  # how often discovery's instance lists are looked at
RETRY_S = 0.5  # a broken stream to a peer that discovery still lists is reopened after this


async def serve_watch(runtime: Any, namespace: str, role: str, instance_id: int) -> Any:
    """Serve this worker's `maru_watch` endpoint in a task of the running loop; returns the
    endpoint (for the list a graceful stop unregisters)."""
    endpoint = runtime.endpoint(endpoint_path(namespace, role, WATCH))

    async def watch(request: Any, context: Any) -> AsyncIterator[dict[str, Any]]:
        yield {"role": role, "instance_id": instance_id}
        while not context.is_stopped():
            await asyncio.sleep(HEARTBEAT_S)
            yield {"heartbeat": True}

    # serve_endpoint returns a future, not a coroutine
    task = asyncio.ensure_future(endpoint.serve_endpoint(watch, graceful_shutdown=False))
    _keep(task, f"{COMPONENT[role]}.{WATCH}")
    return endpoint


class PeerWatch:
    """The live workers of `role` (see the module docstring); `on_change(live ids)` on each change."""

    def __init__(
        self,
        runtime: Any,
        namespace: str,
        role: str,
        *,
        watcher_id: int,
        on_change: Callable[[frozenset[int]], None],
        poll_s: float = POLL_S,
        retry_s: float = RETRY_S,
    ) -> None:
        self.runtime, self.namespace, self.role = runtime, namespace, role
        self.watcher_id = watcher_id
        self.on_change = on_change
        self.poll_s, self.retry_s = poll_s, retry_s
        self._open: set[int] = set()  # peers whose stream delivered its first message and is open
        self._tried: set[int] = set()  # peers whose first stream opened or failed
        self.first_look = asyncio.Event()  # set once every peer listed at the start was tried
        self._streams: dict[int, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._live: frozenset[int] = frozenset()
        self._watch_client: Any = None
        self._generate_client: Any = None

    @property
    def live(self) -> frozenset[int]:
        return self._live

    async def run(self) -> None:
        """Follow the role's workers until cancelled."""
        self._watch_client = await self.runtime.endpoint(endpoint_path(self.namespace, self.role, WATCH)).client()
        self._generate_client = await self.runtime.endpoint(endpoint_path(self.namespace, self.role, GENERATE)).client()
        try:
            while True:
                listed = set(self._watch_client.instance_ids()) - {self.watcher_id}
                for peer in listed - self._streams.keys():
                    self._streams[peer] = asyncio.get_running_loop().create_task(self._follow(peer))
                live = frozenset(self._open & set(self._generate_client.instance_ids()))
                if live != self._live:
                    self._live = live
                    self.on_change(live)
                if listed <= self._tried:
                    self.first_look.set()
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.poll_s)
        finally:
            for task in self._streams.values():
                task.cancel()

    async def _follow(self, peer: int) -> None:
        """Keep a stream open to `peer` while discovery lists it; mark it open while one is."""
        try:
            while peer in set(self._watch_client.instance_ids()):
                try:
                    stream = await self._watch_client.direct({"watcher": self.watcher_id}, peer, annotated=False)
                    async for _ in stream:
                        if peer not in self._open:
                            self._open.add(peer)
                            self._tried.add(peer)
                            self._wake.set()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a dead peer: connection refused or a broken stream
                    logger.debug("maru_watch stream to %s %x ended: %s", self.role, peer, exc)
                self._tried.add(peer)
                if peer in self._open:
                    self._open.discard(peer)
                    self._wake.set()
                await asyncio.sleep(self.retry_s)
        finally:
            self._open.discard(peer)
            self._streams.pop(peer, None)
            self._wake.set()


_tasks: set[asyncio.Future[Any]] = set()


def _keep(task: asyncio.Future[Any], what: str) -> None:
    """Hold a reference to a background task and log how it ended, unless it was cancelled."""
    _tasks.add(task)

    def done(t: asyncio.Future[Any]) -> None:
        _tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            logger.error("maru_worker: %s ended: %s", what, t.exception())

    task.add_done_callback(done)
