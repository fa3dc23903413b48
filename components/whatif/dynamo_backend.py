"""Replay one configuration on Dynamo's offline replay (real Rust KV router + mocker engines).

`round-robin`, `kv-gpu` and `kv-host` run here as Dynamo ships them. `kv-pool` is Dynamo's
``native_host_offload`` with ``scope: "cluster_shared"``; in Dynamo 1.6.1 that replay aborts
("failed to apply replay KV event ... removed ...: Failed to find block") once GPUs evict
(see `maru_dynamo.components.whatif` for what was narrowed down). The runner counts such a run
in ``failed_runs`` and `pool_model` answers for the pool instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

from maru_dynamo.components.whatif.spec import KV_GPU, KV_HOST, KV_POOL, ROUND_ROBIN, ClusterSpec, RunResult

log = logging.getLogger(__name__)


def quiet_dynamo_logs() -> None:
    """Before Dynamo is first imported: its Rust side logs every routing decision at INFO, and a
    replay of thousands of requests would print thousands of lines. A user's own DYN_LOG wins.
    Called only where a replay runs, so other maru-dynamo commands keep Dynamo's defaults."""
    os.environ.setdefault("DYN_LOG", "error")


KV_LAYOUT_ID = "maru-whatif"


def engine_args(spec: ClusterSpec, config: str, workers: int) -> dict[str, Any]:
    """Dynamo mocker engine arguments for `config` (the ``extra_engine_args`` of run_trace_replay)."""
    engine: dict[str, Any] = {
        "num_gpu_blocks": spec.gpu_blocks,
        "block_size": spec.block_size,
        "enable_prefix_caching": True,
        "kv_cache_bytes_per_token": spec.kv_bytes_per_token,
    }
    if spec.prefill_speedup != 1.0:
        engine["speedup_ratio"] = spec.prefill_speedup
        engine["decode_speedup_ratio"] = 1.0 / spec.prefill_speedup
    if config == KV_HOST:
        engine["native_host_offload"] = {
            "num_host_blocks": spec.host_blocks_per_worker(workers),
            "scope": "dp_rank_local",
            "h2d_bandwidth_gbps": spec.pool_gbps,
            "d2h_bandwidth_gbps": spec.pool_gbps,
        }
    elif config == KV_POOL:
        engine["native_host_offload"] = {
            "num_host_blocks": spec.pool_blocks,
            "scope": "cluster_shared",
            "kv_layout_id": KV_LAYOUT_ID,
            "h2d_bandwidth_gbps": spec.pool_gbps,
            "d2h_bandwidth_gbps": spec.pool_gbps,
            "shared_h2d_bandwidth_gbps": spec.pool_aggregate_gbps,
            "shared_d2h_bandwidth_gbps": spec.pool_aggregate_gbps,
        }
    return {"engine": engine}


def replay(trace_path: str, spec: ClusterSpec, config: str, workers: int) -> RunResult:
    """Replay the trace at `trace_path`; raises RuntimeError with Dynamo's one-line reason on failure."""
    quiet_dynamo_logs()
    from dynamo._core import KvRouterConfig
    from dynamo.replay import run_trace_replay

    router_mode: Literal["round_robin", "kv_router"] = "round_robin" if config == ROUND_ROBIN else "kv_router"
    router_config = (
        KvRouterConfig(host_cache_hit_weight=spec.host_weight) if config in (KV_GPU, KV_HOST, KV_POOL) else None
    )
    try:
        report = run_trace_replay(
            trace_path,
            extra_engine_args=engine_args(spec, config, workers),
            router_config=router_config,
            num_workers=workers,
            router_mode=router_mode,
            trace_block_size=spec.trace_block_size,
            arrival_speedup_ratio=spec.arrival_speedup,
        )
    except Exception as exc:  # Dynamo raises plain Exception/ValueError from Rust
        raise RuntimeError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    s = report.summary
    return RunResult(
        ttft_p50_ms=float(s["median_ttft_ms"]),
        ttft_p90_ms=float(s["p90_ttft_ms"]),
        prefill_tokens=int(s["committed_prefill_tokens"]),
        input_tokens=int(s["total_input_tokens"]),
        output_tokens_per_s=float(s["output_throughput_tok_s"]),
    )
