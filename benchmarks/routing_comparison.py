#!/usr/bin/env python3
"""Routing comparison on a prefix-sharing chat workload: round-robin vs. KV routing on the
engines' own KV events vs. KV routing that also sees the Maru pool.

Four configurations, each a fresh graph run by `graphs/run.py` (`graph_spec`: the frontend, two
workers, each pinned to a core of its own, and a pool service where the workers use one; one
nats-server shared by all):

* ``round-robin`` - ``--router-mode round-robin`` over Maru workers: the pool alone, with a
  router that knows nothing about prefixes.
* ``kv-gpu``      - ``--router-mode kv`` over plain ``dynamo.vllm`` workers (vLLM prefix caching,
  no pool): Dynamo's KV routing as it is, on the engines' device KV events only.
* ``kv-gpu+pool`` - ablation: Maru workers started with ``--no-maru-pool-events``, so every engine
  can load what another stored, but the router sees device events only.
* ``kv-pool``     - ``--router-mode kv`` with ``--router-host-cache-hit-weight`` =
  ``maru_vllm.routing.POOL_TIER_WEIGHT``; the Maru workers announce the pool's blocks at the host tier.

Workload (``maru_vllm.fixtures.workload``; the defaults below are what the e2e test runs): two system
prompts of 1024 tokens, one popular (six of seven sessions: ``--hot-sessions 4``) and one
niche, three turns per session (user 256, fixed assistant reply 128 tokens), requests sent in a
fixed order, turn by turn across the sessions.

Sending. Each request is a streaming completion; the next one is routed only after the
previous one's prefill is done (its worker counted the prompt tokens) and ``--settle-s`` has
passed, so its KV and pool events have reached the router. ``--window W`` holds the W-1
previous requests in flight (they decode until the client cancels them): Dynamo's router adds a
request's prompt blocks to its worker's load when it routes it and removes them when it ends,
so in-flight requests are the only load it can weigh. With ``--window 1`` every request ends
before the next one is routed and the router weighs cache hits alone. The decodes are cheap on
purpose: engines hand their output over every STREAM_INTERVAL tokens, and each worker's whole
process tree is pinned to its core (unpinned, a decoding vLLM CPU engine's busy-waiting queues
take a second core and starve the other worker).

Routing is deterministic given the order, up to ties: the router's inputs (cached blocks from
events, prompt blocks in flight) do not depend on timing once each prefill is waited for, but
when both workers cost the same (the first request; later, whenever both hold the prefix and
the same load) Dynamo picks between random instance ids. Token counts were identical in every
run here; placements move by a request or two with the ties (see the findings).

Measured per configuration, from the workers' own counters (each worker's /metrics on its
``DYN_SYSTEM_PORT``, read after each request's prefill; one prefill runs at a time, so the
change belongs to that request):

* prefill tokens computed = ``vllm:prompt_tokens_by_source_total{source="local_compute"}``;
  a request's cached tokens = ``local_cache_hit`` + ``external_kv_transfer`` (what vLLM reports
  as ``usage.prompt_tokens_details.cached_tokens``);
* pool-loaded tokens = ``{source="external_kv_transfer"}`` summed over the workers;
* requests per worker: whose prompt counter grew; spread = max - min.

Findings on the tiny model (2-core CPU machine, measured 2026-11-29), default workload
(21 requests, 34944 prompt tokens, 9216 in its prefix tree = what an ideal shared cache computes);
two runs, which differ only in how ties fell::

    --window 3      prefill computed  pool-loaded  req/worker (run 1 | run 2)  spread
    round-robin                10112         5632        11/10 | 11/10         1 | 1
    kv-gpu                     11136            0         15/6 | 6/15          9 | 9
    kv-gpu+pool                 9344  1536 | 1792         4/17 | 15/6         13 | 9
    kv-pool                     9216  1792 | 1536        10/11 | 12/9          1 | 3

* ``kv-pool`` computes 0.911 of round-robin's prefill tokens and 0.828 of ``kv-gpu``'s, and it
  reaches the prefix tree's lower bound (9216): every shared prefix is computed once.
* GPU-only KV routing piles the popular prompt's sessions on the worker that holds it and moves a
  request only when that worker's load outweighs a full recompute of the prompt elsewhere; each
  move recomputes it (``kv-gpu``), or, with the pool underneath, loads it but the router still
  moves too late (``kv-gpu+pool``: 15 to 17 of 21 on one worker). With the pool's blocks credited at
  the host tier, moving costs the router only the prompt's tail, so ``kv-pool`` balances 10/11 or 12/9.
* Round-robin balances perfectly but moves every session every turn; each move loses the
  pool's sub-chunk tail (chunks are 256 tokens, vLLM blocks 128).

With one request at a time (``--window 1``) the router has no load to weigh: every KV
configuration sends each request to the worker with the longest cached prefix and computes the
9216 tokens of the prefix tree, and nearly everything lands on one worker (measured: kv-gpu 18/3,
kv-gpu+pool 21/0, kv-pool 0/21; round-robin 10112 tokens, 10/11). A pool block (credited 0.97
of a device block) never outweighs the device copy on the worker that computed it, so pool
events change nothing there; they pay off when requests are in flight.

Usage: python benchmarks/routing_comparison.py [--window 3] [--sessions 7 --hot-sessions 4 ...]
                                               [--configs kv-gpu,kv-pool] [--routes] [--json]

Size: one benchmark: its workload, the graph per configuration and the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from maru_dynamo.graphs import plan as graph_plan  # noqa: E402
from maru_dynamo.graphs import run as graph_run  # noqa: E402
from maru_dynamo.graphs.client import Stream  # noqa: E402
from maru_dynamo.graphs.spec import parse_graph  # noqa: E402
from maru_vllm.fixtures.workload import Workload, WorkloadSpec, build_workload  # noqa: E402
from maru_vllm.launch import (  # noqa: E402
    ManagedProcess,
    ProcessGroup,
    stack,
)
from maru_vllm.launch.engine_metrics import EngineCounters, read_counters, running_requests  # noqa: E402
from maru_vllm.routing import POOL_TIER_WEIGHT  # noqa: E402

CHUNK_TOKENS = 256
MAX_MODEL_LEN = 8192  # the fixture models' position limit: room for long decodes (--window > 1)
STREAM_INTERVAL = 256
# The workload and window the e2e test runs (and the CLI's defaults): a popular system prompt shared by
# six of seven sessions, one niche one, three turns each, two requests in flight at every decision.
DEFAULT_SPEC = WorkloadSpec(
    systems=2, sessions=7, hot_sessions=4, turns=3, system_tokens=1024, user_tokens=256, assistant_tokens=128, seed=0
)
DEFAULT_WINDOW = 3
MAX_TOKENS = 4  # --window 1: each request finishes on its own right after its prefill
STOP_GRACE_S = 10.0
READY_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    name: str
    router_mode: str
    pool: bool  # Maru workers (MaruKVConnector on the pool) rather than plain dynamo.vllm workers
    pool_events: bool  # workers announce the pool's blocks to the router
    description: str

    def frontend_args(self, host_weight: float) -> list[str]:
        if self.router_mode == "kv" and self.pool_events:
            return ["--router-host-cache-hit-weight", repr(host_weight)]
        return []


CONFIGS: tuple[RoutingConfig, ...] = (
    RoutingConfig("round-robin", "round-robin", True, True, "round-robin; Maru workers (pool loads, router unaware)"),
    RoutingConfig("kv-gpu", "kv", False, False, "KV router on device KV events; plain dynamo.vllm workers (no pool)"),
    RoutingConfig(
        "kv-gpu+pool", "kv", True, False, "KV router on device KV events; Maru workers (pool loads, pool not announced)"
    ),
    RoutingConfig("kv-pool", "kv", True, True, "KV router with the pool's blocks at the host tier"),
)


@dataclasses.dataclass
class RequestRecord:
    index: int
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    worker: int | None  # index of the worker that served it (whose prompt-token counter grew)
    router_line: str = ""  # the frontend's "Selected worker" line, when it logs one

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclasses.dataclass
class ConfigResult:
    config: RoutingConfig
    host_weight: float | None
    requests: list[RequestRecord]
    workers: list[EngineCounters]

    @property
    def prefill_computed(self) -> int:
        return sum(r.computed_tokens for r in self.requests)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.requests)

    @property
    def pool_loaded_tokens(self) -> int:
        return sum(w.external_kv_transfer for w in self.workers)

    @property
    def pool_loaded_chunk_tokens(self) -> int:
        return sum(w.chunks_loaded for w in self.workers) * CHUNK_TOKENS

    @property
    def requests_per_worker(self) -> list[int]:
        """Requests each worker prefilled (vLLM's success counter misses the cancelled ones of --window)."""
        return [sum(1 for r in self.requests if r.worker == i) for i in range(len(self.workers))]

    @property
    def spread(self) -> int:
        """max - min requests per worker (0 = perfectly even)."""
        counts = self.requests_per_worker
        return max(counts) - min(counts)

    @property
    def cv(self) -> float:
        """Coefficient of variation of requests per worker."""
        counts = self.requests_per_worker
        mean = statistics.fmean(counts)
        return statistics.pstdev(counts) / mean if mean else 0.0

    @property
    def metrics_computed(self) -> int:
        return sum(w.local_compute for w in self.workers)

    def as_dict(self) -> dict[str, object]:
        return {
            "config": self.config.name,
            "router_mode": self.config.router_mode,
            "pool": self.config.pool,
            "pool_events": self.config.pool_events,
            "host_weight": self.host_weight,
            "prefill_computed_tokens": self.prefill_computed,
            "prefill_computed_tokens_by_metrics": self.metrics_computed,
            "cached_tokens": self.cached_tokens,
            "pool_loaded_tokens": self.pool_loaded_tokens,
            "pool_loaded_chunk_tokens": self.pool_loaded_chunk_tokens,
            "requests_per_worker": self.requests_per_worker,
            "spread": self.spread,
            "cv": round(self.cv, 4),
            "workers": [dataclasses.asdict(w) for w in self.workers],
            "requests": [dataclasses.asdict(r) | {"computed_tokens": r.computed_tokens} for r in self.requests],
        }


# -- one configuration -----------------------------------------------------------------------------
class WindowError(RuntimeError):
    """A request finished before the next one was routed: the in-flight window was not held."""


def _hold(base_url: str, payload: dict[str, object]) -> Stream:
    """A streaming completion held open (in flight on its worker) until its `close()` cancels it.

    The client reads only the response headers; the engine keeps decoding (``max_tokens`` large,
    ``ignore_eos``) and the router keeps counting the request's blocks as active load until the
    connection is closed, which cancels the request in Dynamo and vLLM.
    """
    stream = Stream(base_url, payload)
    if stream.status != 200:
        body = stream.body(500)
        stream.close()
        raise RuntimeError(f"completion failed: HTTP {stream.status}: {body!r}")
    return stream


def _wait_running(metric_urls: Sequence[str], want: int, name: str, index: int, timeout: float = 10.0) -> None:
    """Until the workers run `want` requests; fewer means one ended early (the window was not held).

    vLLM refreshes the gauge only when its engine steps, so an idle engine may keep showing a
    cancelled request: after `timeout` more than `want` is accepted.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = sum(running_requests(u) for u in metric_urls)
        if got == want:
            return
        if got < want:
            raise WindowError(
                f"[{name}] {got} requests running before request {index}, expected {want}: an "
                f"earlier one finished decoding; raise --max-tokens"
            )
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _selected_lines(frontend: ManagedProcess) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;]*m", "", frontend.log_text())
    return [line for line in text.splitlines() if "Selected worker" in line]


def graph_spec(
    config: RoutingConfig, nats_url: str, *, window: int, workers: int = 2, host_weight: float = POOL_TIER_WEIGHT
) -> dict[str, object]:
    """The graph of `config`: `workers` workers (Maru or plain), each pinned to a core of its own by
    the runner, on the shared nats-server `nats_url`.

    Window > 1 keeps requests decoding; streaming every token of them would take the cores the
    next request's prefill needs, so the engines hand their output over every STREAM_INTERVAL
    tokens. The frontend's host-tier weight only counts where the workers announce the pool.
    """
    args = ["--max-model-len", str(MAX_MODEL_LEN)]
    if window > 1:
        args += ["--stream-interval", str(STREAM_INTERVAL)]
    if config.pool and not config.pool_events:
        args.append("--no-maru-pool-events")
    return {
        "name": "routing-" + re.sub(r"[^a-z0-9-]+", "-", config.name),  # a DNS label, as graph names are
        "nats": {"url": nats_url},
        "pool": {"name": "kv", "size": "512M", "chunk_tokens": CHUNK_TOKENS},
        "frontend": {"router_mode": config.router_mode, "pool_tier_weight": host_weight},
        "workers": [{"name": "worker", "replicas": workers, "engine": "maru" if config.pool else "vllm", "args": args}],
    }


def run_config(
    config: RoutingConfig,
    workload: Workload,
    *,
    model: str,
    nats_url: str,
    work_dir: Path,
    host_weight: float = POOL_TIER_WEIGHT,
    settle_s: float = 1.0,
    window: int = 1,
    max_tokens: int | None = None,
    workers: int = 2,
    log: Callable[[str], None] = print,
    graph: dict[str, object] | None = None,
) -> ConfigResult:
    """Run `config`'s graph (`graph_spec`, or `graph` when given: another graph of `workers` workers
    on `nats_url`; through graphs/run.py), send `workload`, stop everything."""
    run_dir = work_dir / config.name
    spec = parse_graph(graph or graph_spec(config, nats_url, window=window, workers=workers, host_weight=host_weight))
    plan = graph_plan.build_plan(spec, model=model, work_dir=run_dir, pin_workers=True)
    group = ProcessGroup()
    supervisor = graph_run.supervise(plan, group, out=log)
    try:
        graph_run.start_graph(plan, group, timeout=READY_TIMEOUT_S, supervisor=supervisor)
        url = plan.url
        procs = {p.name: p for p in group.processes}
        frontend = procs["frontend"]
        metric_urls = [w.metrics_url for w in plan.workers if w.metrics_url]
        for w, murl in zip(plan.workers, metric_urls):
            procs[w.name].wait_for_http(murl, timeout=120)
            if config.pool and config.pool_events:
                procs[w.name].wait_for_log(r"pool '\S+' synced at seq", timeout=120)
        log(f"[{config.name}] ready: {url}")

        start = [read_counters(u) for u in metric_urls]
        before = start
        open_streams: list[Stream] = []
        records: list[RequestRecord] = []
        n_lines = 0
        for req in workload:
            # Hold exactly `window - 1` earlier requests in flight (decoding) at this routing decision.
            while len(open_streams) > window - 1:
                open_streams.pop(0).close()
            _wait_running(metric_urls, len(open_streams), config.name, req.index)
            # Window 1: a short completion. Window > 1: decode until cancelled (as long as the model allows).
            decode = max_tokens or (MAX_TOKENS if window == 1 else MAX_MODEL_LEN - len(req))
            stream = _hold(
                url,
                {
                    "model": model,
                    "prompt": list(req.prompt),
                    "max_tokens": decode,
                    "min_tokens": decode,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                },
            )
            open_streams.append(stream)
            # Its first token means its prefill is done; the worker counters then say where it ran and
            # how its prompt was served; `settle_s` lets its KV/pool events reach the router.
            after = before
            deadline = time.monotonic() + 300
            while sum(a.prompt_tokens for a in after) < sum(b.prompt_tokens for b in before) + len(req):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"request {req.index}: no prefill counted after 300 s")
                time.sleep(0.2)
                after = [read_counters(u) for u in metric_urls]
            delta = [a - b for a, b in zip(after, before)]
            grew = [i for i in range(workers) if delta[i].prompt_tokens]
            if len(grew) != 1 or delta[grew[0]].prompt_tokens != len(req):
                raise RuntimeError(
                    f"request {req.index}: prompt tokens counted per worker "
                    f"{[d.prompt_tokens for d in delta]}, sent {len(req)}"
                )
            d = delta[grew[0]]
            lines = _selected_lines(frontend)
            records.append(
                RequestRecord(
                    req.index,
                    req.session,
                    req.turn,
                    len(req),
                    d.local_cache_hit + d.external_kv_transfer,
                    grew[0],
                    lines[-1].strip() if len(lines) > n_lines else "",
                )
            )
            n_lines = len(lines)
            time.sleep(settle_s)
            before = after
        for st in open_streams:
            st.close()
        _wait_running(metric_urls, 0, config.name, len(workload))
        before = [read_counters(u) for u in metric_urls]
        stats = [b - a for a, b in zip(start, before)]
        return ConfigResult(config, host_weight if config.frontend_args(host_weight) else None, records, stats)
    except BaseException:
        log(f"[{config.name}] failed; last log lines:\n{group.log_tails(40)}")
        raise
    finally:
        graph_run.stop_graph(group, STOP_GRACE_S, supervisor=supervisor)
        group.stop_all()
        for region in plan.pool_regions:
            region.unlink(missing_ok=True)


def run_comparison(
    spec: WorkloadSpec,
    *,
    model: str,
    work_dir: Path,
    configs: Sequence[RoutingConfig] = CONFIGS,
    host_weight: float = POOL_TIER_WEIGHT,
    settle_s: float = 1.0,
    window: int = 1,
    max_tokens: int | None = None,
    log: Callable[[str], None] = print,
) -> list[ConfigResult]:
    """Every configuration in turn on one shared nats-server."""
    workload = build_workload(spec)
    nats, nats_url = stack.nats_server(work_dir / "logs")
    nats.start()
    try:
        nats.wait_for_log(stack.NATS_READY_PATTERN, timeout=30)
        results = []
        for cfg in configs:
            t0 = time.monotonic()
            results.append(
                run_config(
                    cfg,
                    workload,
                    model=model,
                    nats_url=nats_url,
                    work_dir=work_dir,
                    host_weight=host_weight,
                    settle_s=settle_s,
                    window=window,
                    max_tokens=max_tokens,
                    log=log,
                )
            )
            log(f"[{cfg.name}] done in {time.monotonic() - t0:.0f}s")
        return results
    finally:
        nats.stop(STOP_GRACE_S)


# -- report ----------------------------------------------------------------------------------------
def format_table(results: Sequence[ConfigResult], workload: Workload | None = None) -> str:
    head = (
        f"{'config':<12} {'prefill computed':>16} {'(by metrics)':>12} {'cached':>8} {'pool-loaded':>11} "
        f"{'req/worker':>11} {'spread':>6} {'cv':>6}"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(
            f"{r.config.name:<12} {r.prefill_computed:>16} {r.metrics_computed:>12} {r.cached_tokens:>8} "
            f"{r.pool_loaded_tokens:>11} {'/'.join(map(str, r.requests_per_worker)):>11} "
            f"{r.spread:>6} {r.cv:>6.3f}"
        )
    by = {r.config.name: r for r in results}
    if "kv-pool" in by:
        for other in ("round-robin", "kv-gpu"):
            if other in by and by[other].prefill_computed:
                rows.append(
                    f"prefill computed kv-pool / {other}: "
                    f"{by['kv-pool'].prefill_computed / by[other].prefill_computed:.3f}"
                )
    if workload is not None:
        rows.append(
            f"workload: {len(workload)} requests, {workload.total_prompt_tokens} prompt tokens, "
            f"{workload.unique_prefix_tokens()} in its prefix tree (ideal-cache lower bound)"
        )
    return "\n".join(rows)


def format_routes(result: ConfigResult) -> str:
    lines = [f"[{result.config.name}] request: session/turn -> worker (prompt, cached)"]
    for r in result.requests:
        lines.append(
            f"  #{r.index:<3} s{r.session} t{r.turn} -> w{r.worker} ({r.prompt_tokens}, {r.cached_tokens})"
            + (f"  | {r.router_line[r.router_line.find('Selected worker') :]}" if r.router_line else "")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = DEFAULT_SPEC
    for field in dataclasses.fields(WorkloadSpec):
        ap.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=getattr(defaults, field.name))
    ap.add_argument("--model-size", default="tiny", help="fixture model (tiny, bench) or a model path")
    ap.add_argument(
        "--configs",
        default=",".join(c.name for c in CONFIGS),
        help="comma-separated subset of: " + ", ".join(c.name for c in CONFIGS),
    )
    ap.add_argument(
        "--host-weight",
        type=float,
        default=POOL_TIER_WEIGHT,
        help="--router-host-cache-hit-weight for kv-pool (default maru_vllm.routing.POOL_TIER_WEIGHT)",
    )
    ap.add_argument("--settle-s", type=float, default=1.0, help="pause after each request for its events")
    ap.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help=f"requests in flight at each routing decision (default {DEFAULT_WINDOW}; 1: one at a time)",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens generated per request (default {MAX_TOKENS}; with --window > 1, until cancelled)",
    )
    ap.add_argument("--keep-logs", action="store_true", help="keep the work dir with every process's log")
    ap.add_argument("--routes", action="store_true", help="also print where each request went")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        spec = WorkloadSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(WorkloadSpec)})
    except ValueError as exc:
        ap.error(str(exc))
    if args.window < 1:
        ap.error(f"--window must be >= 1 (requests in flight at each routing decision), got {args.window}")
    wanted = args.configs.split(",")
    unknown = set(wanted) - {c.name for c in CONFIGS}
    if unknown:
        ap.error(f"unknown configs: {', '.join(sorted(unknown))} (choose from {', '.join(c.name for c in CONFIGS)})")
    model = graph_plan.resolve_model(args.model_size)
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    tmp = tempfile.mkdtemp(prefix="maru-routing-")
    try:
        results = run_comparison(
            spec,
            model=model,
            work_dir=Path(tmp),
            host_weight=args.host_weight,
            settle_s=args.settle_s,
            window=args.window,
            max_tokens=args.max_tokens,
            configs=[c for c in CONFIGS if c.name in wanted],
            log=log,
        )
    finally:
        if args.keep_logs:
            log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"workload": dataclasses.asdict(spec), "results": [r.as_dict() for r in results]}, indent=1))
    else:
        print(format_table(results, build_workload(spec)))
        if args.routes:
            for r in results:
                print(format_routes(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
