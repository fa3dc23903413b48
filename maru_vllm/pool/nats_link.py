"""One long-lived NATS connection: the first connect retried with backoff, nats.py's reconnect after it.

nats.py reconnects a connection it once made, forever with `max_reconnect_attempts=-1`, and
re-subscribes what was subscribed; it does not retry the first connect (NATS may start after
the pool or a worker) and it only tells its owner about an outage through callbacks. `NatsLink`
adds the retried first connect, with the owner's subscriptions made as part of it, and a close
that is bounded in time, together with the owner's task that uses the connection. Both users - the pool's event
publisher and a worker's event source - keep their own state in the disconnect/reconnect callbacks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)

Callback = Callable[[], Awaitable[None]]


class NatsLink:
    """A NATS client connection named `name` to `url` (nats-py's `Client` in `nc` once connected)."""

    FIRST_BACKOFF_S = 0.2
    MAX_BACKOFF_S = 5.0

    def __init__(self, url: str, name: str, *, on_disconnect: Callback, on_reconnect: Callback) -> None:
        self.url = url
        self.name = name
        self._on_disconnect = on_disconnect
        self._on_reconnect = on_reconnect
        self.nc: Any = None
        self._task: asyncio.Task[None] | None = None

    def start(self, main: Coroutine[Any, Any, None], name: str) -> None:
        """Run the owner's `main` (which calls `connect` first) as a task on the running loop."""
        self._task = asyncio.get_running_loop().create_task(main, name=name)

    async def stop(self, timeout: float = 2.0) -> None:
        """Cancel the owner's task, wait for it, then close the connection."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # it is gone either way
                pass
        await self.close(timeout)

    async def connect(
        self, setup: Callable[[Any], Awaitable[None]], *, what: str, stopping: Callable[[], bool]
    ) -> bool:
        """Connect and run `setup(nc)` (subscribe, flush); on any failure close, wait, try again.

        Returns True once both worked, False when `stopping()` turned true first. `what` names
        the purpose in the retry warning ("cannot <what> at <url>").
        """
        import nats  # imported here: a pool without --nats never touches NATS

        backoff = self.FIRST_BACKOFF_S
        while not stopping():
            try:
                self.nc = await nats.connect(
                    servers=[self.url],
                    name=self.name,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    connect_timeout=2,
                    disconnected_cb=self._on_disconnect,
                    reconnected_cb=self._on_reconnect,
                    error_cb=self._on_error,
                )
                await setup(self.nc)
                return True
            except Exception as exc:  # nats-py raises its own error types as well as OSError
                logger.warning("cannot %s at %s (%s); retrying in %.1fs", what, self.url, exc, backoff)
                await self.close()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.MAX_BACKOFF_S)
        return False

    async def close(self, timeout: float = 2.0) -> None:
        """Close the connection (nats-py flushes what it buffered), waiting at most `timeout`."""
        nc, self.nc = self.nc, None
        if nc is None:
            return
        try:
            await asyncio.wait_for(nc.close(), timeout)
        except Exception as exc:  # already closed, or the server is gone
            logger.debug("NATS close: %s", exc)

    @staticmethod
    async def _on_error(exc: Exception) -> None:
        logger.debug("NATS error: %s", exc)
