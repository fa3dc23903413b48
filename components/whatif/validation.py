"""The README's routing-comparison workload as a Mooncake trace, to check the simulators against the real stack.

`benchmarks/routing_comparison.py` runs `maru_vllm.fixtures.workload` (two system prompts, one popular,
multi-turn sessions) on two real workers with ``--window 3``: every request is routed after the
previous one's prefill, while the two before it still decode. As a trace: one hash id per
``block_tokens`` tokens of each prompt (equal prefixes, equal ids; the partial last block gets an
id of its own), arrivals ``gap_ms`` apart, and an output long enough that each request decodes
through the next two arrivals and ends before the third.
"""

from __future__ import annotations

from maru_dynamo.components.whatif.spec import ClusterSpec
from maru_dynamo.components.whatif.trace import TraceRequest
from maru_vllm.fixtures.workload import Workload, WorkloadSpec, build_workload

# The routing comparison's defaults (benchmarks/routing_comparison.py DEFAULT_SPEC / DEFAULT_WINDOW).
ROUTING_COMPARISON_SPEC = WorkloadSpec(
    systems=2, sessions=7, hot_sessions=4, turns=3, system_tokens=1024, user_tokens=256, assistant_tokens=128, seed=0
)
ROUTING_COMPARISON_WINDOW = 3
REAL_BLOCK_TOKENS = 128  # vLLM's block size in the real run


def workload_trace(
    workload: Workload,
    block_tokens: int = REAL_BLOCK_TOKENS,
    window: int = ROUTING_COMPARISON_WINDOW,
    gap_ms: int = 1000,
    itl_ms: float = 5.75,
) -> list[TraceRequest]:
    """`workload` as trace requests; `itl_ms` (the mocker's decode step) sizes the outputs to hold `window`."""
    ids: dict[tuple[int, ...], int] = {}
    out: list[TraceRequest] = []
    # Decode through the next window-1 arrivals, end half a gap before the window-th.
    output_tokens = max(1, int((window - 0.5) * gap_ms / itl_ms)) if window > 1 else 1
    for i, req in enumerate(workload):
        hashes = []
        for start in range(0, len(req.prompt), block_tokens):
            key = req.prompt[: start + block_tokens]
            hashes.append(ids.setdefault(key, len(ids)))
        out.append(TraceRequest(float(i * gap_ms), len(req.prompt), output_tokens, tuple(hashes)))
    return out


def routing_comparison_trace(itl_ms: float = 5.75) -> list[TraceRequest]:
    """The routing comparison's 21 requests; pass the simulated engine's decode step (`validation_itl_ms`)."""
    return workload_trace(build_workload(ROUTING_COMPARISON_SPEC), itl_ms=itl_ms)


def validation_spec() -> ClusterSpec:
    """Two workers as in the real run: vLLM's 128-token blocks, caches large enough that nothing is evicted."""
    return ClusterSpec(
        block_size=REAL_BLOCK_TOKENS, trace_block_size=REAL_BLOCK_TOKENS, gpu_blocks=4096, kv_bytes_per_token=4096
    )


def validation_itl_ms(spec: ClusterSpec) -> float:
    """The mocker's decode step with the window's requests in flight (sizes the outputs to hold the window)."""
    from maru_dynamo.components.whatif.timing import mocker_timing

    prompts = build_workload(ROUTING_COMPARISON_SPEC)
    mean_prompt = prompts.total_prompt_tokens / len(prompts)
    return mocker_timing(spec).itl_ms(int(ROUTING_COMPARISON_WINDOW * mean_prompt))
