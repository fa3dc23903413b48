#!/usr/bin/env python3
"""The what-if again on a recorded `real_traffic.py` run, e.g. after a change to the what-if.

``python benchmarks/real_traffic_predict.py RUNS.json [--json RESULTS.json] [--load-gbps G]``:
RUNS.json is the run's ``--detail-json`` (it keeps the run's arguments and calibration); each
rate's traffic is built again from those arguments and replayed by `maru-dynamo whatif` with the
same calibration, worker KV cache and pool, and printed beside the real figures; ``--json``
rewrites the run's ``--json`` file's ``whatif`` entries with the new predictions.
``--load-gbps`` replays with pool loads at G GB/s instead of the measured speed: what a faster
data path would change (a large G: loads for free).
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

import msgspec  # noqa: E402

import real_traffic  # noqa: E402
from harness import write_json  # noqa: E402
from maru_vllm.fixtures.calibration import Calibration  # noqa: E402
from real_traffic_whatif import predict_rates  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the what-if again, on a recorded real_traffic.py run")
    ap.add_argument("detail", type=Path, help="the run's --detail-json file")
    ap.add_argument("--json", type=Path, default=None, help="also rewrite this --json file's 'whatif' entries")
    ap.add_argument("--load-gbps", type=float, default=None, help="pool loads at this speed (default: as measured)")
    args = ap.parse_args(argv)
    if args.load_gbps is not None and not args.load_gbps > 0:
        ap.error(f"--load-gbps {args.load_gbps:g}: want a speed above 0 GB/s")
    if args.load_gbps is not None and args.json is not None:
        ap.error("--load-gbps is a what-if of another data path: it does not rewrite the run's --json")
    doc = json.loads(args.detail.read_text())
    run_args = real_traffic._parser().parse_args(doc["argv"])
    _, _, traffics = real_traffic._validate(run_args)
    cal = msgspec.convert(doc["calibration"], Calibration)
    if args.load_gbps is not None:
        cal = msgspec.structs.replace(cal, load_gbps=args.load_gbps)
    from maru_dynamo.graphs.plan import resolve_model

    model = resolve_model(run_args.model)
    with tempfile.TemporaryDirectory(prefix="maru-predict-") as tmp:
        files = {rate: t.write(Path(tmp) / f"trace-{rate:g}.jsonl") for rate, t in traffics.items()}
        text, predicted = predict_rates(
            doc["results"],
            files,
            msgspec.structs.replace(cal, model=model),
            work=Path(tmp),
            workers=run_args.workers,
            trace_block_tokens=run_args.trace_block_size,
            engine_block_tokens=real_traffic.ENGINE_BLOCK_TOKENS,
            kv_cache_tokens=int(doc["kv_cache_tokens"]),
            pool_size=run_args.pool_size,
        )
    print(text)
    if args.json is not None:
        out = json.loads(args.json.read_text())
        for row in out["results"]:
            key = (row["config"], row["rate"])
            row.pop("whatif", None)
            if key in predicted:
                row["whatif"] = predicted[key]
        write_json(args.json, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
