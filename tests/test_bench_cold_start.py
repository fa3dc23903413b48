"""benchmarks/bench_cold_start.py without a graph: its percentiles, prompts, configurations, arguments."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_cold_start  # noqa: E402 - benchmarks/ is not a package


def test_percentiles_are_nearest_rank() -> None:
    burst = bench_cold_start.Burst("b", tuple(float(i) for i in range(1, 101)), 1.0)
    assert (burst.pct(50), burst.pct(90), burst.pct(99), burst.pct(100)) == (50.0, 90.0, 99.0, 100.0)
    one = bench_cold_start.Burst("b", (0.25,), 1.0)
    assert one.pct(50) == one.pct(99) == 0.25


def test_the_warm_burst_never_repeats_a_prompt_of_the_first() -> None:
    first = bench_cold_start.prompts(1001, 96, 64, 1024)
    warm = bench_cold_start.prompts(1002, 96, 64, 1024)
    assert len(set(first)) == 96 and not set(first) & set(warm)
    assert all(64 <= len(p) <= 1024 for p in first + warm)


def test_the_comparison_graph_turns_the_warmup_off_on_every_worker() -> None:
    graph = str(REPO / "graphs" / "agg.yaml")
    on = bench_cold_start.graph_spec(graph, warmup=True)
    off = bench_cold_start.graph_spec(graph, warmup=False)
    assert all(bench_cold_start.WARMUP_OFF not in w.args for w in on.workers)
    assert off.workers and all(w.args[-1] == bench_cold_start.WARMUP_OFF for w in off.workers)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--requests", "0"], "--requests=0 must be >= 1"),
        (["--min-len", "900", "--max-len", "100"], "--min-len=900 is above --max-len=100"),
    ],
)
def test_bad_arguments_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_cold_start.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
