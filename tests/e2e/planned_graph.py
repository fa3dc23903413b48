"""A graph started in-process through `graphs/run.py`, for e2e tests that need its processes.

`graph run` (tests/e2e/test_graph_run.py and its neighbours) is how a user starts a graph; tests
that stop, restart or replace single processes, read one process's log or add a late joiner
start the same plan in their own `ProcessGroup` instead: `build_plan` plans it from the same
graph format, `start_graph` starts it and waits until the frontend serves every worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from maru_dynamo.graphs import plan as graph_plan
from maru_dynamo.graphs import run as graph_run
from maru_dynamo.graphs.spec import load_graph, parse_graph
from maru_vllm.launch import ManagedProcess, ProcessGroup

READY_TIMEOUT_S = 400.0  # engines start in ~20 s each, slower while other engines compile


def plan(graph: Mapping[str, Any] | Path, model: Path, work_dir: Path) -> graph_plan.Plan:
    """The plan of `graph` (a graph file, or the graph format as a dict) on `model`, its files
    in `work_dir`."""
    spec = load_graph(graph) if isinstance(graph, Path) else parse_graph(dict(graph), source="test")
    return graph_plan.build_plan(spec, model=str(model), work_dir=work_dir)


class StartedGraph:
    """A started plan: its processes by name, its URL, its pools' addresses."""

    def __init__(self, plan: graph_plan.Plan, group: ProcessGroup) -> None:
        self.plan, self.group = plan, group

    @property
    def url(self) -> str:
        return self.plan.url

    @property
    def model(self) -> str:
        return self.plan.model

    def __getitem__(self, name: str) -> ManagedProcess:
        """The running process `name` (its latest one, if it was started again)."""
        for proc in reversed(self.group.processes):
            if proc.name == name:
                return proc
        raise KeyError(f"no process {name!r}; started: {', '.join(p.name for p in self.group.processes)}")

    def pool_address(self, domain: str | None = None) -> str:
        return self.plan.pool_addresses[domain]

    def env(self) -> dict[str, str]:
        """The environment the graph's frontend runs with (its discovery and NATS): for a
        `router_probe` or any other client process of the graph."""
        return dict(self.plan.process("frontend").env)

    def start(self, planned: str, /, **changes: Any) -> ManagedProcess:
        """Start planned process `planned` (held back, or stopped), with `changes` to its plan
        (`argv=...`, `env=...`, `name=...` for a stand-in beside the planned one's log)."""
        p = dataclasses.replace(self.plan.process(planned), **changes)
        return graph_run.start_process(self.plan, p, self.group)


def start(
    plan: graph_plan.Plan,
    group: ProcessGroup,
    *,
    hold: Collection[str] = (),
    wait: bool = True,
    timeout: float = READY_TIMEOUT_S,
) -> StartedGraph:
    """Start every process of `plan` but those in `hold` into `group`, in the plan's order (each
    after the previous one's ready line); with `wait`, return once the frontend lists the model
    and every started worker."""
    missing = set(hold) - {p.name for p in plan.processes}
    assert not missing, f"hold names no planned process: {sorted(missing)}"
    now = dataclasses.replace(plan, processes=tuple(p for p in plan.processes if p.name not in hold))
    if wait:
        graph_run.start_graph(now, group, timeout=timeout)
    else:
        for p in now.processes:
            graph_run.start_process(now, p, group)
    return StartedGraph(plan, group)
