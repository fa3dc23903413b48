"""`maru-dynamo whatif`: replay a Mooncake-format trace on simulated clusters with and without the pool."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from maru_dynamo.components.whatif import spec as S
from maru_dynamo.components.whatif.runner import DYNAMO, MODEL, SIMULATORS, SWEEP_METRICS, WhatIf, best_weights
from maru_dynamo.components.whatif.trace import TraceError, read_trace
from maru_vllm.routing import pool_tier_weight, validate_weight

DEFAULT_SWEEP = "0,0.25,0.5,0.6,0.7,0.8,0.9,0.95,0.97,1.0"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "whatif",
        help="replay a request trace on simulated clusters: round-robin, KV routing, host tiers, the shared pool",
        description="Replay a Mooncake-format trace (timestamp, input_length, output_length, hash_ids) for each "
        "worker count and configuration and print TTFT and prefill tokens computed. "
        f"Configs: {'; '.join(f'{k}: {v}' for k, v in S.CONFIG_HELP.items())}.",
    )
    p.add_argument("trace", help="Mooncake-format JSONL trace (e.g. ../shared/traces/mooncake_conversation.jsonl)")
    p.add_argument("--workers", default="4,8,16", help="worker counts, comma-separated (default 4,8,16)")
    p.add_argument(
        "--configs", default=",".join(S.CONFIGS), help=f"configurations (default all: {','.join(S.CONFIGS)})"
    )
    p.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash id (default 512)")
    p.add_argument(
        "--block-size", type=int, default=S.DEFAULT_BLOCK_SIZE, help="engine KV block size in tokens (default 64)"
    )
    p.add_argument(
        "--gpu-blocks", type=int, default=S.DEFAULT_GPU_BLOCKS, help="GPU KV-cache blocks per worker (default 2500)"
    )
    p.add_argument(
        "--pool-size", default="1T", help="pool size in bytes, e.g. 100G, 1T (default 1T); kv-host splits it evenly"
    )
    p.add_argument(
        "--pool-gbps",
        type=float,
        default=None,
        help=f"per-worker link bandwidth to the pool / host tier, GB/s (default {S.DEFAULT_POOL_GBPS:g}, "
        "or the calibration's load_gbps)",
    )
    p.add_argument(
        "--pool-aggregate-gbps",
        type=float,
        default=S.DEFAULT_POOL_AGGREGATE_GBPS,
        help=f"the pool's total bandwidth shared by all loads, GB/s (default {S.DEFAULT_POOL_AGGREGATE_GBPS:g})",
    )
    kv = p.add_mutually_exclusive_group()
    kv.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help=f"model KV bytes per token (default {S.DEFAULT_KV_BYTES_PER_TOKEN}: Qwen2.5-32B; or the calibration's)",
    )
    kv.add_argument(
        "--model", default=None, help="derive KV bytes per token from a local model directory or config.json"
    )
    p.add_argument(
        "--host-weight",
        default=None,
        help="router credit of a pool / host-tier block (default: maru_vllm.routing, $MARU_POOL_TIER_WEIGHT)",
    )
    p.add_argument(
        "--calibration",
        default=None,
        help="bench_connector.py calibration JSON: pool load GB/s and prefill tokens/s measured on your hardware",
    )
    p.add_argument("--repeats", type=int, default=1, help="replays per point; the median is reported (default 1)")
    p.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--arrival-speedup", type=float, default=1.0, help="divide inter-arrival times by this (default 1)")
    p.add_argument(
        "--simulator",
        choices=SIMULATORS,
        default=MODEL,
        help=f"'{MODEL}': the pool model on Dynamo's radix tree, router cost and mocker timing (all configs); "
        f"'{DYNAMO}': Dynamo's offline replay as shipped (its kv-pool aborts in 1.6.1). Default {MODEL}",
    )
    p.add_argument(
        "--sweep-weight",
        nargs="?",
        const=DEFAULT_SWEEP,
        default=None,
        metavar="W1,W2,...",
        help=f"replay kv-pool over router host weights and report the best (default weights {DEFAULT_SWEEP})",
    )
    p.add_argument(
        "--sweep-metric",
        choices=sorted(SWEEP_METRICS),
        default="ttft_p90",
        help="what --sweep-weight minimises (default ttft_p90)",
    )
    p.add_argument(
        "--domains",
        default=None,
        metavar="D1,D2,...",
        help="replay the two-level topology instead: D CXL domains of workers/D workers, a pool per domain "
        "(--pool-size each), with and without one tier-2 under them (configs kv-domains, kv-tier2; also "
        "kv-tier2-spill, kv-tier2-credit with --configs)",
    )
    p.add_argument("--tier2-size", default="1T", help="the tier-2's size (default 1T)")
    p.add_argument("--tier2-gbps", type=float, default=12.5, help="one tier-2 fetch's bandwidth, GB/s (default 12.5)")
    p.add_argument(
        "--tier2-visible-ms",
        type=float,
        default=500.0,
        help="from a prefill's end until its blocks are in the tier-2 for the other domains, ms (default 500)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw TTFT p50/p90 and prefill tokens vs workers")
    p.set_defaults(func=run_whatif)


def _fail(message: str) -> int:
    print(f"maru-dynamo whatif: error: {message}", file=sys.stderr)
    return 2


def _spec_from_args(args: argparse.Namespace) -> S.ClusterSpec:
    kvbpt = args.kv_bytes_per_token
    if args.model:
        kvbpt = S.kv_bytes_per_token_of_model(args.model)
    pool_gbps = args.pool_gbps
    weight = pool_tier_weight() if args.host_weight is None else validate_weight(args.host_weight, "--host-weight")
    base = dict(
        block_size=args.block_size,
        gpu_blocks=args.gpu_blocks,
        pool_bytes=S.parse_size(args.pool_size),
        pool_aggregate_gbps=args.pool_aggregate_gbps,
        host_weight=weight,
        trace_block_size=args.trace_block_size,
        arrival_speedup=args.arrival_speedup,
    )
    if args.calibration:
        from maru_dynamo.components.whatif.timing import mocker_prefill_tokens_per_s
        from maru_vllm.fixtures.calibration import read_calibration

        cal = read_calibration(args.calibration)
        kvbpt = kvbpt or cal.kv_bytes_per_token
        pool_gbps = pool_gbps or cal.load_gbps
        spec = S.ClusterSpec(
            kv_bytes_per_token=kvbpt,
            pool_gbps=pool_gbps,
            engine_prefill_points=tuple(map(tuple, cal.prefill_points)) if cal.prefill_points else None,  # type: ignore[arg-type]
            engine_decode_points=tuple(map(tuple, cal.decode_points)) if cal.decode_points else None,  # type: ignore[arg-type]
            **({"step_tokens": cal.step_tokens} if cal.step_tokens else {}),
            **base,
        )
        if spec.engine_prefill_points and spec.engine_decode_points and args.simulator == MODEL:
            return spec  # the engine's own times: nothing of the mocker's is used
        # The mocker's own prefill speed scaled to the measured one (decode keeps the mocker's).
        return dataclasses.replace(spec, prefill_speedup=cal.prefill_tokens_per_s / mocker_prefill_tokens_per_s(spec))
    return S.ClusterSpec(
        kv_bytes_per_token=kvbpt or S.DEFAULT_KV_BYTES_PER_TOKEN, pool_gbps=pool_gbps or S.DEFAULT_POOL_GBPS, **base
    )


def run_domains(args: argparse.Namespace) -> int:
    import json

    from maru_dynamo.components.whatif import domains as D
    from maru_dynamo.components.whatif.timing import mocker_timing

    try:
        workers = S.parse_workers(args.workers)
        try:
            domains = S.parse_workers(args.domains)
        except ValueError:
            raise ValueError(f"--domains {args.domains!r}: give domain counts like 2,4,8") from None
        configs = (D.KV_DOMAINS, D.KV_TIER2) if args.configs == ",".join(S.CONFIGS) else tuple(args.configs.split(","))
        for c in configs:
            if c not in D.DOMAIN_CONFIGS:
                raise ValueError(f"unknown config {c!r} with --domains: use {', '.join(D.DOMAIN_CONFIGS)}")
        if not args.tier2_gbps > 0 or not args.tier2_visible_ms >= 0:
            raise ValueError("--tier2-gbps must be > 0 and --tier2-visible-ms >= 0")
        tier2 = D.Tier2Spec(bytes=S.parse_size(args.tier2_size), gbps=args.tier2_gbps, visible_ms=args.tier2_visible_ms)
        spec = _spec_from_args(args)
        requests = read_trace(args.trace, args.trace_block_size, args.requests)
    except (ValueError, TraceError) as exc:
        return _fail(str(exc))
    rows = D.domain_table(requests, spec, mocker_timing(spec), workers, domains, configs, tier2)
    if args.json:
        print(json.dumps({"trace": args.trace, "requests": len(requests), "rows": rows}, indent=2))
    else:
        print(
            f"trace {args.trace}: {len(requests)} requests; a pool of {spec.pool_bytes / 1e9:g} GB per domain, "
            f"tier-2 {tier2.bytes / 1e9:g} GB at {tier2.gbps:g} GB/s per fetch, visible after {tier2.visible_ms:g} ms"
        )
        print(D.format_domain_table(rows))
    return 0


def run_whatif(args: argparse.Namespace) -> int:
    if args.domains is not None:
        return run_domains(args)
    try:
        workers = S.parse_workers(args.workers)
        configs = S.parse_configs(args.configs)
        if args.requests is not None and args.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {args.requests}")
        weights = None
        if args.sweep_weight is not None:
            weights = [validate_weight(x.strip(), "--sweep-weight") for x in args.sweep_weight.split(",") if x.strip()]
            if not weights:
                raise ValueError("--sweep-weight: give weights like 0.5,0.9,1.0")
        spec = _spec_from_args(args)
        requests = read_trace(args.trace, args.trace_block_size, args.requests)
    except (ValueError, TraceError) as exc:
        return _fail(str(exc))
    with WhatIf(requests, spec, args.simulator, args.repeats) as whatif:
        if weights is not None:
            rows = whatif.sweep(weights, workers)
            best = best_weights(rows, args.sweep_metric)
        else:
            rows = whatif.run(configs, workers)
            best = None
    from maru_dynamo.components.whatif import report

    if args.json:
        print(report.json_document(args.trace, len(requests), rows, sweep=weights is not None, best=best))
    else:
        print(
            f"trace {args.trace}: {len(requests)} requests, {whatif.input_tokens:,} input tokens; "
            f"simulator {args.simulator}; "
            f"pool {spec.pool_bytes / 1e9:g} GB = {spec.pool_blocks:,} blocks of {spec.block_size} tokens, "
            f"{spec.pool_gbps:g} GB/s per link, {spec.pool_aggregate_gbps:g} GB/s aggregate; "
            f"host weight {spec.host_weight:g}"
            + (
                "; engine times measured (calibration)"
                if spec.engine_prefill_points and spec.engine_decode_points
                else f"; prefill speed x{spec.prefill_speedup:.4g} (calibration)"
                if args.calibration
                else ""
            )
        )
        print(report.table(rows, sweep=weights is not None))
        if best:
            for w, r in sorted(best.items()):
                print(f"best host weight for {w} workers ({args.sweep_metric}): {r.host_weight:g}")
        if args.simulator == DYNAMO and any(r.failed_runs for r in rows):
            print("failed runs: " + "; ".join(sorted({e for r in rows for e in r.errors})))
    if args.plot:
        try:
            report.plot(
                rows, args.plot, f"{args.trace.rsplit('/', 1)[-1]}: {len(requests)} requests ({args.simulator})"
            )
        except RuntimeError as exc:
            return _fail(str(exc))
    return 0
