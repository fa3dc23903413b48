#!/usr/bin/env python3
"""Chaos soak: the real graph under streaming load while its processes fail on a schedule.

Starts `graphs/agg.yaml` (nats-server, the pool, two Maru workers, Dynamo's frontend with the KV
router) - or, with `--graph disagg`, `graphs/disagg.yaml` (one prefill and one decode worker: a
killed worker's role is served by the other worker's stand-in until it is back) - through the
graph runner (`graphs/run.py`: build_plan, start_graph, stop_graph) with its default
supervision, sends bounded streaming load (chaos/load.py), injects the faults of `--faults`
(chaos/faults.py: worker SIGKILL, worker SIGTERM, pool SIGKILL, pool SIGSTOP/SIGCONT,
nats-server stopped), with a pool smaller than the working set (`--pool-size`: it evicts
throughout), and reports:

* requests sent / completed / failed / truncated (every request asks for `--max-tokens` tokens
  with ignore_eos, so a complete response has a known length);
* each fault's recovery times (the worker serves again, the pool is hit again);
* pins and reservations left in the pool after the load drained (the pool's stats op);
* every process's RSS over the run and its slope (MiB/min);
* the /dev/shm files (maru-*, psm_*, vllm_dist_*) the graph's processes used that are left.

Loopback only; bounded by `--duration` (extended while a fault is still due or recovering, up to
`--max-duration`) and `--max-requests`; stops the graph and every process
it started by itself. `--json FILE` writes the figures. Not part of `make bench` (it measures
robustness, not speed); a short run is tests/e2e/test_chaos_soak.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from chaos import procs  # noqa: E402 - benchmarks/ is not a package
from chaos.faults import FaultRunner, parse_schedule  # noqa: E402
from chaos.graph import GraphView, wait_for  # noqa: E402
from chaos.load import LoadConfig, LoadGenerator, summarize  # noqa: E402
from chaos.samplers import SHM_PREFIXES, Sampler, shm_left, shm_listing  # noqa: E402
from harness import write_json  # noqa: E402

DEFAULT_FAULTS = "worker-kill@20,worker-term@45,pool-restart-warm@70,pool-stop@100+8,nats-stop@125"
DEFAULT_POOL_SIZE = "16M"  # the tiny model's 40 x 768-token working set needs several times that


class _Stop(BaseException):
    """SIGTERM/SIGINT: stop the soak and clean up."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


class _Parser(argparse.ArgumentParser):
    """Bad input is one line: what is wrong and what is allowed (no usage block before it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"chaos_soak: error: {message}\n")


def _positive(kind: type) -> Any:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: use a number greater than 0") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: use a number greater than 0")
        return value

    return convert


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _Parser(description=(__doc__ or "").splitlines()[0], allow_abbrev=False)
    ap.add_argument(
        "--graph", default="agg", help="graph file or bundled graph name: agg (default) or disagg, or a graph file"
    )
    ap.add_argument("--model", help="model (default: the graph's)")
    ap.add_argument("--pool-size", default=DEFAULT_POOL_SIZE, help="pool size, or 'graph' for the graph's own")
    ap.add_argument("--duration", type=_positive(float), default=150.0, help="seconds of load (at least)")
    ap.add_argument(
        "--max-duration",
        type=_positive(float),
        default=480.0,
        help="seconds of load at most (the load goes on past --duration while a fault is due or recovering)",
    )
    ap.add_argument("--max-requests", type=_positive(int), default=5000)
    ap.add_argument("--concurrency", type=_positive(int), default=3)
    ap.add_argument("--max-tokens", type=_positive(int), default=32, help="tokens every request asks for")
    ap.add_argument("--prefix-tokens", type=_positive(int), default=768)
    ap.add_argument("--prefixes", type=_positive(int), default=40, help="shared prefixes in the working set")
    ap.add_argument("--faults", default=DEFAULT_FAULTS, help=f"KIND@S[+HOLD],... (default {DEFAULT_FAULTS})")
    ap.add_argument("--recovery-timeout", type=_positive(float), default=240.0, help="seconds a fault may take to heal")
    ap.add_argument("--request-timeout", type=_positive(float), default=120.0)
    ap.add_argument("--drain-timeout", type=_positive(float), default=60.0)
    ap.add_argument("--sample-interval", type=_positive(float), default=2.0)
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    ap.add_argument("--keep-logs", action="store_true", help="keep the graph's logs (kept anyway on failure)")
    args = ap.parse_args(argv)
    try:
        args.schedule = parse_schedule(args.faults)
    except ValueError as exc:
        ap.error(f"--faults: {exc}")
    if args.max_duration < args.duration:
        ap.error(f"--max-duration {args.max_duration:g}: use at least --duration ({args.duration:g})")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json {args.json}: the folder {Path(args.json).resolve().parent} does not exist")
    for fault in args.schedule:
        if fault.at_s >= args.duration:
            ap.error(f"--faults: {fault.kind}@{fault.at_s:g} is not within the load (--duration {args.duration:g})")
    return args


def load_spec(args: argparse.Namespace) -> Any:
    """The graph spec with the soak's pool size; ValueError (one line) if it is bad."""
    from maru_dynamo.graphs.spec import GraphSpecError, load_graph, resolve_graph_path
    from maru_vllm.pool.region import parse_size

    try:
        spec = load_graph(resolve_graph_path(args.graph))
    except GraphSpecError as exc:
        raise ValueError(f"--graph: {exc}") from None
    if spec.mode == "agg" and (len(spec.workers) != 1 or spec.workers[0].replicas < 2):
        raise ValueError(
            f"--graph {args.graph}: an aggregated graph for the soak has one worker entry with 2+ replicas"
        )
    if spec.mode == "disagg" and sorted(w.role for w in spec.workers) != ["decode", "prefill"]:
        raise ValueError(
            f"--graph {args.graph}: a disaggregated graph for the soak has one prefill and one decode worker entry"
        )
    if args.pool_size != "graph":
        try:
            size = parse_size(args.pool_size)
        except ValueError as exc:
            raise ValueError(f"--pool-size: {exc}") from None
        spec = dataclasses.replace(spec, pool=dataclasses.replace(spec.pool, size=size))
    return spec


def drain(view: GraphView, timeout: float) -> dict[str, Any]:
    """Wait until the pool holds no pins and no reservations; its stats then (or at the timeout)."""
    last: dict[str, Any] = {}

    def clear() -> bool:
        stats = view.pool_stats()
        if not stats:
            return False
        last.clear()
        last.update(stats)
        return not (stats.get("pinned") or stats.get("pins") or stats.get("reserved"))

    waited = wait_for(clear, timeout)
    keys = ("pinned", "pins", "reserved", "reserved_bytes", "doomed", "sessions", "objects", "allocated_bytes")
    out = {k: last.get(k) for k in keys}
    out["allocator_consistent"] = last.get("allocator_consistent")
    out["unaccounted_bytes"] = (
        None if not last else int(last.get("allocated_bytes", 0)) - int(last.get("live_object_alloc_bytes", 0))
    )
    out["drained_s"] = None if waited is None else round(waited, 2)
    out["answered"] = bool(last)
    return out


def run_soak(args: argparse.Namespace, spec: Any, log: Any = print) -> dict[str, Any]:
    from maru_dynamo.graphs.plan import build_plan, resolve_model
    from maru_dynamo.graphs.run import new_work_dir, start_graph, stop_graph, supervise
    from maru_vllm.launch import ProcessFailed, ProcessGroup

    model = resolve_model(args.model or spec.model)
    work_dir = new_work_dir()
    plan = build_plan(spec, model=model, work_dir=work_dir)
    group = ProcessGroup()
    view = GraphView(plan, group)
    sampler = Sampler(view, args.sample_interval)
    faults = FaultRunner(view, args.schedule, spec.pool.chunk_tokens, args.recovery_timeout, log)
    shm_before = shm_listing()
    report: dict[str, Any] = {"graph": spec.source, "model": model, "pool_size": spec.pool.size, "ok": False}
    # The graph runner's own supervision, as `maru-dynamo graph run` sets it up (here in a thread).
    supervision = supervise(plan, group, out=log)
    seen_pids: set[int] = set()
    load: LoadGenerator | None = None
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        t_start = time.monotonic()
        log(f"[soak] starting {spec.name} (pool {spec.pool.size >> 20} MiB); logs in {work_dir / 'logs'}")
        start_graph(plan, group, supervisor=supervision)
        report["startup_s"] = round(time.monotonic() - t_start, 1)
        supervision.start()
        sampler.start()
        cfg = LoadConfig(
            url=plan.url,
            model=model,
            concurrency=args.concurrency,
            duration_s=args.duration,
            max_duration_s=args.max_duration,
            max_requests=args.max_requests,
            max_tokens=args.max_tokens,
            prefix_tokens=args.prefix_tokens,
            prefixes=args.prefixes,
            request_timeout_s=args.request_timeout,
        )
        load = LoadGenerator(cfg, on_progress=lambda line: log(f"[soak] load {line}"), keep_going=faults.pending)
        log(f"[soak] ready in {report['startup_s']}s; load for {args.duration:g}s, faults: {args.faults}")
        t_load = time.monotonic()
        faults.start(t_load)
        asyncio.run(load.run())
        report["load_s"] = round(time.monotonic() - t_load, 1)
        faults.finish()
        report["requests"] = summarize(load.results, load.sent)
        report["faults"] = [
            dataclasses.asdict(r)
            | {"recovered": r.recovered, "load": load_around(load.results, t_load + r.injected_at_s)}
            for r in faults.records
        ]
        report["faults_missed"] = [f.kind for f in args.schedule][len(faults.records) :]
        report["probes"] = faults.probes
        report["instances_end"] = {
            str(i): view.ask(view.probe_prompt(8), i) is not None for i in view.serving_instances()
        }
        if view.disaggregated:
            report["disaggregated_end"] = view.disaggregated_again()
        report["drain"] = drain(view, args.drain_timeout)
        sampler.sample()
        report["pool_counters"] = sampler.pool_totals()
    except _Stop as stop:
        log(f"[soak] {stop}: stopping")
        report["interrupted"] = str(stop)
        if load is not None:  # what was sent until then
            report["requests"] = summarize(load.results, load.sent)
    except (ProcessFailed, OSError) as exc:  # the graph did not start (its log tail is in the message)
        report["error"] = str(exc).splitlines()[0]
        # Each dead process's first traceback (the root cause) and last lines.
        report["failed_processes"] = {
            p.name: p.failure_report(tail=10, first_error_lines=30) for p in group if p.proc and not p.alive()
        }
    finally:
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        faults.stop()
        sampler.stop()
        seen_pids = set(sampler.pids_seen)
        stop_graph(group, supervisor=supervision)
        report["supervision"] = {
            "restarts": {name: supervision.restarts(name) for name in view.names()},
            "given_up": supervision.given_up(),
            "shm_removed": sorted(p.name for p in supervision.removed_segments),
        }
        for s, handler in previous.items():
            signal.signal(s, handler)
    report["rss"] = sampler.rss_report()
    report["rss_series"] = sampler.rss_series()
    report["pool_timeline"] = sampler.pool_timeline
    wait_for(lambda: not any(procs.alive(p) for p in seen_pids), 10)
    report["processes_left"] = sorted(p for p in seen_pids if procs.alive(p))
    report["shm_left"], report["shm_left_other"] = shm_left(shm_before, sampler.shm_seen)
    report["shm_new_not_ours"] = sorted(
        f for f in shm_listing() - shm_before - sampler.shm_seen if f.startswith(SHM_PREFIXES)
    )
    report["ok"] = verdict(report)
    for name in report["shm_left"] + report["shm_left_other"]:  # reported above; the soak leaves nothing
        (Path(procs.SHM) / name).unlink(missing_ok=True)
    if report["ok"] and not args.keep_logs:
        shutil.rmtree(work_dir, ignore_errors=True)
    else:
        report["logs"] = str(work_dir / "logs")
    return report


def load_around(results: list[Any], at: float, window_s: float = 15.0) -> dict[str, Any]:
    """What users saw around a fault injected at `at` (time.monotonic()): requests completed in the
    `window_s` before and after it, and the slowest request that ended within 2 windows after it
    (a stalled engine shows as a gap and a long request, not as an error)."""
    after = [r for r in results if at <= r.end < at + 2 * window_s]
    return {
        "completed_before": sum(r.outcome == "completed" and at - window_s <= r.end < at for r in results),
        "completed_after": sum(r.outcome == "completed" and at <= r.end < at + window_s for r in results),
        "slowest_after_s": round(max((r.end - r.start for r in after), default=0.0), 2),
    }


def verdict(report: dict[str, Any]) -> bool:
    """Nothing lost, truncated or leaked, and every fault healed."""
    req = report.get("requests") or {}
    drained = report.get("drain") or {}
    return bool(
        req.get("sent")
        and req.get("completed") == req.get("sent")
        and not report.get("faults_missed")
        and all(f["recovered"] for f in report.get("faults", []))
        and drained.get("drained_s") is not None
        and not drained.get("unaccounted_bytes")
        and not report["shm_left"]
        and not report["processes_left"]
        and "interrupted" not in report
        and "error" not in report
        and not (report.get("supervision") or {}).get("given_up")
        and report.get("disaggregated_end", True)
    )


def format_report(report: dict[str, Any]) -> str:
    lines = [f"[soak] graph {report['graph']}, model {report['model']}, pool {report['pool_size'] >> 20} MiB"]
    req = report.get("requests")
    if req:
        lines.append(
            f"requests: sent {req['sent']}, completed {req['completed']}, failed {req['failed']}, "
            f"truncated {req['truncated']}, unfinished {req['unfinished']} ({req['tokens']} tokens in "
            f"{report.get('load_s')} s)"
        )
        for ex in req["examples"]:
            lines.append(
                f"  {ex['outcome']}: request {ex['index']} status {ex['status']} tokens {ex['tokens']}: "
                f"{ex['error'] or ex['finish_reason']}"
            )
    for f in report.get("faults", []):
        steps = ", ".join(f"{k} {'-' if v is None else f'{v:.1f}s'}" for k, v in f["recovery"].items())
        state = "recovered" if f["recovered"] else "NOT RECOVERED"
        lines.append(f"fault {f['kind']} of {f['target']} at {f['injected_at_s']:.0f}s: {state}: {steps}")
        around = f["load"]
        lines.append(
            f"  load: {around['completed_before']} completed in the 15 s before, {around['completed_after']} in "
            f"the 15 s after; slowest request ending within 30 s after: {around['slowest_after_s']:.1f}s"
        )
        lines += [f"  note: {n}" for n in f["notes"]]
    if report.get("faults_missed"):
        lines.append(f"faults not injected (load ended first): {', '.join(report['faults_missed'])}")
    sup = report.get("supervision")
    if sup:
        restarted = ", ".join(f"{n} x{c}" for n, c in sup["restarts"].items() if c) or "none"
        lines.append(
            f"supervision: restarts {restarted}; given up: {sup['given_up'] or 'none'}; "
            f"/dev/shm segments it removed: {len(sup['shm_removed'])}"
        )
    if "pool_counters" in report:
        c = report["pool_counters"]
        lines.append(
            f"pool: {c['incarnations']} incarnation(s); hits {c['hits']}, misses {c['misses']}, "
            f"stores {c['stores']}, evictions {c['evictions']}, corrupt reads {c['corrupt_reads']}"
        )
    listed = report.get("instances_end")
    if listed is not None:
        stale = [i for i, ok in listed.items() if not ok]
        lines.append(
            f"frontend lists {len(listed)} worker instance(s) at the end; not serving a pinned request: "
            + (", ".join(stale) if stale else "none")
        )
    if "disaggregated_end" in report:
        lines.append(f"disaggregated at the end (no worker stands in): {report['disaggregated_end']}")
    d = report.get("drain")
    if d:
        lines.append(
            f"after drain: pinned {d['pinned']}, pins {d['pins']}, reserved {d['reserved']}, "
            f"unaccounted bytes {d['unaccounted_bytes']}, "
            + (f"drained in {d['drained_s']}s" if d["drained_s"] is not None else "NOT drained")
        )
    lines.append("RSS (MiB; slope MiB/min after the first 30 s of each process):")
    for row in report.get("rss", []):
        slope = row["rss_slope_mib_min"]
        lines.append(
            f"  {row['process']:<48} {row['first_mib']:>7.0f} -> {row['last_mib']:>7.0f} (peak "
            f"{row['peak_mib']:.0f}) over {row['span_s']:>5.0f}s  slope {'-' if slope is None else f'{slope:+.2f}'}"
            + (" (restarted: start-up in the fit)" if row["started_during_run"] and slope is not None else "")
        )
    lines.append(
        f"/dev/shm left of ours (removed by the soak after this report): {', '.join(report['shm_left']) or 'none'}"
    )
    if report.get("shm_left_other"):
        lines.append(f"  other /dev/shm files of the graph's left: {', '.join(report['shm_left_other'])}")
    if report.get("shm_new_not_ours"):
        lines.append(f"  (new there, not ours: {len(report['shm_new_not_ours'])})")
    lines.append(f"processes left: {report['processes_left'] or 'none'}")
    if "error" in report:
        lines.append(f"error: {report['error']}")
        for name, text in report.get("failed_processes", {}).items():
            lines.append(f"--- {name} ---\n{text}")
    lines.append(
        f"verdict: {'ok' if report['ok'] else 'FAILED'}" + (f" (logs {report['logs']})" if "logs" in report else "")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        spec = load_spec(args)
    except ValueError as exc:
        print(f"chaos_soak: error: {exc}", file=sys.stderr)
        return 2
    report = run_soak(args, spec)
    print(format_report(report), flush=True)
    if args.json:
        write_json(args.json, report, sort_keys=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
