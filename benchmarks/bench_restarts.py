#!/usr/bin/env python3
"""Restarts under load: what restarting a part of a running graph costs its users.

Starts `graphs/agg.yaml` (nats-server, the pool, two Maru workers, Dynamo's frontend with the KV
router) through the graph runner (`graphs/run.py`: build_plan, start_graph, supervise, stop_graph)
with its default supervision, sends steady streaming load (chaos/load.py: every request asks for
a known number of tokens, so a cut response is seen), and runs the cases of `--cases` one after
the other while the load goes on. Each case is one function (`CASES`) that takes the running
`Bench` and returns its figures; what every case reports besides is what users saw while it
ran (requests completed, failed, truncated, the slowest one).

* ``pool-warm`` - the pool is filled to `--chunks` chunks (the load's own, plus filler chunks
  in the model's namespace with the engine's chunk metadata and `--filler-bytes` payloads, so
  the relays announce them as they would real ones); then the pool service is SIGKILLed and the
  graph's supervision starts it again on the same region, where it recovers what the region
  holds (a warm restart). Reported: the index rebuild (the new service's own recovery time), the
  time until the pool answers again and until every worker's relay resynced, the share of the
  chunks committed before the kill that the new service serves again (each one pinned and its
  payload checked against its checksum by a reader that requires one), probe prompts computed
  on one worker before the kill that the other worker then loads from the pool (cached tokens,
  and the same greedy tokens as the first worker's local prefix-cache hit), corrupt reads (the
  pool's counter over both incarnations).

At the end, once the load drained: requests sent / completed / failed / truncated over the whole
run, and the pool's pins and reservations (none may be left). Loopback only; bounded by
`--max-duration`; stops every process it started. `--json FILE` writes the figures.

The cases of worker and frontend restarts each run a graph of their own after that (what they
measure needs a graph of their own: a worker that migrates at once, kills without the graph's
help), with what each lost and leaked (`benchmarks/chaos/restarts.py`):

* ``rolling``  - `graph restart --all` under load: each worker's stop and return, migrations;
* ``drain``    - a draining worker's stop against one that migrates at once;
* ``dead``     - workers SIGKILLed: seconds until the frontend no longer routes to them;
* ``frontend`` - the frontend SIGKILLed, then restarted as planned: requests lost, seconds until
  it serves and until its router credits the pool again.

Usage: python benchmarks/bench_restarts.py [--cases pool-warm,rolling,drain,dead,frontend]
       [--chunks 100000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from chaos import procs, restarts  # noqa: E402 - benchmarks/ is not a package
from chaos.graph import POOL, GraphView, cached_tokens, wait_for  # noqa: E402
from chaos.load import LoadConfig, LoadGenerator, RequestResult, summarize  # noqa: E402
from chaos.samplers import Sampler  # noqa: E402
from chaos_soak import drain  # noqa: E402
from harness import write_json  # noqa: E402

PROBES = 4  # probe prompts per pool-warm case
PROBE_CHUNKS = 2  # whole chunks per probe prompt (plus one token)


@dataclasses.dataclass
class Bench:
    """The running graph, its load and what watches it; what every case works with."""

    args: argparse.Namespace
    plan: Any  # graphs.run.Plan
    group: Any  # ProcessGroup
    view: GraphView
    sampler: Sampler
    load: LoadGenerator
    chunk_tokens: int
    log: Callable[[str], None] = print

    def results_between(self, start: float, end: float) -> list[RequestResult]:
        """Requests in flight at any moment between `start` and `end` (time.monotonic())."""
        return [r for r in list(self.load.results) if r.end >= start and r.start <= end]


# -- the cases -----------------------------------------------------------------------------------
def case_pool_warm(b: Bench) -> dict[str, Any]:
    """SIGKILL the pool service with `--chunks` chunks in it; the graph starts it again warm."""
    from maru_vllm.pool import PoolClient

    out: dict[str, Any] = {}
    ns, block_size = _model_namespace(b)
    t0 = time.monotonic()
    with PoolClient.connect(b.view.pool_address, write_checksum=True, timeout=60) as c:
        have = c.stats()["objects"]
        out["filler_chunks"] = _fill(c, ns, block_size, b.chunk_tokens, max(0, b.args.chunks - have), b.args)
        out["fill_s"] = round(time.monotonic() - t0, 1)
    probes = _store_probes(b)
    time.sleep(2.0)  # stores are write-behind: committed just after the answers
    before, stats = _pool_keys(b.view.pool_address)
    out["chunks_before"] = len(before)
    incarnation = stats["incarnation"]
    synced_before = _relay_syncs(b)
    pid = b.view.pid(POOL)
    assert pid is not None, "the pool is not running"
    b.log(f"[restarts] pool-warm: {len(before)} chunks in the pool; SIGKILL of the pool (pid {pid})")
    kill = time.monotonic()
    procs.signal_tree(pid, signal.SIGKILL)
    back: dict[str, Any] = {}

    def answers() -> bool:
        now = b.view.pool_stats(timeout=1.0)
        if now is None or now.get("incarnation") == incarnation:
            return False
        back.update(now)
        return True

    out["pool_back_s"] = _round(wait_for(answers, b.args.recovery_timeout, 0.1))
    if not back:
        out["error"] = "the pool did not come back"
        return out
    out["index_rebuild_s"] = back.get("recovery_seconds")
    out["recovered_objects"] = back.get("recovered_objects")
    out["recovery_dropped"] = back.get("recovery_dropped")
    out["last_stop"] = back.get("last_stop")
    after, _ = _pool_keys(b.view.pool_address)
    out["chunks_listed_again"] = len(before & after)
    read = _read_back(b.view.pool_address, before, after)
    out["chunks_hit_again"] = read["verified"]
    out["share_hit_again"] = round(read["verified"] / max(1, len(before)), 4)
    out["read_back_invalid"] = read["invalid"]
    out["read_back_s"] = read["seconds"]
    resynced = wait_for(lambda: _relay_syncs(b) > synced_before, b.args.recovery_timeout, 0.5)
    out["relays_resynced_s"] = None if resynced is None else round(time.monotonic() - kill, 2)
    out["probes"] = _ask_probes(b, probes)
    out["window"] = (kill, time.monotonic())
    return out


CASES: dict[str, Callable[[Bench], dict[str, Any]]] = {"pool-warm": case_pool_warm}  # on the shared graph
ALL_CASES = (*CASES, *restarts.CASES)  # restarts.CASES: each on a graph of its own


# -- pool-warm's parts ---------------------------------------------------------------------------
def _model_namespace(b: Bench) -> tuple[str, int]:
    """The namespace and block size of the chunks the workers stored (the load's first ones)."""
    from maru_vllm.pool import PoolClient, chunk_codec

    def found() -> tuple[str, int] | None:
        with PoolClient.connect(b.view.pool_address, heartbeat=False) as c:
            for page in c.snapshot_pages(recent=64):
                for o in page.objects:
                    if o.bmeta is not None:
                        return o.namespace, int(chunk_codec.to_builtins(o.bmeta)["block_size"])
        return None

    got = None
    deadline = time.monotonic() + 120
    while got is None and time.monotonic() < deadline:
        got = found()
        time.sleep(1.0)
    if got is None:
        raise RuntimeError("the workers stored no chunk within 120 s")
    return got


def _fill(c: Any, ns: str, block_size: int, chunk_tokens: int, chunks: int, args: argparse.Namespace) -> int:
    """`chunks` filler chunks of one-chunk prompts no request asks for, as the connector commits them."""
    from maru_vllm.connector.chunks import ChunkGeometry, chunk_key

    g = ChunkGeometry(block_size, chunk_tokens // block_size)
    payload = random.Random(7).randbytes(args.filler_bytes)
    stored, batch = 0, []

    def flush() -> None:
        nonlocal stored
        res = c.reserve([(k, len(payload)) for k, _, _ in batch], ns)
        for r in res:
            if r is not None:
                r.buffer[:] = payload
        live = [(r, m, p) for r, (_, m, p) in zip(res, batch) if r is not None]
        stored += sum(c.commit([r for r, _, _ in live], [m for _, m, _ in live], [p for _, _, p in live]))
        batch.clear()

    rng = random.Random(11)
    for i in range(chunks):
        hashes = [hashlib.blake2b(b"filler/%d/%d" % (i, k), digest_size=32).digest() for k in range(g.blocks_per_chunk)]
        tokens = [rng.randrange(32, 127) for _ in range(chunk_tokens)]
        batch.append(
            (
                chunk_key(g.chunk_hash(hashes, 0), 0),
                g.chunk_meta(hashes, tokens, 0, None),
                [chunk_key(h, 0) for h in g.part_hashes(hashes, 0)],
            )
        )
        if len(batch) >= 500:
            flush()
    if batch:
        flush()
    return stored


def _pool_keys(address: str) -> tuple[set[tuple[str, str]], dict[str, Any]]:
    """Every (namespace, key) the pool holds now, and its stats."""
    from maru_vllm.pool import PoolClient

    with PoolClient.connect(address, heartbeat=False, timeout=60) as c:
        keys = {(o.namespace, o.key) for page in c.snapshot_pages() for o in page.objects}
        return keys, c.stats()


def _read_back(address: str, before: set[tuple[str, str]], after: set[tuple[str, str]]) -> dict[str, Any]:
    """Every chunk committed before the kill, pinned on the restarted pool by a client that
    requires and verifies each payload's checksum: `verified` were read back intact, `invalid`
    were listed again but failed the reader's check (the pool counts those as corrupt reads)."""
    from maru_vllm.pool import PoolClient

    by_ns: dict[str, list[str]] = {}
    for ns, key in before:
        by_ns.setdefault(ns, []).append(key)
    verified = invalid = 0
    t = time.monotonic()
    with PoolClient.connect(address, checksum=True, heartbeat=False, timeout=60) as c:
        for ns, keys in by_ns.items():
            for i in range(0, len(keys), 512):
                batch = keys[i : i + 512]
                pins = c.acquire([bytes.fromhex(k) for k in batch], ns)
                verified += sum(p is not None for p in pins)
                invalid += sum(p is None and (ns, k) in after for p, k in zip(pins, batch))
                c.release(pins)
    return {"verified": verified, "invalid": invalid, "seconds": round(time.monotonic() - t, 2)}


def _relay_syncs(b: Bench) -> int:
    """Resyncs the workers' relays logged, over all workers (this start of each)."""
    return min(
        (p.output().count("synced at seq") for p in b.group.processes if p.name in b.view.worker_names),
        default=0,
    )


def _store_probes(b: Bench) -> list[dict[str, Any]]:
    """Probe prompts computed on the first worker (pinned), each answered greedily."""
    instances = b.view.instances()
    writer = instances[0]
    probes = []
    for _ in range(PROBES):
        prompt = b.view.probe_prompt(PROBE_CHUNKS * b.chunk_tokens + 1)
        out = b.view.ask(prompt, writer)
        probes.append({"prompt": prompt, "writer": writer, "text": _text(out)})
    return probes


def _ask_probes(b: Bench, probes: list[dict[str, Any]]) -> dict[str, Any]:
    """Each probe on the other worker (from the pool) and again on the first (its local hit)."""
    loaded = same = 0
    cached = []
    for p in probes:
        reader = next((i for i in b.view.instances() if i != p["writer"]), None)
        out = b.view.ask(p["prompt"], reader) if reader is not None else None
        local = b.view.ask(p["prompt"], p["writer"])
        tokens = cached_tokens(out) if out else 0
        cached.append(tokens)
        loaded += tokens >= PROBE_CHUNKS * b.chunk_tokens
        same += out is not None and local is not None and _text(out) == _text(local) == p["text"]
    return {"sent": len(probes), "loaded_from_pool": loaded, "same_tokens_as_local_hit": same, "cached": cached}


def _text(out: dict[str, Any] | None) -> str | None:
    return None if out is None else out["choices"][0].get("text")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


# -- the run ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0], allow_abbrev=False)
    ap.add_argument("--cases", default=",".join(ALL_CASES), help=f"comma-separated, of: {', '.join(ALL_CASES)}")
    ap.add_argument("--graph", default="agg", help="graph file or bundled graph name (default: agg)")
    ap.add_argument("--model", help="model (default: the graph's)")
    ap.add_argument("--pool-size", default="2G", help="pool size (default 2G: --chunks filler chunks fit)")
    ap.add_argument("--chunks", type=int, default=100_000, help="chunks in the pool before the pool-warm kill")
    ap.add_argument("--filler-bytes", type=int, default=4096, help="payload bytes of each filler chunk")
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the first case")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds of load after each case")
    ap.add_argument("--max-duration", type=float, default=1200.0, help="seconds of load at most")
    ap.add_argument("--recovery-timeout", type=float, default=180.0)
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    restarts.add_arguments(ap)
    args = ap.parse_args(argv)
    args.case_list = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.case_list if c not in ALL_CASES]
    if unknown or not args.case_list:
        ap.error(f"--cases {args.cases!r}: use a comma-separated list of {', '.join(ALL_CASES)}")
    for name in ("concurrency", "max_tokens", "samples", "credit_probes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: use a number >= 1")
    return args


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    from maru_dynamo.graphs.plan import build_plan, resolve_model
    from maru_dynamo.graphs.run import new_work_dir, start_graph, stop_graph, supervise
    from maru_dynamo.graphs.spec import load_graph, resolve_graph_path
    from maru_vllm.launch import ProcessGroup
    from maru_vllm.pool.region import parse_size

    spec = load_graph(resolve_graph_path(args.graph))
    spec = dataclasses.replace(spec, pool=dataclasses.replace(spec.pool, size=parse_size(args.pool_size)))
    model = resolve_model(args.model or spec.model)
    work_dir = new_work_dir()
    plan = build_plan(spec, model=model, work_dir=work_dir)
    group = ProcessGroup()
    view = GraphView(plan, group)
    sampler = Sampler(view)
    supervision = supervise(plan, group, out=log)
    report: dict[str, Any] = {"graph": spec.source, "model": model, "pool_size": spec.pool.size, "cases": {}}
    load = LoadGenerator(
        LoadConfig(
            url=plan.url,
            model=model,
            concurrency=args.concurrency,
            duration_s=args.max_duration,
            max_duration_s=args.max_duration,
            max_tokens=args.max_tokens,
        ),
        on_progress=lambda line: log(f"[restarts] load {line}"),
    )
    thread = threading.Thread(target=lambda: asyncio.run(load.run()), name="restarts-load", daemon=True)
    try:
        t = time.monotonic()
        start_graph(plan, group, supervisor=supervision)
        report["startup_s"] = round(time.monotonic() - t, 1)
        supervision.start()
        sampler.start()
        thread.start()
        bench = Bench(args, plan, group, view, sampler, load, spec.pool.chunk_tokens, log)
        time.sleep(args.warmup)
        for name in args.case_list:
            log(f"[restarts] case {name}")
            t_case = time.monotonic()
            try:
                figures = CASES[name](bench)
            except Exception as exc:  # the case failed: reported, and the run goes on to stop cleanly
                figures = {"error": f"{type(exc).__name__}: {exc}"}
            time.sleep(args.settle)
            window = figures.pop("window", (t_case, time.monotonic()))
            seen = bench.results_between(window[0], time.monotonic())
            figures["load"] = summarize(seen, len(seen)) | {
                "slowest_s": round(max((r.end - r.start for r in seen), default=0.0), 2)
            }
            report["cases"][name] = figures
            log(f"[restarts] {name}: {json.dumps(figures, default=str)}")
        load.stop()
        thread.join(timeout=args.drain_timeout + 120)
        report["requests"] = summarize(load.results, load.sent)
        report["drain"] = drain(view, args.drain_timeout)
        sampler.sample()
        report["pool_counters"] = sampler.pool_totals()
    finally:
        load.stop()
        sampler.stop()
        stop_graph(group, supervisor=supervision)
        report["supervision"] = {n: supervision.restarts(n) for n in view.names()}
    report["ok"] = verdict(report)
    if report["ok"]:
        shutil.rmtree(work_dir, ignore_errors=True)
    else:
        report["logs"] = str(work_dir / "logs")
    return report


def verdict(report: dict[str, Any]) -> bool:
    req, drained = report.get("requests") or {}, report.get("drain") or {}
    return bool(
        req.get("sent")
        and req.get("completed") == req.get("sent")
        and drained.get("drained_s") is not None
        and not drained.get("unaccounted_bytes")
        and not (report.get("pool_counters") or {}).get("corrupt_reads")
        and all("error" not in c and not c.get("read_back_invalid") for c in report["cases"].values())
    )


def format_report(report: dict[str, Any]) -> str:
    lines = [f"[restarts] graph {report['graph']}, model {report['model']}, pool {report['pool_size'] >> 20} MiB"]
    pw = report["cases"].get("pool-warm")
    if pw:
        pr = pw.get("probes") or {}
        lines += [
            f"pool-warm: {pw.get('chunks_before')} chunks in the pool ({pw.get('filler_chunks')} filler, "
            f"filled in {pw.get('fill_s')} s); SIGKILL -> the pool answers again in {pw.get('pool_back_s')} s",
            f"  index rebuilt in {pw.get('index_rebuild_s')} s (target <= 5 s): {pw.get('recovered_objects')} objects "
            f"recovered, {pw.get('recovery_dropped')} dropped; last stop {pw.get('last_stop')}",
            f"  committed chunks read back intact (checksum verified): {pw.get('chunks_hit_again')} of "
            f"{pw.get('chunks_before')} = {100 * (pw.get('share_hit_again') or 0):.2f}% (target >= 95%); "
            f"listed again {pw.get('chunks_listed_again')}, listed but invalid {pw.get('read_back_invalid')} "
            f"(read back in {pw.get('read_back_s')} s)",
            f"  every worker's relay resynced {pw.get('relays_resynced_s')} s after the kill",
            f"  probes: {pr.get('loaded_from_pool')}/{pr.get('sent')} loaded from the pool on the other worker, "
            f"{pr.get('same_tokens_as_local_hit')}/{pr.get('sent')} with the local hit's tokens",
        ]
    for name, c in report["cases"].items():
        if name not in CASES:
            continue  # a case on a graph of its own: restarts.format_cases
        ld = c.get("load") or {}
        lines.append(
            f"{name}: requests during the case: {ld.get('sent')} ({ld.get('completed')} completed, {ld.get('failed')} "
            f"failed, {ld.get('truncated')} truncated; slowest {ld.get('slowest_s')} s)"
        )
    req = report.get("requests") or {}
    d = report.get("drain") or {}
    c = report.get("pool_counters") or {}
    lines += [
        f"requests: sent {req.get('sent')}, completed {req.get('completed')}, failed {req.get('failed')}, "
        f"truncated {req.get('truncated')} (target 0 failed, 0 truncated)",
        f"pool: corrupt reads {c.get('corrupt_reads')} (target 0) over {c.get('incarnations')} incarnations; after "
        f"drain: pinned {d.get('pinned')}, pins {d.get('pins')}, reserved {d.get('reserved')}, unaccounted bytes "
        f"{d.get('unaccounted_bytes')}",
        f"verdict: {'ok' if report['ok'] else 'FAILED'}" + (f" (logs {report['logs']})" if "logs" in report else ""),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = lambda line: print(line, flush=True)  # noqa: E731
    shared = [c for c in args.case_list if c in CASES]
    report: dict[str, Any] = (
        run(argparse.Namespace(**{**vars(args), "case_list": shared}), log) if shared else {"cases": {}}
    )
    own = {c: restarts.run_case(c, args, log) for c in args.case_list if c in restarts.CASES}
    report["cases"].update(own)
    report["ok"] = report.get("ok", True) and all(r.get("ok") for r in own.values())
    if shared:
        print(format_report(report), flush=True)
    if own:
        print(restarts.format_cases(own), flush=True)
    if args.json:
        write_json(args.json, report, sort_keys=True, default=str)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
