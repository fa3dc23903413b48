"""benchmarks/tier2_credit.py without a graph: the graphs it runs, and how it counts decisions."""

from __future__ import annotations

import os
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tier2_credit.py"
sys.path.insert(0, str(SCRIPT.parent))

import routing_comparison as rc  # noqa: E402 - benchmarks/ is not a package
import tier2_credit as tc  # noqa: E402
from maru_dynamo.graphs import plan as graph_plan  # noqa: E402
from maru_dynamo.graphs.spec import parse_graph  # noqa: E402


def test_each_setting_is_the_domains_graph_with_credit_on_or_off_in_every_worker(tmp_path: Path) -> None:
    for credit in (False, True):
        spec = parse_graph(tc.graph("credit-x", "nats://127.0.0.1:4222", credit=credit, window=3))
        plan = graph_plan.build_plan(spec, model="m", work_dir=tmp_path / str(credit), pin_workers=True)
        names = [p.name for p in plan.processes]
        assert "mooncake-master" in names and "nats-server" not in names  # the benchmark's shared nats-server
        assert sum(1 for n in names if n.startswith("pool")) == 2, names  # a pool per domain
        assert [w.cpus for w in plan.workers] == [(0,), (1 % (os.cpu_count() or 1),)]
        assert all(w.env.get("MARU_TIER2_CREDIT") == ("1" if credit else "0") for w in plan.workers)


def _result(workers: list[int], lines: list[str] | None = None) -> rc.ConfigResult:
    cfg = rc.RoutingConfig("x", "kv", True, True, "")
    reqs = [rc.RequestRecord(i, 0, 0, 100, 50, w, (lines or [""] * len(workers))[i]) for i, w in enumerate(workers)]
    return rc.ConfigResult(cfg, None, reqs, [])


def test_decisions_off_vs_on_count_only_beyond_the_noise_floor() -> None:
    off1, on1, off2, on2 = [0, 1, 0, 1], [0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 1]
    cmp = tc.Comparison([("off", _result(off1)), ("on", _result(on1)), ("off", _result(off2)), ("on", _result(on2))])
    assert cmp.noise == 1  # off vs off: one tie fell the other way
    assert cmp.effect == (1 + 1 + 2 + 2) / 4
    assert cmp.changes_routing
    same = tc.Comparison([("off", _result(off1)), ("on", _result(off1)), ("off", _result(off2)), ("on", _result(off2))])
    assert not same.changes_routing  # off vs on differ only as much as two runs of one setting
    mirrored = [1 - w for w in on1]  # the first tie fell the other way: the same routing, workers renamed
    assert tc.differing(_result(on1), _result(mirrored)) == 0
    assert tc.differing(_result(off1), _result(mirrored)) == 1


def test_disk_credit_is_read_from_the_selected_worker_line() -> None:
    line = 'Selected worker router_mode="kv" worker_id=7 dp_rank=0 logit=0.5 host_pinned_blocks=2 disk_blocks=6'
    assert tc.disk_credited(line)
    assert not tc.disk_credited(line.replace("disk_blocks=6", "disk_blocks=2"))
    assert not tc.disk_credited("")
