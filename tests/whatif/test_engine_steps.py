"""The pool model's engines: measured engine times in place of the mocker's, and vLLM-style steps
that pack prompt chunks up to the step's token budget."""

from __future__ import annotations

import pytest

from maru_dynamo.components.whatif import pool_model
from maru_dynamo.components.whatif.spec import KV_GPU, ClusterSpec
from maru_dynamo.components.whatif.timing import mocker_timing
from maru_dynamo.components.whatif.trace import TraceRequest

# A linear engine: 10 ms per step plus 0.1 ms per prompt token; decode steps too short to matter.
PREFILL = ((16, 11.6), (4096, 419.6), (8192, 829.2))
DECODE = ((512, 0.001), (65536, 0.001))


def _spec(step_tokens: int) -> ClusterSpec:
    return ClusterSpec(
        kv_bytes_per_token=1024,
        block_size=16,
        gpu_blocks=4096,
        trace_block_size=16,
        engine_prefill_points=PREFILL,
        engine_decode_points=DECODE,
        step_tokens=step_tokens,
    )


def test_measured_engine_times_replace_the_mockers() -> None:
    timing = mocker_timing(_spec(2048))
    assert timing.prefill_points == PREFILL
    assert timing.decode_points == DECODE
    assert timing.prefill_ms(2048) == pytest.approx(10 + 204.8, rel=1e-3)


def _ttfts(step_tokens: int) -> list[float]:
    # A 1000-token prompt alone at t=0, then two more arriving at t=1 ms, while its step runs (one
    # output token each): A's step ends at 110 ms; B and C wait for the next step.
    def req(i: int, t: float) -> TraceRequest:
        return TraceRequest(t, 1000, 1, tuple(range(i * 63, i * 63 + 63)))

    spec = _spec(step_tokens)
    model = pool_model.PoolModel(spec, KV_GPU, 1, mocker_timing(spec))
    model.run([req(0, 0.0), req(1, 1.0), req(2, 1.0)])
    return [t + a for t, a in zip(sorted(model.ttfts), (0.0, 1.0, 1.0))]  # first-token times


def test_a_step_packs_prompts_up_to_its_token_budget() -> None:
    # budget 4096: B and C in one step after A's, both first tokens at its end
    assert _ttfts(4096) == pytest.approx([110.0, 320.0, 320.0], rel=1e-3)
    # budget 1000: one prompt a step, in order of arrival
    assert _ttfts(1000) == pytest.approx([110.0, 220.0, 330.0], rel=1e-3)
    # budget 1500: B and half of C, then the rest of C
    assert _ttfts(1500) == pytest.approx([110.0, 270.0, 330.0], rel=1e-3)
