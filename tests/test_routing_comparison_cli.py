"""The routing comparison's command line refuses bad values before it starts anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "routing_comparison.py"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--window", "0"], "--window must be >= 1 (requests in flight at each routing decision), got 0"),
        (["--hot-sessions", "9"], "WorkloadSpec.hot_sessions must be between 0 and sessions (7), got 9"),
        (["--sessions", "1", "--hot-sessions", "0"], "1 sessions (0 of them hot) cannot cover 2 system prompts"),
        (
            ["--configs", "kv-gpu,bogus"],
            "unknown configs: bogus (choose from round-robin, kv-gpu, kv-gpu+pool, kv-pool)",
        ),
    ],
)
def test_bad_values_are_named_with_what_is_allowed(args: list[str], message: str) -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr, res.stderr


def test_every_configuration_is_a_graph_the_runner_plans(tmp_path: Path) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    import routing_comparison as rc
    from maru_dynamo.graphs import plan as graph_plan
    from maru_dynamo.graphs.spec import parse_graph

    for config in rc.CONFIGS:
        spec = parse_graph(rc.graph_spec(config, "nats://127.0.0.1:4222", window=3))
        plan = graph_plan.build_plan(spec, model="m", work_dir=tmp_path / spec.name, pin_workers=True)
        assert not any(p.name == "nats-server" for p in plan.processes)  # the comparison's shared one
        assert any(p.name == "pool" for p in plan.processes) == config.pool  # plain workers: no pool at all
        assert [w.cpus for w in plan.workers] == [(0,), (1 % (os.cpu_count() or 1),)]  # one core each, any machine
        workers = plan.workers
        assert len(workers) == 2 and all(w.metrics_url for w in workers), workers
        argv = [" ".join(w.argv) for w in workers]
        assert all(("maru_worker" in a) == config.pool for a in argv), argv
        assert all(("--no-maru-pool-events" in a) == (config.pool and not config.pool_events) for a in argv)
        assert all("--stream-interval 256" in a for a in argv)
