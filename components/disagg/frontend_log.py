"""The frontend's log of a disaggregated graph's roles: one line when a role is degraded, one when restored.

`RoleLog` reads the frontend's own `/health` every `interval_s` in a daemon thread and logs each
change of the state `view.RoleView` reads from it, once. A dead worker stays listed until
discovery drops it (at once under `graph run`, at its lease's end elsewhere), so the frontend's
line can come that much after the other role's workers' own.
Nothing is logged for a graph without `maru_watch` endpoints (aggregated, or
`--no-maru-standby`), nor while the frontend is not up.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request

from maru_dynamo.components.disagg.roles import DECODE, PREFILL
from maru_dynamo.components.disagg.view import RoleView

logger = logging.getLogger(__name__)


class RoleLog:
    """Logs the graph's role state as the frontend sees it, once per change (see the module docstring)."""

    def __init__(self, health_url: str, interval_s: float = 1.0) -> None:
        self.health_url = health_url
        self.interval_s = interval_s
        self.state: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def observe(self, view: RoleView) -> str | None:
        """Take one view; return the line logged for it, if any."""
        state = view.state()
        if state is None or state == self.state:
            return None
        before, self.state = self.state, state
        if state == "prefill degraded":
            line = (
                f"disaggregation degraded: no prefill worker; {len(view.standing_in(PREFILL))} decode worker(s) "
                "prefill requests themselves until one is back"
            )
        elif state == "decode degraded":
            line = (
                f"disaggregation degraded: no decode worker; {len(view.standing_in(DECODE))} prefill worker(s) "
                "decode requests themselves until one is back"
            )
        elif before is None:
            return None  # a graph that comes up whole says nothing
        else:
            line = (
                f"disaggregation restored: {len(view.workers[PREFILL])} prefill and "
                f"{len(view.workers[DECODE])} decode worker(s)"
            )
        logger.warning("maru frontend: %s", line)
        return line

    def poll(self) -> None:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                health = json.loads(resp.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
            return  # not up yet, or restarting
        self.observe(RoleView.from_health(health))

    def start(self) -> RoleLog:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self.poll()

        self._thread = threading.Thread(target=loop, name="maru-role-log", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
