"""A disaggregated graph's roles as a frontend sees them, from its `/health`.

Dynamo's frontend lists in `/health` every instance of every endpoint it knows, by component and
endpoint. Every disaggregated Maru worker serves `maru_watch` on its own role's component
(`prefill` or `backend`), so those ids are the role's workers. Every worker also serves the other
role's `generate` (its forwarding stand-in, `maru_dynamo.components.disagg.standby`), so the `generate` lists
alone do not say which roles have workers. So:

* a role is degraded while workers of the other role are listed and none of its own is;
* the graph is disaggregated while both roles have workers.

A dead worker stays listed until discovery drops it. The frontend's log (`frontend_log`), the e2e
tests and the chaos soak read the graph's state from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maru_dynamo.components.disagg.roles import COMPONENT, DECODE, GENERATE, PREFILL, WATCH


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
        """Workers of the other role that serve `role` now."""
        other = DECODE if role == PREFILL else PREFILL
        return self.workers[other] if not self.workers[role] else frozenset()

    def state(self) -> str | None:
        """'disaggregated', 'prefill degraded', 'decode degraded', or None (no disaggregated graph)."""
        for role in (PREFILL, DECODE):
            if self.standing_in(role):
                return f"{role} degraded"
        if self.workers[PREFILL] and self.workers[DECODE]:
            return "disaggregated"
        return None
