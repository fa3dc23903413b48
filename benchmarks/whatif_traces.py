#!/usr/bin/env python3
"""What the shared pool buys on real traffic: the Mooncake FAST'25 traces at 4, 8, 16 and 32 workers.

For each trace (``../shared/traces/``, relative to the repository root) and worker count:

* the pool model (``maru-dynamo whatif``'s default simulator) replays all four configurations -
  round-robin, kv-gpu, kv-host (per-worker host tiers, together the pool's size), kv-pool - at
  ``--pool-size`` (default 1T) and, for kv-host and kv-pool, also at ``--large-pool-size``
  (default 10T);
* Dynamo's own offline replay replays round-robin, kv-gpu and kv-host (its kv-pool aborts in
  Dynamo 1.6.1), the pool model's agreement check.

Qwen2.5-32B-sized KV (262,144 bytes/token), 64-token blocks, 2,500 GPU blocks per worker, pool
links 64 GB/s, 256 GB/s aggregate, router host weight ``maru_vllm.routing.POOL_TIER_WEIGHT``.
Prints a Markdown table per trace (prefill tokens computed as a share of the input tokens, TTFT
p50/p90) and writes one PNG per trace (``--plot-dir``, default docs/).

Usage: python benchmarks/whatif_traces.py [--requests N] [--workers 4,8,16,32] [--repeats 1]
(the full traces take ~8 min on this project's 2-core machine; run under flock /tmp/maru-heavy.lock
where others share the machine)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from maru_dynamo.components.whatif import report  # noqa: E402
from maru_dynamo.components.whatif.runner import DYNAMO, MODEL, Row, WhatIf  # noqa: E402
from maru_dynamo.components.whatif.spec import (  # noqa: E402
    CONFIGS,
    KV_GPU,
    KV_HOST,
    KV_POOL,
    ROUND_ROBIN,
    ClusterSpec,
    parse_size,
    parse_workers,
)
from maru_dynamo.components.whatif.trace import read_trace, unique_prefix_tokens  # noqa: E402
from maru_vllm.routing import pool_tier_weight  # noqa: E402

TRACES = {
    "conversation": ROOT / ".." / "shared" / "traces" / "mooncake_conversation.jsonl",
    "synthetic": ROOT / ".." / "shared" / "traces" / "mooncake_synthetic.jsonl",
}


def _share(r: Row | None) -> str:
    return "-" if r is None or r.prefill_tokens is None else f"{r.prefill_tokens / r.input_tokens:.3f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def run_trace(name: str, path: Path, args: argparse.Namespace) -> list[str]:
    requests = read_trace(path, 512, args.requests)
    workers = parse_workers(args.workers)
    spec = ClusterSpec(pool_bytes=parse_size(args.pool_size), host_weight=pool_tier_weight())
    large = dataclasses.replace(spec, pool_bytes=parse_size(args.large_pool_size))
    # Prompts longer than a worker's whole KV cache are never served (by Dynamo's mocker either).
    fits = [r for r in requests if -(-(r.input_length + 1) // spec.block_size) <= spec.gpu_blocks]
    ideal = unique_prefix_tokens(fits, 512)
    served = sum(r.input_length for r in fits)
    rows: dict[tuple[str, str, int], Row] = {}
    t0 = time.monotonic()
    with WhatIf(requests, spec, MODEL, args.repeats) as model, WhatIf(requests, spec, DYNAMO, args.repeats) as dyn:
        for w in workers:
            for c in CONFIGS:
                rows[(MODEL, c, w)] = model.one(c, w)
            for c in (KV_HOST, KV_POOL):
                rows[("large", c, w)] = model.one(c, w, large)
            for c in (ROUND_ROBIN, KV_GPU, KV_HOST):
                rows[(DYNAMO, c, w)] = dyn.one(c, w)
    skipped = len(requests) - len(fits)
    out = [
        f"### {name}: {len(fits):,} requests, {served:,} input tokens"
        + (f" ({skipped} longer than a worker's KV cache left out)" if skipped else "")
        + f"; an ideal shared cache computes {ideal / served:.3f} of them; {time.monotonic() - t0:.0f}s",
        "",
        f"Prefill tokens computed / input tokens (pool model; Dynamo's replay in brackets) and TTFT p50 / p90 ms "
        f"(pool model); pool {args.pool_size}B, large pool {args.large_pool_size}B:",
        "",
        f"| workers | round-robin | kv-gpu | kv-host | **kv-pool** | kv-host {args.large_pool_size}B | "
        f"**kv-pool {args.large_pool_size}B** | TTFT kv-gpu | TTFT kv-host | TTFT kv-pool | "
        f"TTFT kv-pool {args.large_pool_size}B |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in workers:
        g = lambda sim, c: rows.get((sim, c, w))  # noqa: E731
        cells = [str(w)]
        for c in (ROUND_ROBIN, KV_GPU, KV_HOST):
            cells.append(f"{_share(g(MODEL, c))} ({_share(g(DYNAMO, c))})")
        cells.append(f"**{_share(g(MODEL, KV_POOL))}**")
        cells.append(_share(g("large", KV_HOST)))
        cells.append(f"**{_share(g('large', KV_POOL))}**")
        for sim, c in ((MODEL, KV_GPU), (MODEL, KV_HOST), (MODEL, KV_POOL), ("large", KV_POOL)):
            r = g(sim, c)
            cells.append(f"{_ms(r.ttft_p50_ms)} / {_ms(r.ttft_p90_ms)}" if r else "-")
        out.append("| " + " | ".join(cells) + " |")
    if args.plot_dir:
        Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
        png = Path(args.plot_dir) / f"whatif-{name}.png"
        plotted = [r for (sim, _c, _w), r in rows.items() if sim == MODEL]
        plotted += [
            dataclasses.replace(r, config=f"{r.config} {args.large_pool_size}B")
            for (sim, _c, _w), r in rows.items()
            if sim == "large"
        ]
        report.plot(plotted, str(png), f"Mooncake {name} trace: {len(requests):,} requests (pool model)")
        out += ["", f"plot: {png}"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="conversation,synthetic")
    ap.add_argument("--workers", default="4,8,16,32")
    ap.add_argument("--requests", type=int, default=None, help="first N requests of each trace (default all)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--pool-size", default="1T")
    ap.add_argument("--large-pool-size", default="10T")
    ap.add_argument("--plot-dir", default=str(ROOT / "docs"))
    args = ap.parse_args()
    for name in args.traces.split(","):
        print("\n".join(run_trace(name, TRACES[name], args)), flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
