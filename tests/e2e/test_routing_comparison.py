"""Routing comparison on the tiny model: pool-aware KV routing vs. round-robin and GPU-only KV routing.

Runs `benchmarks/routing_comparison.py` (three stacks one after another, ~1 min each here) on
the prefix-sharing workload of `maru_vllm.workload`, one request at a time, and checks token
counts only (deterministic; wall-clock times on this shared 2-core machine are not):

* KV routing with the pool's events computes fewer prefill tokens than round-robin, and never
  more than KV routing on the engines' own events;
* round-robin, which ignores prefixes, still avoids recomputation by loading from the pool.

What the issue asks beyond that does NOT hold in this mode, and the test prints it instead of
asserting it: with one request at a time Dynamo's router sees no load, sends every request to
the worker with the longest cached prefix, and a pool block (credited 0.75 of a device block)
never outweighs the device copy that the computing worker also holds - so kv-pool and kv-gpu
make the same choices (3840 computed tokens each here, round-robin 4736) and kv-pool loads
nothing; the per-worker spread is decided by Dynamo's tie-break between the workers' random
instance ids (15/0 or 6/9, either way round from run to run). Pool-aware routing can only change
decisions when requests are in flight (`--window` > 1 in the benchmark), which did not run to
completion on this loaded 2-core machine.
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

    assert pool.prefill_computed < rr.prefill_computed, rc.format_table(results)
    assert pool.prefill_computed <= gpu.prefill_computed, rc.format_table(results)
    assert rr.pool_loaded_tokens > 0, rc.format_table(results)
    # Reported, not asserted (see the module docstring): the stronger claims.
    print(f"kv-pool vs kv-gpu prefill computed: {pool.prefill_computed} vs {gpu.prefill_computed}; "
          f"kv-pool pool-loaded tokens: {pool.pool_loaded_tokens}; requests per worker: kv-pool "
          f"{pool.requests_per_worker}, kv-gpu {gpu.requests_per_worker}")
