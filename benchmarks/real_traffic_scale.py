#!/usr/bin/env python3
"""The what-if beyond this machine: the scaled conversation trace at 8-64 workers, calibrated here.

`real_traffic.py` measures two workers; this replays the same traffic through ``maru-dynamo
whatif`` at larger worker counts, calibrated by what those engines measured (``--calibration``:
the file ``real_traffic.py --calibration-out`` writes, i.e. their prefill tokens/s and pool load
GB/s), with their KV cache (``--gpu-blocks`` of ``--block-size`` tokens per worker).

The traffic is the same scaling of the trace (each hash id ``--trace-block-size`` tokens, outputs
capped as there), but all of it, so that more workers have more sessions to share: at W workers
its arrivals are sped up so that every worker receives the request rate of the real run
(``--rate-per-worker``, requests per second per worker; by default 527 requests over 29.5 s on two
workers, the real run's session sample). The rule depends only on W, never on a result.

Counterparts of the real configurations: plain-rr = round-robin, plain-kv = kv-gpu, maru-pool =
kv-pool. Prints one row per (workers, config) and the TTFT p90 / prefill orderings per worker
count; ``--json FILE`` and ``--plot FILE.png`` write them.

Usage: python benchmarks/real_traffic_scale.py --calibration cal.json [--workers 8,16,32,64]
       [--trace ../shared/traces/mooncake_conversation.jsonl] [--repeats 3] [--json F] [--plot F.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from harness import write_json  # noqa: E402
from real_traffic_whatif import COUNTERPART, order_of, whatif_rows  # noqa: E402
from traffic_load import Traffic, TrafficError, read_mooncake, scale_trace  # noqa: E402

DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
REAL_RATE_PER_WORKER = 527 / 29.475 / 2  # the real run: every 24th session, speedup 120, two workers
CONFIGS = ("round-robin", "kv-gpu", "kv-pool")
REAL_NAME = {v: k for k, v in COUNTERPART.items()}


def speedup_for(traffic: Traffic, workers: int, rate_per_worker: float) -> float:
    """The arrival speedup that gives each of `workers` workers `rate_per_worker` requests/s."""
    return rate_per_worker * workers * traffic.duration_s / len(traffic.requests)


def replay(
    trace_file: Path,
    *,
    workers: int,
    speedup: float,
    calibration: Path,
    block_tokens: int,
    block_size: int,
    gpu_blocks: int,
    pool_size: str,
    repeats: int,
) -> list[dict[str, object]]:
    """``maru-dynamo whatif`` at one worker count (its JSON rows)."""
    return whatif_rows(
        trace_file,
        calibration,
        workers=workers,
        trace_block_size=block_tokens,
        block_size=block_size,
        gpu_blocks=gpu_blocks,
        pool_size=pool_size,
        configs=CONFIGS,
        extra_args=["--arrival-speedup", f"{speedup:.6g}", "--repeats", str(repeats)],
        timeout_s=3600,
    )


def format_rows(rows: Sequence[dict[str, object]]) -> str:
    out = [
        f"{'workers':>7} {'config':<12} {'(real)':<10} {'prefill':>10} {'vs kv-gpu':>9} "
        f"{'TTFT p50':>9} {'p90':>8} {'p90 vs kv-gpu':>13}"
    ]
    for w in sorted({int(r["workers"]) for r in rows}):  # type: ignore[call-overload]
        at = {str(r["config"]): r for r in rows if r["workers"] == w}
        base = at.get("kv-gpu")
        for name in CONFIGS:
            r = at.get(name)
            if r is None or r["prefill_tokens"] is None:
                continue
            rel_pf = float(r["prefill_tokens"]) / float(base["prefill_tokens"]) if base else float("nan")  # type: ignore[arg-type]
            rel_p90 = float(r["ttft_p90_ms"]) / float(base["ttft_p90_ms"]) if base else float("nan")  # type: ignore[arg-type]
            out.append(
                f"{w:>7} {name:<12} {REAL_NAME.get(name, ''):<10} {r['prefill_tokens']:>10} {rel_pf:>9.3f} "
                f"{float(r['ttft_p50_ms']):>9.1f} {float(r['ttft_p90_ms']):>8.1f} {rel_p90:>13.3f}"  # type: ignore[arg-type]
            )
        p90 = {REAL_NAME[n]: float(at[n]["ttft_p90_ms"]) for n in CONFIGS if n in at}  # type: ignore[arg-type]
        pf = {REAL_NAME[n]: float(at[n]["prefill_tokens"]) for n in CONFIGS if n in at}  # type: ignore[arg-type]
        out.append(f"{'':>7} TTFT p90 order: {order_of(p90)}   prefill order: {order_of(pf)}")
    return "\n".join(out)


def plot(rows: Sequence[dict[str, object]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = sorted({int(r["workers"]) for r in rows})  # type: ignore[call-overload]

    def series(name: str, key: str) -> list[float]:
        by = {int(r["workers"]): r for r in rows if r["config"] == name}  # type: ignore[call-overload]
        base = {int(r["workers"]): r for r in rows if r["config"] == "kv-gpu"}  # type: ignore[call-overload]
        return [float(by[w][key]) / float(base[w][key]) for w in ws]  # type: ignore[arg-type]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in CONFIGS:
        label = f"{name} ({REAL_NAME[name]})"
        ax1.plot(ws, series(name, "prefill_tokens"), marker="o", label=label)
        ax2.plot(ws, series(name, "ttft_p90_ms"), marker="o", label=label)
    for ax, what in ((ax1, "prefill tokens computed"), (ax2, "TTFT p90")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ws, [str(w) for w in ws])
        ax.set_xlabel("workers")
        ax.set_ylabel(f"{what} / kv-gpu's")
        ax.set_title(what)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--calibration", type=Path, required=True, help="real_traffic.py --calibration-out FILE")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--workers", default="8,16,32,64", help="worker counts, comma-separated")
    ap.add_argument("--trace-block-size", type=int, default=16, help="tokens per hash id, as the real run")
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--rate-per-worker", type=float, default=REAL_RATE_PER_WORKER, help="requests/s per worker")
    ap.add_argument("--block-size", type=int, default=16, help="simulated KV block (divides the hash block)")
    ap.add_argument("--gpu-blocks", type=int, default=65536, help="KV blocks per worker (the engines': 1 Mi tokens)")
    ap.add_argument("--pool-size", default="4G", help="pool size (default 4G: the whole trace's KV fits)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, metavar="FILE")
    ap.add_argument("--plot", type=Path, default=None, metavar="FILE.png")
    args = ap.parse_args(argv)
    try:
        try:
            workers = [int(w) for w in args.workers.split(",") if w.strip()]
        except ValueError:
            raise TrafficError(f"--workers {args.workers!r}: use comma-separated integers >= 1") from None
        if not workers or min(workers) < 1:
            raise TrafficError(f"--workers {args.workers!r}: use comma-separated integers >= 1")
        if not args.rate_per_worker > 0:
            raise TrafficError(f"--rate-per-worker {args.rate_per_worker}: use requests per second > 0")
        if args.repeats < 1:
            raise TrafficError(f"--repeats {args.repeats}: use an integer >= 1")
        if not args.calibration.is_file():
            raise TrafficError(f"--calibration {args.calibration}: no such file")
        traffic = scale_trace(
            read_mooncake(args.trace),
            name=f"{args.trace.name} x{args.trace_block_size}/512 tokens",
            block_tokens=args.trace_block_size,
            max_output=args.max_output_tokens,
        )
    except TrafficError as exc:
        print(f"real_traffic_scale.py: error: {exc}", file=sys.stderr)
        return 2
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="maru-traffic-scale-") as tmp:
        trace_file = traffic.write(Path(tmp) / "trace.jsonl")
        for w in workers:
            speedup = speedup_for(traffic, w, args.rate_per_worker)
            print(f"[scale] {w} workers: arrivals x{speedup:.3g}", file=sys.stderr, flush=True)
            for r in replay(
                trace_file,
                workers=w,
                speedup=speedup,
                calibration=args.calibration,
                block_tokens=args.trace_block_size,
                block_size=args.block_size,
                gpu_blocks=args.gpu_blocks,
                pool_size=args.pool_size,
                repeats=args.repeats,
            ):
                rows.append({**r, "arrival_speedup": round(speedup, 3)})
    print(format_rows(rows))
    print(
        f"traffic: {traffic.name}: {len(traffic.requests)} requests, {traffic.input_tokens} prompt tokens, "
        f"{traffic.unique_prefix_tokens()} in its prefix tree; {args.rate_per_worker:.2f} requests/s per worker"
    )
    if args.json:
        doc = {
            "trace": traffic.name,
            "requests": len(traffic.requests),
            "rate_per_worker": args.rate_per_worker,
            "calibration": json.loads(args.calibration.read_text()),
            "results": rows,
        }
        write_json(args.json, doc, indent=1)
    if args.plot:
        plot(rows, args.plot, f"what-if, {traffic.name}, {args.rate_per_worker:.2f} req/s per worker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
