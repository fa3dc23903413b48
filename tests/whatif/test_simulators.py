"""The pool model against Dynamo's offline replay and against the real stack's routing comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from maru_dynamo.components.whatif import pool_model
from maru_dynamo.components.whatif.runner import DYNAMO, MODEL, WhatIf
from maru_dynamo.components.whatif.spec import KV_GPU, KV_HOST, KV_POOL, ROUND_ROBIN, ClusterSpec
from maru_dynamo.components.whatif.timing import mocker_timing
from maru_dynamo.components.whatif.trace import read_trace, unique_prefix_tokens
from maru_dynamo.components.whatif.validation import (
    REAL_BLOCK_TOKENS,
    routing_comparison_trace,
    validation_itl_ms,
    validation_spec,
)

# The real stack's numbers are in the README's routing table (benchmarks/routing_comparison.py,
# --window 3): kv-gpu 11136 prefill tokens, kv-pool 9216 (the workload's prefix tree).
VALIDATION_SPEC = validation_spec()


@pytest.mark.parametrize("simulator", [MODEL, DYNAMO])
def test_routing_comparison_workload_keeps_the_real_stacks_order(simulator: str) -> None:
    """kv-pool <= kv-gpu and < round-robin in every run, as measured on the real two-worker stack."""
    requests = routing_comparison_trace(validation_itl_ms(VALIDATION_SPEC))
    tree = unique_prefix_tokens(requests, REAL_BLOCK_TOKENS)
    assert (len(requests), sum(r.input_length for r in requests), tree) == (21, 34944, 9216)
    with WhatIf(requests, VALIDATION_SPEC, simulator, repeats=3, progress=None) as whatif:
        rows = {c: whatif.one(c, 2) for c in (ROUND_ROBIN, KV_GPU, KV_POOL)}
    for row in rows.values():
        # Dynamo's shared tier runs here: nothing is evicted, so its replay does not abort.
        assert row.runs == 3 and row.failed_runs == 0
    assert rows[KV_POOL].prefill_tokens <= rows[KV_GPU].prefill_tokens
    assert rows[KV_POOL].prefill_tokens < rows[ROUND_ROBIN].prefill_tokens
    # Pool-aware routing computes exactly the prefix tree, as on the real stack (9216).
    assert rows[KV_POOL].prefill_tokens == tree


def test_pool_model_agrees_with_dynamos_replay_where_both_run(synthetic_trace: Path) -> None:
    """Medians of 7 runs each: both break routing ties at random, so one kv-gpu run of either swings ~2.5%.

    Medians of 7 stayed within 0.9% of each other over 20 trials; the 3% bound leaves room for that spread.
    """
    requests = read_trace(synthetic_trace, 512, 300)
    spec = ClusterSpec()
    with (
        WhatIf(requests, spec, MODEL, repeats=7, progress=None) as model,
        WhatIf(requests, spec, DYNAMO, repeats=7, progress=None) as dyn,
    ):
        for config in (ROUND_ROBIN, KV_GPU, KV_HOST):
            ours, theirs = model.one(config, 8), dyn.one(config, 8)
            assert abs(ours.prefill_tokens - theirs.prefill_tokens) <= 0.03 * theirs.prefill_tokens, config
            assert abs(ours.ttft_p90_ms - theirs.ttft_p90_ms) <= 0.15 * theirs.ttft_p90_ms, config


def test_pool_model_keeps_dynamos_radix_tree_consistent_under_eviction(synthetic_trace: Path) -> None:
    """Where Dynamo's shared-tier replay aborts (GPU eviction of onboarded blocks), the model's events all apply."""
    requests = read_trace(synthetic_trace, 512, 300)
    spec = ClusterSpec()
    gpu = pool_model.PoolModel(spec, KV_GPU, 8, mocker_timing(spec))
    gpu_result = gpu.run(requests)
    pool = pool_model.PoolModel(spec, KV_POOL, 8, mocker_timing(spec))
    pool_result = pool.run(requests)
    assert pool.device_index.removed_blocks > 0  # GPUs did evict
    assert pool.device_index.skipped == 0 and pool.host_index.skipped == 0
    assert pool_result.prefill_tokens < gpu_result.prefill_tokens


def test_pool_model_agrees_with_dynamos_shared_tier_where_that_runs(synthetic_trace: Path) -> None:
    """GPU caches large enough that nothing is evicted: Dynamo's cluster_shared replay runs, and agrees."""
    requests = read_trace(synthetic_trace, 512, 500)
    spec = ClusterSpec(gpu_blocks=40_000)
    with WhatIf(requests, spec, MODEL, progress=None) as model, WhatIf(requests, spec, DYNAMO, progress=None) as dyn:
        ours, theirs = model.one(KV_POOL, 8), dyn.one(KV_POOL, 8)
    assert theirs.failed_runs == 0
    assert abs(ours.prefill_tokens - theirs.prefill_tokens) <= 0.02 * theirs.prefill_tokens
    assert abs(ours.ttft_p90_ms - theirs.ttft_p90_ms) <= 0.15 * theirs.ttft_p90_ms
