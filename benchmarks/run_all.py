#!/usr/bin/env python3
"""`make bench`: run every benchmark in this folder, one after another, and print their reports.

Each benchmark measures its ratios within one run (never against stored numbers) and none of
them is part of `make test`. Pass `--quick` for shorter runs (fewer prompts / iterations).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIPPED = 77  # a benchmark that cannot run here (e.g. no GPU) says why and exits with this

BENCHMARKS: list[tuple[str, list[str], list[str]]] = [
    # (script, args, quick args)
    ("bench_page_copy.py", [], []),
    ("bench_pool.py", [], ["--iters", "300"]),
    ("profile_load.py", [], ["--repeats", "5"]),
    ("bench_connector.py", [], ["--samples", "1", "--lengths", "1024,4096"]),
    ("profile_hit.py", [], ["--samples", "2", "--lengths", "4096"]),
    ("bench_store.py", ["--engines"], ["--repeats", "3"]),
    ("bench_gpu_transfer.py", [], ["--repeats", "3"]),  # exits 77 (skipped) without a CUDA device
    ("routing_comparison.py", [], []),
    ("bench_migration.py", [], ["--samples", "1", "--probe-s", "5"]),
    ("bench_pool_scale.py", ["--chunks", "100000"], ["--chunks", "20000", "--live-chunks", "2000", "--lookups", "200"]),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", help="run just this script (e.g. bench_pool.py)")
    args = ap.parse_args()
    failed = []
    for script, full, quick in BENCHMARKS:
        if args.only and script != args.only:
            continue
        print(f"\n===== {script} =====", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, str(HERE / script), *(quick if args.quick else full)])
        print(
            f"===== {script}: {'skipped' if rc == SKIPPED else f'exit {rc}'}, {time.monotonic() - t0:.0f}s =====",
            flush=True,
        )
        if rc and rc != SKIPPED:
            failed.append(script)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
