#!/usr/bin/env python3
"""Where a pool hit's extra time goes, inside real engines: every hook of one request timed.

    python benchmarks/profile_hit.py [--lengths 1024,4096] [--samples 6] [--json]

Starts the Maru half of `bench_connector.py` (pool service and `maru-A` on core 0, `maru-B` on
core 1, the `bench` model) with `benchmarks/hooktrace` on PYTHONPATH: its sitecustomize times
the engine step, the scheduler, the model runner's forward and the connector's hooks in every
engine process on one clock. For each length and sample, one fresh prompt is prefilled by
maru-A (stored into the pool), then sent twice to maru-B: a pool hit, then a local prefix-cache
hit. Each request's hook calls are picked out by time, and the parts are reported as the
minimum over samples (TTFT included), next to the difference they explain.

Prints milliseconds; asserts nothing. The tracer adds a few microseconds per traced call.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_connector import Engines, metrics, wait_stored  # noqa: E402
from maru_vllm.fixtures.models import ensure_model  # noqa: E402
from maru_vllm.launch import ProcessGroup  # noqa: E402

TRACER = REPO / "benchmarks" / "hooktrace"
# (report name, traced label) of the parts shown, in request order
PARTS = [
    ("scheduler: pool lookup", "MaruKVConnector.get_num_new_matched_tokens"),
    ("scheduler: whole schedule()", "Scheduler.schedule"),
    ("forward incl. load", "GPUModelRunner.execute_model"),
    ("  load (start_load_kv)", "MaruKVConnector.start_load_kv"),
    ("    acquire round trip + header checks", "MaruWorkerSide._acquire"),
    ("    copy + checksum", "MaruWorkerSide._load_batched"),
    ("    release (not waited for)", "PoolAccess.release"),
    ("engine step", "EngineCore.step"),
]


def read_trace(prefix: Path) -> list[tuple[float, str, float]]:
    rows = []
    for f in prefix.parent.glob(prefix.name + ".*"):
        for line in f.read_text().splitlines():
            t, label, ms = line.split()
            rows.append((float(t), label, float(ms)))
    return sorted(rows)


def parts_in(rows: list[tuple[float, str, float]], start: float, end: float) -> dict[str, float]:
    """Milliseconds per traced label over the calls that began in [start, end] (the first
    engine step of a request is its prefill: later calls of a label add up)."""
    out: dict[str, float] = {}
    for t, label, ms in rows:
        if start <= t <= end:
            out[label] = out.get(label, 0.0) + ms
    return out


def run(args: argparse.Namespace) -> dict[str, dict[str, dict[str, float]]]:
    model = str(ensure_model("bench"))
    work = Path(tempfile.mkdtemp(prefix="maru-profile-hit-"))
    prefix = work / "trace" / "hooks"
    prefix.parent.mkdir()
    rng = random.Random(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    windows: list[tuple[int, str, float, float, float]] = []  # (tokens, kind, start, end, ttft)
    with ProcessGroup() as group:
        eng = Engines(
            group,
            work,
            model,
            1,
            False,
            extra_env={
                "PYTHONPATH": os.pathsep.join(filter(None, [str(TRACER), str(REPO), os.environ.get("PYTHONPATH")])),
                "MARU_HOOK_TRACE": str(prefix),
            },
        )
        warm = [rng.randrange(32, 127) for _ in range(1025)]
        for name in ("maru-A", "maru-B", "maru-B"):
            eng.ttft(name, warm)
        for _ in range(args.samples):
            for n in lengths:
                prompt = [rng.randrange(32, 127) for _ in range(n + 1)]
                before = metrics(eng.urls["maru-A"]).get("chunks_stored", 0.0)
                eng.ttft("maru-A", prompt)
                wait_stored(eng.urls["maru-A"], before + n // 256)
                time.sleep(0.2)
                for kind in ("hit", "local"):
                    t0 = time.perf_counter()
                    ttft, cached = eng.ttft("maru-B", prompt)
                    windows.append((n, kind if cached >= n else f"{kind} (partial)", t0, time.perf_counter(), ttft))
                time.sleep(0.2)
        for _ in range(8):  # the tracer writes its lines in batches: push the last ones out
            eng.ttft("maru-B", [67] * 8)
            eng.ttft("maru-A", [67] * 8)
        time.sleep(0.5)
    rows = read_trace(prefix)
    result: dict[str, dict[str, dict[str, float]]] = {}
    for n in lengths:
        per_kind: dict[str, dict[str, float]] = {}
        for n_, kind, start, end, ttft in windows:
            if n_ != n:
                continue
            got = parts_in(rows, start, end)
            got["TTFT"] = ttft * 1e3
            best = per_kind.setdefault(kind, {})
            for label, ms in got.items():
                best[label] = min(best.get(label, float("inf")), ms)
        result[str(n)] = per_kind
    return result


def report(result: dict[str, dict[str, dict[str, float]]], samples: int) -> None:
    print(f"pool hit vs local hit on maru-B (bench model, one core), min of {samples} samples, ms")
    for n, per_kind in result.items():
        hit, local = per_kind.get("hit", {}), per_kind.get("local", {})
        partial = [k for k in per_kind if "partial" in k]
        print(f"\n{n} tokens" + (f" ({', '.join(partial)} samples left out)" if partial else ""))
        print(f"  {'':40s} {'pool hit':>9} {'local':>9} {'diff':>8}")
        for name, label in [("TTFT", "TTFT"), *PARTS]:
            h, loc = hit.get(label, 0.0), local.get(label, 0.0)
            print(f"  {name:40s} {h:9.3f} {loc:9.3f} {h - loc:+8.3f}")
        if hit.get("TTFT") and local.get("TTFT"):
            print(f"  pool hit / local hit: {hit['TTFT'] / local['TTFT']:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096", help="loadable tokens per prompt (multiples of 256)")
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result, args.samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
