"""Routing comparison on the tiny model: pool-aware KV routing vs. round-robin and GPU-only KV routing.

Runs `benchmarks/routing_comparison.py` (four stacks one after another, ~1 min each here) on its
default workload: two system prompts, one popular (six of seven sessions) and one niche, three
turns per session, 21 requests sent in a fixed order with two earlier requests still decoding
at every routing decision (the router's load signal). Only token counts and placements are
checked (wall-clock times on this shared 2-core machine are not):

* KV routing with the pool's events computes fewer prefill tokens than round-robin and than KV
  routing on the engines' own (GPU) events over plain workers, and spreads requests at least as
  evenly as GPU-only KV routing;
* the same holds against the ablation `kv-gpu+pool` (Maru workers that load from the pool, router
  not told about it): the pool alone saves tokens, the pool's events are what balance the load;
* round-robin, which ignores prefixes, still avoids recomputation by loading from the pool, and
  the plain workers load nothing.

Placements are deterministic up to which worker wins the first tie (the router's tie-break
between random instance ids); every figure asserted is symmetric in the two workers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark():
    path = ROOT / "benchmarks" / "routing_comparison.py"
    spec = importlib.util.spec_from_file_location("routing_comparison", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(1500)
def test_pool_aware_routing_computes_least_prefill_and_balances(tiny_model: Path, tmp_path: Path) -> None:
    rc = load_benchmark()
    spec, window = rc.DEFAULT_SPEC, rc.DEFAULT_WINDOW
    results = rc.run_comparison(spec, model=str(tiny_model), work_dir=tmp_path, window=window, settle_s=0.5)
    table = rc.format_table(results, rc.build_workload(spec))
    print("\n" + table)
    for r in results:
        print(rc.format_routes(r))
    by = {r.config.name: r for r in results}
    rr, gpu, gpu_pool, pool = by["round-robin"], by["kv-gpu"], by["kv-gpu+pool"], by["kv-pool"]

    for r in results:
        assert all(req.worker is not None for req in r.requests), r.config.name
        assert sum(r.requests_per_worker) == len(r.requests) == spec.sessions * spec.turns
        assert r.prefill_computed == r.metrics_computed, r.config.name  # usage and counters agree

    # The claims: fewer prefill tokens than both, a spread at least as even as GPU-only KV routing.
    assert pool.prefill_computed < rr.prefill_computed, table
    assert pool.prefill_computed < gpu.prefill_computed, table
    assert pool.spread <= gpu.spread, table
    # Against KV routing that does not see the pool the workers load from.
    assert pool.prefill_computed <= gpu_pool.prefill_computed, table
    assert pool.spread <= gpu_pool.spread, table
    # Where the tokens come from.
    assert pool.pool_loaded_tokens > 0 and rr.pool_loaded_tokens > 0, table
    assert gpu.pool_loaded_tokens == 0, table
