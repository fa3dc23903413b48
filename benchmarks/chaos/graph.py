"""What the soak reads from a running graph: its processes by name, the frontend's workers, the
pool's stats, and pinned probe requests that tell whether a worker serves and the pool is hit.

The graph itself is `graphs/run.py`'s (build_plan / start_graph / stop_graph); this module only
looks at it. Processes are looked up by name at every call, because supervision may replace a
dead one with a new process.
"""

from __future__ import annotations

import socket
import time
import urllib.error
from typing import Any

from maru_dynamo.components.disagg.view import RoleView
from maru_dynamo.graphs.client import completions, get_json
from maru_dynamo.graphs.plan import Plan, instance_file
from maru_vllm.launch import ManagedProcess, ProcessGroup
from maru_vllm.launch.lifecycle import read_instance_file
from maru_vllm.pool import PoolClient, PoolError

POOL, NATS, FRONTEND = "pool", "nats-server", "frontend"


class GraphView:
    def __init__(self, plan: Plan, group: ProcessGroup) -> None:
        self.plan, self.group = plan, group
        pool_argv = next(p.argv for p in plan.processes if p.name == POOL)
        self.pool_address = pool_argv[pool_argv.index("--listen") + 1]
        nats = next((p.argv for p in plan.processes if p.name == NATS), None)
        self.nats_port = int(nats[nats.index("-p") + 1]) if nats else None
        self.worker_names = [p.name for p in plan.workers]
        self.disaggregated = plan.spec.mode == "disagg"
        self._probe_seq = 0

    # -- processes -------------------------------------------------------------------------------
    def process(self, name: str) -> ManagedProcess | None:
        """The newest process of that name in the group (a restart may have added another)."""
        found = [p for p in self.group.processes if p.name == name]
        return found[-1] if found else None

    def pid(self, name: str) -> int | None:
        proc = self.process(name)
        if proc is None or proc.proc is None or proc.proc.poll() is not None:
            return None
        return proc.proc.pid

    def names(self) -> list[str]:
        return list(dict.fromkeys(p.name for p in self.group.processes))

    def instance_of(self, name: str) -> int | None:
        """The Dynamo instance id worker `name` registered last (it records it as it registers)."""
        return read_instance_file(instance_file(self.plan.work_dir, name))

    # -- frontend --------------------------------------------------------------------------------
    def _generate_rows(self) -> list[dict[str, Any]]:
        try:
            health = get_json(f"{self.plan.url}/health", timeout=3)
        except (urllib.error.URLError, OSError, ValueError):
            return []
        rows = health.get("instances") if isinstance(health, dict) else None
        return [r for r in rows or [] if isinstance(r, dict) and r.get("endpoint") == "generate" and "instance_id" in r]

    def instances(self) -> list[int]:
        """Instance ids of the workers the frontend routes to (its /health)."""
        return sorted({int(r["instance_id"]) for r in self._generate_rows()})

    def role_view(self) -> RoleView:
        """The graph's roles as the frontend lists them (`maru_dynamo.components.disagg.view`)."""
        try:
            return RoleView.from_health(get_json(f"{self.plan.url}/health", timeout=3))
        except (urllib.error.URLError, OSError, ValueError):
            return RoleView.from_health({})

    def serving_instances(self) -> list[int]:
        """The instances a request can be pinned to (`backend_instance_id`): every worker of an
        aggregated graph, the decode role's of a disaggregated one."""
        return sorted(self.role_view().workers["decode"]) if self.disaggregated else self.instances()

    def stand_in(self) -> bool:
        """Whether a worker stands in for a lost role now (a disaggregated graph that lost one)."""
        return (self.role_view().state() or "").endswith("degraded")

    def disaggregated_again(self) -> bool:
        """Both roles have workers of their own."""
        return self.role_view().state() == "disaggregated"

    def ask(self, prompt: list[int], instance: int | None, timeout: float = 30.0) -> dict[str, Any] | None:
        """One short greedy completion (pinned to `instance` when given); None when it fails."""
        body: dict[str, Any] = {"model": self.plan.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        if instance is not None:
            body["nvext"] = {"backend_instance_id": instance}
        try:
            out = completions(self.plan.url, body, timeout=timeout)
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return out if isinstance(out, dict) and out.get("choices") else None

    def probe_prompt(self, tokens: int) -> list[int]:
        """A prompt no request asked before (ids outside the load's printable range)."""
        self._probe_seq += 1
        head = [1 + (self._probe_seq // 30) % 30, 1 + self._probe_seq % 30]
        return head + [(7 * i + self._probe_seq) % 30 + 1 for i in range(tokens - 2)]

    # -- pool ------------------------------------------------------------------------------------
    def pool_stats(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """The pool's stats op (`maru-dynamo pool status`), or None when it does not answer."""
        try:
            with PoolClient.connect(self.pool_address, timeout=timeout, heartbeat=False) as client:
                return client.stats()
        except (PoolError, OSError):
            return None

    def nats_accepts(self) -> bool:
        if self.nats_port is None:
            return True
        try:
            with socket.create_connection(("127.0.0.1", self.nats_port), timeout=1):
                return True
        except OSError:
            return False


def cached_tokens(out: dict[str, Any]) -> int:
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def wait_for(check: Any, timeout: float, poll_s: float = 0.5) -> float | None:
    """Seconds until `check()` is truthy, or None after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(poll_s)
    return None
