#!/usr/bin/env python3
"""TTFT and ITL of a disaggregated graph that lost a role, beside the same graph whole and an aggregated one.

Four modes, each on a graph of its own started by the graph runner (`graphs/run.py`) on the tiny
fixture model, without supervision (a stopped worker stays stopped):

* ``agg``        - `graphs/agg.yaml`: two aggregated workers;
* ``disagg``     - `graphs/disagg.yaml`: one prefill and one decode worker;
* ``no-prefill`` - `graphs/disagg.yaml` with its prefill worker stopped (SIGTERM): the decode
  worker stands in for the prefill role (`maru_dynamo.components.disagg`), one engine does both;
* ``no-decode``  - the same with the decode worker stopped: the prefill worker stands in.

In each, after a few warm-up requests, the same closed-loop streaming load (benchmarks/chaos/
load.py: `--concurrency` requests in flight, each one of `--prefixes` shared prefixes of
`--prefix-tokens` tokens plus 8 tokens of its own, `--max-tokens` greedy tokens with ignore_eos)
sends `--requests` requests. Reported per mode: TTFT and ITL (mean time between a request's tokens
after its first) p50 and p90 over the requests, output tokens/s, and each p50 as a ratio to
``disagg``'s; in each run's line also how many of the load's requests each role's stand-ins passed
on to a worker of that role (``passed_on``: in ``disagg``, the share of prefill requests and decode
streams that took the extra hop). Single timings on this machine swing by +-30%: compare medians of several runs
(`--repeats`).

Loopback only; stops every process it started. `--json FILE` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from chaos.graph import GraphView, wait_for  # noqa: E402 - benchmarks/ is not a package
from chaos.load import COMPLETED, LoadConfig, LoadGenerator  # noqa: E402
from harness import write_json  # noqa: E402

MODES = ("agg", "disagg", "no-prefill", "no-decode")
STOPPED = {"no-prefill": "worker:prefill-0", "no-decode": "worker:decode-0"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"bench_disagg_fallback: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: use an integer greater than 0")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _Parser(description=(__doc__ or "").splitlines()[0], allow_abbrev=False)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--model", default="tiny", help="model (default: the tiny fixture)")
    ap.add_argument("--requests", type=_positive_int, default=32)
    ap.add_argument("--concurrency", type=_positive_int, default=2)
    ap.add_argument("--max-tokens", type=_positive_int, default=48)
    ap.add_argument("--prefix-tokens", type=_positive_int, default=768)
    ap.add_argument("--prefixes", type=_positive_int, default=4)
    ap.add_argument("--repeats", type=_positive_int, default=1, help="runs of each mode (medians are reported)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        ap.error(f"--modes {','.join(bad) or '(none)'}: use a comma-separated list of {', '.join(MODES)}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json {args.json}: the folder {Path(args.json).resolve().parent} does not exist")
    return args


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run_mode(mode: str, args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    from maru_dynamo.graphs.plan import build_plan, resolve_model
    from maru_dynamo.graphs.run import new_work_dir, start_graph, stop_graph
    from maru_dynamo.graphs.spec import load_graph, resolve_graph_path
    from maru_vllm.launch import ProcessGroup

    spec = load_graph(resolve_graph_path("agg" if mode == "agg" else "disagg"))
    model = resolve_model(args.model)
    work_dir = new_work_dir()
    plan = build_plan(spec, model=model, work_dir=work_dir)
    group = ProcessGroup()
    view = GraphView(plan, group)
    try:
        start_graph(plan, group)
        if mode == "disagg" and wait_for(view.disaggregated_again, 60) is None:
            raise RuntimeError("the disaggregated graph did not come up with a worker of each role")
        if mode in STOPPED:
            stopped = next(p for p in group.processes if p.name == STOPPED[mode])
            t0 = time.monotonic()
            stopped.stop(30.0)
            role = STOPPED[mode].split(":")[1].rsplit("-", 1)[0]
            if wait_for(lambda: view.role_view().state() == f"{role} degraded", 120, 0.1) is None:
                raise RuntimeError(f"{mode}: no worker stood in for the stopped one")
            log(f"[bench] {mode}: {STOPPED[mode]} stopped; the other worker stands in ({time.monotonic() - t0:.1f} s)")
        cfg = LoadConfig(
            url=plan.url,
            model=model,
            concurrency=args.concurrency,
            duration_s=3600.0,
            max_duration_s=3600.0,
            max_requests=args.requests,
            max_tokens=args.max_tokens,
            prefix_tokens=args.prefix_tokens,
            prefixes=args.prefixes,
            seed=1,
        )
        warm = LoadGenerator(dataclasses.replace(cfg, max_requests=2 * args.concurrency, seed=2))
        asyncio.run(warm.run())
        load = LoadGenerator(cfg)
        passed_before = passed_on(plan)
        t_load = time.monotonic()
        results = asyncio.run(load.run())
        elapsed = time.monotonic() - t_load
        passed = {role: n - passed_before.get(role, 0) for role, n in passed_on(plan).items()}
    finally:
        stop_graph(group)
        shutil.rmtree(work_dir, ignore_errors=True)
    done = [r for r in results if r.outcome == COMPLETED]
    ttft = [r.first_token_s for r in done if r.first_token_s is not None]
    itl = [r.itl_s for r in done if r.itl_s is not None]
    return {
        "mode": mode,
        "requests": len(results),
        "completed": len(done),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p90_s": pct(ttft, 0.9),
        "itl_p50_s": pct(itl, 0.5),
        "itl_p90_s": pct(itl, 0.9),
        "output_tok_s": sum(r.tokens for r in done) / elapsed if elapsed > 0 else None,
        "passed_on": passed,
    }


def passed_on(plan: Any) -> dict[str, int]:
    """Per role, the requests of the load so far that the other role's stand-ins passed on to a
    worker of that role (`maru_disagg_forwarded_requests_total` on the workers' /metrics)."""
    from maru_dynamo.components.disagg import other_role
    from maru_vllm.launch.engine_metrics import metric_total, scrape

    out: dict[str, int] = {}
    for worker in plan.workers:
        role = worker.name.split(":")[-1].rsplit("-", 1)[0]
        if worker.metrics_url is None or role not in ("prefill", "decode"):
            continue
        try:
            text = scrape(worker.metrics_url, timeout=10)
        except OSError:
            continue  # a stopped worker
        stood_in = other_role(role)
        out[stood_in] = out.get(stood_in, 0) + int(metric_total(text, "maru_disagg_forwarded_requests_total"))
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode: the median of each figure over its runs, and p50 ratios to disagg."""
    out: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        rows = [r for r in runs if r["mode"] == mode]
        out[mode] = {
            k: statistics.median(v for v in (r[k] for r in rows) if v is not None)
            if any(r[k] is not None for r in rows)
            else None
            for k in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "output_tok_s")
        }
        out[mode]["runs"] = len(rows)
        out[mode]["completed"] = f"{sum(r['completed'] for r in rows)}/{sum(r['requests'] for r in rows)}"
    base = out.get("disagg")
    for row in out.values():
        for k in ("ttft_p50_s", "itl_p50_s"):
            row[k.replace("_s", "_vs_disagg")] = round(row[k] / base[k], 2) if base and row[k] and base.get(k) else None
    return out


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    lines = ["mode        TTFT p50 / p90 ms   ITL p50 / p90 ms   out tok/s   TTFT, ITL vs disagg   completed"]
    for mode, r in summary.items():
        lines.append(
            f"{mode:<11} {ms(r['ttft_p50_s']):>8} / {ms(r['ttft_p90_s']):<8} {ms(r['itl_p50_s']):>7} / "
            f"{ms(r['itl_p90_s']):<8} {r['output_tok_s'] or 0:>9.1f}   {r['ttft_p50_vs_disagg'] or '-'!s:>5}, "
            f"{r['itl_p50_vs_disagg'] or '-'!s:<5}          {r['completed']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = []
    for repeat in range(args.repeats):
        for mode in args.modes:
            print(f"[bench] {mode} (run {repeat + 1} of {args.repeats})", flush=True)
            runs.append(run_mode(mode, args))
            print(f"[bench] {json.dumps(runs[-1])}", flush=True)
    summary = summarize(runs)
    print(format_table(summary), flush=True)
    if args.json:
        write_json(args.json, {"args": vars(args), "runs": runs, "summary": summary})
    return 0 if all(r["completed"] == r["requests"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
