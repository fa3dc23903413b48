"""Restart cases that each run a graph of their own under closed-loop streaming load.

Used by `benchmarks/bench_restarts.py` (`--cases`). Each case starts its graph through the graph
runner's library (build_plan, start_graph, supervise - so the graph's supervision and its rolling
restart, `graphs/control.py`, run as under `maru-dynamo graph run`), sends streaming load
(chaos/load.py: every request asks for --max-tokens tokens with ignore_eos, so a complete
response has a known length), does its restarts and reports, besides its own figures, requests
sent / completed / failed / truncated, pins and reservations left in the pool once the load
drained, and the /dev/shm files of the graph's processes left after the graph stopped.

* ``rolling``  - `graph restart --all`: both workers restarted one at a time (SIGTERM: out of
  discovery, drain, exit; started again; back once registered, so warm), with the time each
  stop and each return took, and how many requests the frontend migrated meanwhile;
* ``drain``    - what draining saves over migrating: two workers, one stopping with the default
  grace period (it drains), one with DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS=0 (what is running
  is migrated at once), each restarted --samples times in turn under the same load; per stop,
  the requests running on it, how many were migrated, and the longest stall of a stream that
  was running at the stop;
* ``dead``     - a worker's whole process tree SIGKILLed under load, each worker --samples
  times in turn: how long until the frontend no longer lists its instance (the graph takes it
  out of discovery as soon as its supervision sees the death), how many requests were migrated
  meanwhile, and once, for comparison, the same kill with that removal switched off (the
  instance then stays listed until Dynamo's file discovery lets its registration expire);
* ``frontend`` - the frontend SIGKILLed and started again by the graph's supervision (the
  clients retry refused connections): requests lost (only those on the killed frontend may be:
  streams it was serving, connections its socket accepted as it went down; counted apart,
  requests its successor answered 404 in the moment before it knew the model), how long until
  it serves again, and how long until its KV router credits the pool again - until a prompt
  that only the pool holds (computed before on a worker that was restarted since) is routed
  with its blocks credited at the host tier; then a planned restart of it (`graph restart
  frontend`, SIGTERM) under the same load, and what that lost (counted apart: requests the
  draining frontend answered 503 and its successor 404; the verdict allows those, never a
  cut stream or another failure).

Size: the four cases share one harness (a graph of their own under load, its leak checks) and
one report format; apart, each case would import the harness back and the report would need all.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chaos import procs
from chaos.graph import GraphView, wait_for
from chaos.load import COMPLETED, LoadConfig, LoadGenerator, RequestResult, summarize
from chaos.samplers import Sampler, shm_left, shm_listing
from chaos_soak import drain  # benchmarks/ is on sys.path (the scripts put it there)
from harness import alternated, spread
from maru_dynamo.graphs.control import ControlError, RollingRestart
from maru_dynamo.graphs.plan import build_plan, resolve_model
from maru_dynamo.graphs.run import frontend_instances, new_work_dir, start_graph, stop_graph, supervise
from maru_dynamo.graphs.spec import GraphSpec, load_graph, resolve_graph_path
from maru_vllm.launch import ProcessGroup
from maru_vllm.launch.engine_metrics import scrape
from maru_vllm.launch.lifecycle import GRACE_ENV

BLOCK_TOKENS = 128  # vLLM's block size on these engines
POOL_PROMPT_TOKENS = 3 * 256 + 1  # three pool chunks, six KV blocks


def migrations(url: str) -> float:
    """The frontend's count of requests moved to another worker (new and ongoing)."""
    try:
        text = scrape(f"{url}/metrics", timeout=10)
    except OSError:
        return 0.0
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if "model_migration_total{" in line and re.search(r'migration_type="(new|ongoing)_request"', line)
    )


def selections(log: Path) -> list[dict[str, str]]:
    """The frontend's KV-router `Selected worker` log lines, as key=value dicts."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
    return [
        {k: v.strip('"') for k, v in re.findall(r"(\w+)=(\S+)", line)}
        for line in text.splitlines()
        if "Selected worker" in line
    ]


def ms(values: list[float]) -> dict[str, float | None]:
    """min / median / max of `values` (seconds) in ms."""
    return {k: None if v is None else round(1000 * v, 1) for k, v in spread(values).items()}


class LoadedGraph:
    """A graph of `spec` serving closed-loop streaming load, with the soak's leak checks."""

    def __init__(self, spec: GraphSpec, args: argparse.Namespace, log: Callable[[str], None]) -> None:
        self.args, self.log = args, log
        self.model = resolve_model(args.model or spec.model)
        self.plan = build_plan(spec, model=self.model, work_dir=new_work_dir())
        self.group = ProcessGroup()
        self.view = GraphView(self.plan, self.group)
        self.supervisor = supervise(self.plan, self.group, out=log)
        self.sampler = Sampler(self.view, 2.0)
        self.restart = RollingRestart(self.plan, self.group, self.supervisor, lambda line: log(f"[graph] {line}"))
        self.load: LoadGenerator | None = None
        self._thread: threading.Thread | None = None
        self.shm_before: set[str] = set()
        self.shm_left: list[str] = []
        self.ok = False

    def __enter__(self) -> LoadedGraph:
        self.shm_before = shm_listing()
        self.log(f"[restarts] starting {self.plan.spec.name} on {self.model}; logs in {self.plan.work_dir / 'logs'}")
        try:
            start_graph(self.plan, self.group, supervisor=self.supervisor)
        except BaseException:
            self.close()
            raise
        self.supervisor.start()
        self.sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_load(self, seed: int, retry_refused_s: float = 0.0) -> LoadGenerator:
        a = self.args
        cfg = LoadConfig(
            url=self.plan.url,
            model=self.model,
            concurrency=a.concurrency,
            duration_s=3600.0,
            max_duration_s=3600.0,
            max_tokens=a.max_tokens,
            prefix_tokens=a.prefix_tokens,
            prefixes=a.prefixes,
            seed=seed,
            retry_refused_s=retry_refused_s,
        )
        load = self.load = LoadGenerator(cfg, progress_s=3600.0)
        self._thread = threading.Thread(target=lambda: asyncio.run(load.run()), name="bench-load", daemon=True)
        self._thread.start()
        if wait_for(lambda: sum(r.outcome == COMPLETED for r in load.results) >= 2 * a.concurrency, 300, 0.2) is None:
            raise RuntimeError("the load did not get going within 300 s")
        return load

    def stop_load(self) -> list[RequestResult]:
        assert self.load is not None and self._thread is not None
        time.sleep(self.args.after_restart_s)  # the load goes on for a while after the restart
        self.load.stop()
        self._thread.join(timeout=self.args.request_timeout + 60)
        return list(self.load.results)

    def leaks(self) -> dict[str, Any]:
        """Pins and reservations once the load drained (the soak's `drain`)."""
        return drain(self.view, 60.0)

    def close(self) -> None:
        if self.load is not None:
            self.load.stop()
        self.sampler.stop()
        stop_graph(self.group, supervisor=self.supervisor)
        ours, _ = shm_left(self.shm_before, self.sampler.shm_seen)
        self.shm_left = ours
        for name in ours:  # reported; the benchmark leaves nothing
            (Path("/dev/shm") / name).unlink(missing_ok=True)
        if self.ok and not self.args.keep_logs:
            shutil.rmtree(self.plan.work_dir, ignore_errors=True)
        else:
            self.log(f"[restarts] logs kept in {self.plan.work_dir / 'logs'}")


def agg_spec(args: argparse.Namespace) -> GraphSpec:
    return load_graph(resolve_graph_path(args.graph))


def requests_report(results: list[RequestResult], sent: int) -> dict[str, Any]:
    counts = summarize(results, sent)
    return {k: counts[k] for k in ("sent", "completed", "failed", "truncated", "unfinished", "examples")}


def case_rolling(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Both workers, one at a time, under load (what `graph restart --all` does)."""
    with LoadedGraph(agg_spec(args), args, log) as g:
        load = g.start_load(seed=1)
        moved = migrations(g.plan.url)
        t0 = time.monotonic()
        steps = g.restart.run([p.name for p in g.plan.workers])
        t1 = time.monotonic()
        migrated = migrations(g.plan.url) - moved
        results = g.stop_load()
        during = [r for r in results if r.end >= t0 and r.start <= t1]
        before = [r for r in results if r.end < t0]
        out = {
            "steps": [dataclasses.asdict(s) for s in steps],
            "total_s": round(t1 - t0, 1),
            "migrated": migrated,
            "requests": requests_report(results, load.sent),
            "stall_ms_before": ms([r.max_gap_s for r in before]),
            "stall_ms_during": ms([r.max_gap_s for r in during]),
            "ttft_ms_before": ms([r.first_token_s for r in before if r.first_token_s is not None]),
            "ttft_ms_during": ms([r.first_token_s for r in during if r.first_token_s is not None]),
            "leaks": g.leaks(),
        }
        g.ok = case_ok(out)
    out["shm_left"] = g.shm_left
    out["ok"] = case_ok(out)
    return out


def _running_at_stop(log_path: Path) -> int | None:
    found = re.findall(r"stopping: out of discovery; (\d+) request", log_path.read_text(errors="replace"))
    return int(found[-1]) if found else None


def case_drain(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """A draining worker against one that migrates at once, stopped in turn under one load."""
    spec = agg_spec(args)
    base = spec.workers[0]
    workers = (
        dataclasses.replace(base, name="drain", replicas=1, env={**base.env}),
        dataclasses.replace(base, name="migrate", replicas=1, env={**base.env, GRACE_ENV: "0"}),
    )
    spec = dataclasses.replace(spec, workers=workers)
    stops: list[dict[str, Any]] = []
    with LoadedGraph(spec, args, log) as g:
        load = g.start_load(seed=2)
        logs = {p.name: p.log_path for p in g.group if p.name.startswith("worker:")}
        for sample in range(args.samples):
            for name in alternated(["worker:drain-0", "worker:migrate-0"], sample):
                time.sleep(args.before_restart_s)
                moved = migrations(g.plan.url)
                at = time.monotonic()
                step = g.restart.restart_worker(name)
                stops.append(
                    {
                        "mode": name.removeprefix("worker:").removesuffix("-0"),
                        "at": at,
                        "stop_s": round(step.stop_s, 2),
                        "back_s": round(step.back_s, 1),
                        "exit_code": step.exit_code,
                        "running_at_stop": _running_at_stop(logs[name]),
                        "migrated": migrations(g.plan.url) - moved,
                    }
                )
        results = g.stop_load()
        for stop in stops:  # the streams that were running when the stop began
            at = stop.pop("at")
            running = [r for r in results if r.start <= at <= r.end]
            stop["longest_stall_ms"] = round(1000 * max((r.max_gap_s for r in running), default=0.0), 1)
        out: dict[str, Any] = {"stops": stops, "requests": requests_report(results, load.sent), "leaks": g.leaks()}
        for mode in ("drain", "migrate"):
            mine = [s for s in stops if s["mode"] == mode]
            out[mode] = {
                "stops": len(mine),
                "running_at_stop": sum(s["running_at_stop"] or 0 for s in mine),
                "migrated": sum(s["migrated"] for s in mine),
                "stop_s_median": spread(s["stop_s"] for s in mine)["median"],
                "longest_stall_ms_median": spread(s["longest_stall_ms"] for s in mine)["median"],
                "longest_stall_ms_max": max((s["longest_stall_ms"] for s in mine), default=None),
            }
        g.ok = case_ok(out)
    out["shm_left"] = g.shm_left
    out["ok"] = case_ok(out)
    return out


def _kill_worker(g: LoadedGraph, name: str, timeout_s: float) -> dict[str, Any]:
    """SIGKILL worker `name`'s tree; seconds until its instance is no longer listed, and until
    a new instance of it is (back after its restart and warm-up)."""
    url = g.plan.url
    old = g.view.instance_of(name)
    pid = g.view.pid(name)
    if old is None or pid is None or old not in frontend_instances(url):
        raise RuntimeError(f"{name} is not serving before its kill")
    moved = migrations(url)
    killed = time.monotonic()
    procs.signal_tree(pid, signal.SIGKILL)
    gone = wait_for(lambda: old not in frontend_instances(url), timeout_s, 0.05)
    migrated_while_listed = migrations(url) - moved

    def back() -> bool:
        new = g.view.instance_of(name)
        return new is not None and new != old and new in frontend_instances(url)

    wait_for(back, 600, 0.5)
    return {
        "worker": name,
        "out_of_routing_s": None if gone is None else round(gone, 2),
        "migrated_while_listed": migrated_while_listed,
        "back_s": round(time.monotonic() - killed, 1),
    }


def case_dead(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Workers SIGKILLed under load: how soon the frontend stops routing to them."""
    with LoadedGraph(agg_spec(args), args, log) as g:
        load = g.start_load(seed=4)
        names = [p.name for p in g.plan.workers]
        kills = []
        for sample in range(args.samples * len(names)):
            time.sleep(args.before_restart_s)
            kills.append(_kill_worker(g, names[sample % len(names)], 120.0))
            log(f"[restarts] dead: {kills[-1]}")
        unaided: dict[str, Any] | None = None
        if args.dead_baseline:
            time.sleep(args.before_restart_s)
            on_death, g.supervisor.on_death = g.supervisor.on_death, None  # no removal: the file store's expiry
            try:
                unaided = _kill_worker(g, names[0], 600.0)
            finally:
                g.supervisor.on_death = on_death
            log(f"[restarts] dead, without the graph's removal: {unaided}")
        results = g.stop_load()
        gone = [k["out_of_routing_s"] for k in kills if k["out_of_routing_s"] is not None]
        out: dict[str, Any] = {
            "kills": kills,
            "out_of_routing_s": {**spread(gone), "not_out_within_120_s": len(kills) - len(gone)},
            "without_removal": unaided,
            "requests": requests_report(results, load.sent),
            "leaks": g.leaks(),
        }
        g.ok = case_ok(out)
    out["shm_left"] = g.shm_left
    out["ok"] = case_ok(out)
    return out


def case_frontend(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """The frontend SIGKILLed under load; its successor's routing and the pool's credit."""
    with LoadedGraph(agg_spec(args), args, log) as g:
        view = g.view
        writer = g.plan.workers[0].name
        writer_id = view.instance_of(writer)
        pool_only = [view.probe_prompt(POOL_PROMPT_TOKENS) for _ in range(args.credit_probes)]
        for prompt in pool_only:  # computed on one worker, stored in the pool
            if view.ask(prompt, writer_id) is None:
                raise RuntimeError("a prompt for the credit probes was not served")
        g.restart.restart_worker(writer)  # its cache is gone: only the pool holds them now
        blocks = POOL_PROMPT_TOKENS // BLOCK_TOKENS
        frontend = view.process("frontend")
        assert frontend is not None
        load = g.start_load(seed=3, retry_refused_s=120.0)
        time.sleep(args.before_restart_s)
        seen = len(selections(frontend.log_path))
        pid = view.pid("frontend")
        assert pid is not None
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        want = len(g.plan.workers)
        serving = wait_for(lambda: len(frontend_instances(g.plan.url)) >= want, 120, 0.05)
        credit: float | None = None
        probes = 0
        while credit is None and probes < len(pool_only) and time.monotonic() - killed < 120:
            view.ask(pool_only[probes], None)
            probes += 1
            lines = selections(frontend.log_path)[seen:]
            seen += len(lines)
            if any(int(s.get("host_pinned_blocks") or 0) >= blocks for s in lines):
                credit = time.monotonic() - killed
            else:
                time.sleep(0.2)
        # A planned restart (`graph restart frontend`: SIGTERM) under the same load.
        time.sleep(args.before_restart_s)
        refused_before = load.refused
        planned = time.monotonic()
        step = g.restart.restart_frontend()
        results = g.stop_load()
        bad = [r for r in results if r.outcome != COMPLETED and r.end < planned]
        cut = [r for r in bad if r.status == 200 and r.start < killed]
        reset = [r for r in bad if r.status is None and r.end - killed < 5]
        unknown_model = [r for r in bad if r.status == 404 and r.start > killed]
        served_after = [r.end - killed for r in results if r.outcome == COMPLETED and r.start > killed]
        planned_bad = [r for r in results if r.outcome != COMPLETED and r.end >= planned]
        out = {
            "requests": requests_report(results, load.sent),
            "lost_streams_cut": len(cut),
            "lost_connections_reset": len(reset),
            # the successor answers 404 between opening its port and committing the model it discovered
            "not_found_from_the_successor": len(unknown_model),
            "lost_otherwise": len(bad) - len(cut) - len(reset) - len(unknown_model),
            "planned_stop_s": round(step.stop_s, 2),
            "planned_back_s": round(step.back_s, 2),
            "planned_exit_code": step.exit_code,
            # the stopping frontend answers 503 (not ready) while it drains; its successor 404 at first
            "planned_not_ready": sum(r.status == 503 for r in planned_bad),
            "planned_lost_not_found": sum(r.status == 404 for r in planned_bad),
            "planned_lost_otherwise": sum(r.status not in (404, 503) for r in planned_bad),
            "planned_refused_and_retried": load.refused - refused_before,
            "refused_and_retried": load.refused,
            "serving_again_s": None if serving is None else round(serving, 2),
            "first_request_served_s": round(min(served_after), 2) if served_after else None,
            "pool_credit_s": None if credit is None else round(credit, 2),
            "credit_probes": probes,
            "leaks": g.leaks(),
        }
        g.ok = case_ok(out)
    out["shm_left"] = g.shm_left
    out["ok"] = case_ok(out)
    return out


def case_ok(out: dict[str, Any]) -> bool:
    req = out["requests"]
    leaks = out.get("leaks") or {}
    if "lost_streams_cut" in out:  # the frontend case: only what was on the killed frontend
        lost_ok = out["lost_otherwise"] == 0 and out["planned_lost_otherwise"] == 0 and out["pool_credit_s"] is not None
    else:
        lost_ok = req["failed"] == 0 and req["truncated"] == 0
    if "kills" in out:  # the dead case: every kill out of routing
        lost_ok = lost_ok and out["out_of_routing_s"]["not_out_within_120_s"] == 0
    return bool(
        lost_ok
        and req["unfinished"] == 0
        and leaks.get("drained_s") is not None
        and not leaks.get("unaccounted_bytes")
        and not out.get("shm_left")
    )


CASES: dict[str, Callable[[argparse.Namespace, Callable[[str], None]], dict[str, Any]]] = {
    "rolling": case_rolling,
    "drain": case_drain,
    "dead": case_dead,
    "frontend": case_frontend,
}


def format_cases(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    for case, out in results.items():
        req = out.get("requests") or {}
        lines.append(
            f"\n[{case}] requests: sent {req.get('sent')}, completed {req.get('completed')}, failed "
            f"{req.get('failed')}, truncated {req.get('truncated')}; after the load: pinned "
            f"{(out.get('leaks') or {}).get('pinned')}, reserved {(out.get('leaks') or {}).get('reserved')}; "
            f"/dev/shm left {out.get('shm_left') or 'none'}; {'ok' if out.get('ok') else 'FAILED'}"
        )
        if "error" in out:
            lines.append(f"  error: {out['error']}")
        if case == "rolling" and "steps" in out:
            for s in out["steps"]:
                lines.append(
                    f"  {s['name']}: stopped in {s['stop_s']:.1f} s (exit code {s['exit_code']}), back and warm "
                    f"in {s['back_s']:.1f} s"
                )
            lines.append(
                f"  both workers in {out['total_s']} s; requests migrated: {out['migrated']:.0f}; longest stall of "
                f"a stream (ms, min/median/max): before {_mmm(out['stall_ms_before'])}, during "
                f"{_mmm(out['stall_ms_during'])}; TTFT before {_mmm(out['ttft_ms_before'])}, during "
                f"{_mmm(out['ttft_ms_during'])}"
            )
        elif case == "drain" and "drain" in out:
            for mode in ("drain", "migrate"):
                m = out[mode]
                lines.append(
                    f"  {mode:>7}: {m['stops']} stops, {m['running_at_stop']} requests running at them, "
                    f"{m['migrated']:.0f} migrated; stop took {m['stop_s_median']} s (median); longest stall of "
                    f"a stream running at the stop: median {m['longest_stall_ms_median']} ms, max "
                    f"{m['longest_stall_ms_max']} ms"
                )
        elif case == "dead" and "kills" in out:
            gone = out["out_of_routing_s"]
            lines.append(
                f"  {len(out['kills'])} kills: out of routing after {gone['min']} / {gone['median']} / "
                f"{gone['max']} s (min/median/max; {gone['not_out_within_120_s']} not within 120 s); requests "
                f"migrated while it was listed: {sum(k['migrated_while_listed'] for k in out['kills']):.0f}"
            )
            if out["without_removal"] is not None:
                u = out["without_removal"]
                lines.append(
                    f"  without the graph's removal (the file store's expiry): out of routing after "
                    f"{u['out_of_routing_s']} s, {u['migrated_while_listed']:.0f} requests migrated meanwhile"
                )
        elif case == "frontend" and "serving_again_s" in out:
            lines.append(
                f"  lost on the killed frontend: {out['lost_streams_cut']} streams cut, "
                f"{out['lost_connections_reset']} connections reset as it went down; by its successor: "
                f"{out['not_found_from_the_successor']} answered 404 before it knew the model; otherwise "
                f"{out['lost_otherwise']}; {out['refused_and_retried']} refused connections retried"
            )
            lines.append(
                f"  serving again {out['serving_again_s']} s after the kill (first load request served "
                f"{out['first_request_served_s']} s); pool credit again after {out['pool_credit_s']} s "
                f"({out['credit_probes']} probes)"
            )
            lines.append(
                f"  planned restart (SIGTERM): stopped in {out['planned_stop_s']} s (exit code "
                f"{out['planned_exit_code']}), serving again {out['planned_back_s']} s later; lost: "
                f"{out['planned_not_ready']} answered 503 (not ready) while it drained, "
                f"{out['planned_lost_not_found']} answered 404 before it knew the model, otherwise "
                f"{out['planned_lost_otherwise']}; {out['planned_refused_and_retried']} refused connections retried"
            )
    return "\n".join(lines)


def _mmm(v: dict[str, float | None]) -> str:
    return "/".join("-" if x is None else f"{x:.0f}" for x in (v["min"], v["median"], v["max"]))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """These cases' own options (the load's size and --model, --graph, --concurrency, --max-tokens,
    --json are the benchmark's)."""
    ap.add_argument("--prefix-tokens", type=int, default=768, help="rolling..frontend: shared prefix length")
    ap.add_argument("--prefixes", type=int, default=40, help="rolling..frontend: distinct shared prefixes")
    ap.add_argument("--samples", type=int, default=2, help="stops (drain) or kills (dead) of each worker")
    ap.add_argument(
        "--no-dead-baseline",
        dest="dead_baseline",
        action="store_false",
        help="dead: skip the kill without the graph's removal (it waits for the file store's expiry)",
    )
    ap.add_argument("--before-restart-s", type=float, default=5.0, help="seconds of load before each restart")
    ap.add_argument("--after-restart-s", type=float, default=5.0, help="seconds of load after the last restart")
    ap.add_argument("--credit-probes", type=int, default=60, help="frontend: pool-only prompts")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--keep-logs", action="store_true", help="keep each case's graph logs")


def run_case(name: str, args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Case `name` on a graph of its own; a case that could not run reports its error."""
    log(f"[restarts] case {name}")
    try:
        return CASES[name](args, log)
    except (RuntimeError, OSError, ControlError) as exc:
        return {"error": str(exc).splitlines()[0], "ok": False}
