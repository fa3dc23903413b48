"""Routing comparison on the tiny model: pool-aware KV routing vs. round-robin and GPU-only KV routing.

Runs `benchmarks/routing_comparison.py` (three stacks one after another, ~1 min each here) on
the prefix-sharing workload of `maru_vllm.workload` and asserts the issue's claims, on token
counts only (deterministic; wall-clock times on this shared 2-core machine are not):

* KV routing with the pool's events computes fewer prefill tokens than round-robin and than KV
  routing on the engines' own events;
* its requests-per-worker spread (max - min) is at most GPU-only KV routing's;
* it loads tokens from the pool.

Measured here (the benchmark's docstring says why): with one request at a time only the
round-robin claim holds. kv-pool and kv-gpu both compute 3840 tokens (round-robin 4736), kv-pool
loads nothing from the pool, and the two spreads are set by Dynamo's tie-break between the
workers' random instance ids (15/0 or 6/9, either way round from run to run). The assertions
stay as the issue states them, so this test fails until that changes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from maru_vllm.workload import WorkloadSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

# Five sessions on two workers (an odd count: with an even one, round-robin over a turn-by-turn
# order pins every session to one worker by accident and becomes session affinity), two system
# prompts, three turns: 15 requests, one at a time (the deterministic mode of the benchmark).
SPEC = WorkloadSpec(systems=2, sessions=5, turns=3, system_tokens=640, user_tokens=96, assistant_tokens=64, seed=0)
WINDOW = 1


def load_benchmark():
    path = ROOT / "benchmarks" / "routing_comparison.py"
    spec = importlib.util.spec_from_file_location("routing_comparison", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(1200)
def test_pool_aware_routing_computes_least_prefill(tiny_model: Path, tmp_path: Path) -> None:
    rc = load_benchmark()
    results = rc.run_comparison(SPEC, model=str(tiny_model), work_dir=tmp_path, window=WINDOW, settle_s=0.5)
    print("\n" + rc.format_table(results))
    for r in results:
        print(rc.format_routes(r))
    by = {r.config.name: r for r in results}
    rr, gpu, pool = by["round-robin"], by["kv-gpu"], by["kv-pool"]

    for r in results:
        assert all(req.worker is not None for req in r.requests), r.config.name
        assert sum(r.requests_per_worker) == len(r.requests) == SPEC.sessions * SPEC.turns
        assert r.prefill_computed == r.metrics_computed, r.config.name  # usage and counters agree

    # The claims, all checked and reported together.
    failed = [claim for claim, holds in [
        (f"kv-pool loads from the pool ({pool.pool_loaded_tokens} tokens)", pool.pool_loaded_tokens > 0),
        (f"kv-pool computes fewer prefill tokens than round-robin ({pool.prefill_computed} < {rr.prefill_computed})",
         pool.prefill_computed < rr.prefill_computed),
        (f"kv-pool computes fewer prefill tokens than kv-gpu ({pool.prefill_computed} < {gpu.prefill_computed})",
         pool.prefill_computed < gpu.prefill_computed),
        (f"kv-pool spreads requests at least as evenly as kv-gpu ({pool.requests_per_worker} vs. "
         f"{gpu.requests_per_worker})", pool.spread <= gpu.spread),
    ] if not holds]
    assert not failed, "claims that do not hold:\n  " + "\n  ".join(failed) + "\n" + rc.format_table(results)
