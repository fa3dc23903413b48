"""The frontend's log of a disaggregated graph's roles: one line when a role is degraded, one when restored.

`RoleLog` reads the frontend's own `/health` every `interval_s` in a daemon thread: Dynamo lists
there every instance of every endpoint the frontend knows, by component and endpoint. Every
disaggregated Maru worker serves `maru_watch` on its own role's component (`prefill` or
`backend`), and a worker that stands in for the other role (`maru_vllm.disagg.standby`) also
serves that role's `generate` under the same instance id. So:

* the prefill role is degraded while a decode worker (an id of `backend/maru_watch`) is listed
  under `prefill/generate`: it stands in, which it does only while no prefill worker is live;
* the decode role is degraded while a prefill worker is listed under `backend/generate`;
* the graph is disaggregated while neither holds and both roles have workers.

Nothing is logged for a graph without stand-ins (aggregated, or `--no-maru-standby`), nor while
the frontend is not up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

from maru_vllm.disagg.roles import COMPONENT, DECODE, GENERATE, PREFILL, WATCH

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RoleView:
    generate: dict[str, frozenset[int]]  # role -> instance ids listed under its generate endpoint
    workers: dict[str, frozenset[int]]  # role -> ids of that role's workers (its maru_watch endpoint)

    @classmethod
    def from_health(cls, health: Any) -> RoleView:
        ids: dict[tuple[str, str], set[int]] = {(r, e): set() for r in COMPONENT for e in (GENERATE, WATCH)}
        component_role = {component: role for role, component in COMPONENT.items()}
        for inst in (health.get("instances") if isinstance(health, dict) else None) or []:
            if not isinstance(inst, dict) or not isinstance(inst.get("instance_id"), int):
                continue
            key = (component_role.get(str(inst.get("component")), ""), str(inst.get("endpoint")))
            if key in ids:
                ids[key].add(inst["instance_id"])
        return cls(
            {r: frozenset(ids[(r, GENERATE)]) for r in COMPONENT}, {r: frozenset(ids[(r, WATCH)]) for r in COMPONENT}
        )

    def standing_in(self, role: str) -> frozenset[int]:
        """Workers of the other role listed under `role`'s generate endpoint."""
        other = DECODE if role == PREFILL else PREFILL
        return self.generate[role] & self.workers[other]

    def state(self) -> str | None:
        """'disaggregated', 'prefill degraded', 'decode degraded', or None (no disaggregated graph)."""
        for role in (PREFILL, DECODE):
            if self.standing_in(role):
                return f"{role} degraded"
        if self.workers[PREFILL] and self.workers[DECODE]:
            return "disaggregated"
        return None


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
