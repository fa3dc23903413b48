"""`RoleGuard`: one disaggregated worker's liveness stream, its stand-in and the rule between them.

Started by the worker once it is registered (`hook.py`); runs in the worker's event loop:

1. serves this worker's `maru_watch` (`peers.serve_watch`), so the other role's workers see it;
2. follows the other role's live workers (`peers.PeerWatch`), waiting up to `FIRST_LOOK_S` for the
   ones already running to be seen, logs each change of their number, and starts the stand-in
   for the other role (`standby.Standby`: in discovery, forwarding to the role's live workers);
3. applies `policy.StandbyPolicy` to the live count: no live worker of that role - the stand-in is
   promoted (it serves what it gets on this engine, as it would anyway with nobody to forward to)
   and the log says, once, that the role is degraded; one is live again - the stand-in is
   withdrawn and the log says, once, that disaggregated serving is restored.

A guard that cannot start its stand-in logs one error and leaves the worker serving its own role.
Once the worker is stopping (`stopping()`: Dynamo's graceful shutdown has begun and unregisters the
stand-in with the worker's other endpoints) the guard ends: a stopping worker stands in for no one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from maru_dynamo.components.disagg.peers import PeerWatch, serve_watch
from maru_dynamo.components.disagg.policy import StandbyPolicy, Transition
from maru_dynamo.components.disagg.roles import COMPONENT, GENERATE, other_role
from maru_dynamo.components.disagg.standby import Standby

logger = logging.getLogger(__name__)

FIRST_LOOK_S = 5.0  # at most this long for the peers already running to be seen at the start


class RoleGuard:
    def __init__(
        self,
        standby: Standby,
        *,
        runtime: Any,
        namespace: str,
        role: str,
        instance_id: int,
        policy: StandbyPolicy | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.standby = standby
        self.stopping = stopping
        self.runtime, self.namespace = runtime, namespace
        self.role = role  # this worker's own role
        self.other = other_role(role)
        self.instance_id = instance_id
        self.policy = policy or StandbyPolicy()
        self._changed = asyncio.Event()
        self._live: frozenset[int] = frozenset()
        self._served_before = 0
        self._watcher: asyncio.Task[None] | None = None
        self.endpoints: list[Any] = []  # what a graceful stop unregisters

    async def start(self) -> list[Any]:
        """Serve the liveness stream, follow the other role and start the stand-in; returns the
        endpoints to unregister on a stop."""
        self.endpoints.append(await serve_watch(self.runtime, self.namespace, self.role, self.instance_id))
        watch = PeerWatch(
            self.runtime, self.namespace, self.other, watcher_id=self.instance_id, on_change=self._on_change
        )
        self._watcher = asyncio.get_running_loop().create_task(watch.run())
        # The stand-in decides by the live peers: know the ones already running before it serves.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(watch.first_look.wait(), FIRST_LOOK_S)
        await self.standby.start(self.instance_id, lambda: self._live)
        self.endpoints.append(self.standby.endpoint)
        logger.info(
            "maru_worker: %s worker stands by for the %s role (%s.%s on this engine, in discovery: it passes "
            "requests on to a live %s worker, and serves them itself when none answers)",
            self.role,
            self.other,
            COMPONENT[self.other],
            GENERATE,
            self.other,
        )
        return self.endpoints

    async def run(self) -> None:
        """Promote / withdraw the stand-in as the other role's workers come and go, until cancelled."""
        watcher = self._watcher
        assert watcher is not None, "start() first"
        try:
            while not self.stopping():
                now = time.monotonic()
                transition = self.policy.update(now, len(self._live))
                if transition is not None:
                    self._apply(transition)
                if watcher.done():
                    watcher.result()  # raise what ended it
                    return
                wait = self.policy.next_check(time.monotonic())
                self._changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 1.0 if wait is None else max(wait, 0.01))
            logger.info("maru_worker: the worker is stopping; it stands in for the %s role no more", self.other)
        finally:
            watcher.cancel()

    def _apply(self, transition: Transition) -> None:
        """Mark the stand-in standing in or not, and say so."""
        if transition == "promote":
            self.standby.promote()
            self._served_before = self.standby.served
            logger.warning(
                "maru_worker: disaggregation degraded: no %s worker is live; this %s worker serves the %s role too "
                "until one is back",
                self.other,
                self.role,
                self.other,
            )
        else:
            self.standby.withdraw()
            logger.warning(
                "maru_worker: disaggregation restored: %d %s worker(s) live; this worker no longer serves the %s "
                "role (it served %d request(s) for it)",
                len(self._live),
                self.other,
                self.other,
                self.standby.served - self._served_before,
            )

    def _on_change(self, live: frozenset[int]) -> None:
        self._live = live
        logger.info("maru_worker: %d live %s worker(s)", len(live), self.other)
        self._changed.set()
