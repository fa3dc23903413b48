#!/usr/bin/env python3
"""Routing comparison on a prefix-sharing chat workload: round-robin vs. KV routing on the
engines' own KV events vs. KV routing that also sees the Maru pool.

Three configurations, each on a fresh pool service, frontend and two Maru workers (one pinned
core each; one nats-server is shared by all three):

* ``round-robin`` - ``--router-mode round-robin``; the workers announce the pool (the router
  ignores it). Shows what the pool alone saves when routing knows nothing.
* ``kv-gpu``      - ``--router-mode kv``; workers started with ``--no-maru-pool-events``: the
  router sees only vLLM's own (device) KV events.
* ``kv-pool``     - ``--router-mode kv`` with ``--router-host-cache-hit-weight`` =
  ``maru_vllm.routing.POOL_TIER_WEIGHT``; the workers announce the pool's blocks at the host tier.

Every configuration runs the same MaruKVConnector on the same pool layout, so every engine can
load any chunk another engine stored; only what the router knows differs. ``kv-gpu`` uses the
same worker component with one flag off (rather than a plain ``dynamo.vllm`` worker given the
connector by hand) so that the connector and KV-event settings are built by the same code in
both KV configurations and the relay is the single difference.

Sending. Requests go out in the workload's fixed order as streaming completions. The next one is
routed only after the previous one's prefill is done (its worker counted the prompt tokens) and
``--settle-s`` has passed, so its KV and pool events have reached the router. ``--window 1``
(the default; what the e2e test uses): ``max_tokens`` 4, temperature 0, every request finishes
before the next is routed, and the token counts do not depend on timing. ``--window W > 1``
(exploratory): the W-1 previous requests stay in flight (they decode until the client cancels
them), which gives the router the only load signal it has. The run fails with `WindowError`
when one of them ends too soon, rather than measuring another window; on a busy 2-core machine
that happens often (the long decodes also starve the workers), so it needs a quiet machine.

Measured per configuration, from the workers' own counters (each worker's /metrics on its
``DYN_SYSTEM_PORT``, read after each request's prefill; only one prefill runs at a time, so the
change belongs to that request):

* prefill tokens computed = ``vllm:prompt_tokens_by_source_total{source="local_compute"}``;
  a request's cached tokens = ``local_cache_hit`` + ``external_kv_transfer`` (what vLLM reports
  as ``usage.prompt_tokens_details.cached_tokens``);
* pool-loaded tokens = ``{source="external_kv_transfer"}`` summed over the workers (the
  connector's ``vllm:maru_connector_chunks_loaded_total`` x chunk tokens is kept beside it);
* requests per worker: which worker's prompt counter grew; spread = max - min (and the
  coefficient of variation).

Findings on the tiny model, one request at a time (``--sessions 5 --turns 3``, the test's
workload; measured 2026-11-29)::

    config       prefill computed   cached  pool-loaded  req/worker  spread
    round-robin              4736     8704         1664         8/7       1
    kv-gpu                   3840     9600            0        15/0      15
    kv-pool                  3840     9600            0         6/9       3

* The pool already makes round-robin cheap (1664 tokens loaded instead of computed); both KV
  configurations compute 19% less than round-robin (3840 vs. 4736).
* ``kv-pool`` computes exactly as much as ``kv-gpu``: with one request at a time the router has
  no load to weigh, so it picks the worker with the longest cached prefix. A pool block is
  credited at 0.75 of a device block, and every prefix in the pool is also on the device of
  the worker that computed it, so the pool's credit never changes which worker wins; both
  configurations make the same choices and never load from the pool. (Nor could KV routing on
  device events compute more because it ignores the pool: whichever worker it picks loads the
  pool's chunks anyway; only sub-chunk tails, up to 255 tokens, can differ.)
* The spread of both KV configurations is decided by ties: the first request of each system
  prompt has no cached prefix anywhere, all logits are equal, and Dynamo 1.6.1 (temperature 0)
  takes the first minimum in a hash map keyed by the workers' random instance ids. Each system
  prompt's sessions then stick to that worker: 15/0 (both prompts on one worker) or 9/6 / 6/9,
  in either configuration, differing from run to run. The 15/0 vs. 6/9 above is that coin.

So the issue's claim (pool-aware routing computes fewer prefill tokens than both, with a spread
at least as even as GPU-only) does not hold in this regime; the claim needs load at routing
time (``--window`` > 1), where the pool's credit makes moving a session cheaper in the
router's cost, which should even out the spread, at the price of recomputing the sub-chunk
tail on each move. That regime was not measured to completion here (see ``--window``).

Usage: python benchmarks/routing_comparison.py [--sessions 5 --turns 3 --systems 2] [--routes] [--json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import http.client
import json
import random
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from maru_vllm.launch import ManagedProcess, ProcessGroup  # noqa: E402
from maru_vllm.launch import stack  # noqa: E402
from maru_vllm.workload import Workload, WorkloadSpec, build_workload  # noqa: E402

try:
    from maru_vllm.routing import POOL_TIER_WEIGHT  # noqa: E402
except ImportError:  # older trees: Dynamo's own default
    POOL_TIER_WEIGHT = 0.75

CHUNK_TOKENS = 256
MAX_MODEL_LEN = 8192  # the fixture models' position limit: room for long decodes (--window > 1)
MAX_TOKENS = 4  # --window 1: each request finishes on its own right after its prefill
STOP_GRACE_S = 10.0
READY_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    name: str
    router_mode: str
    pool_events: bool  # workers announce the pool's blocks to the router
    description: str

    def frontend_args(self, host_weight: float) -> list[str]:
        if self.router_mode == "kv" and self.pool_events:
            return ["--router-host-cache-hit-weight", repr(host_weight)]
        return []


CONFIGS: tuple[RoutingConfig, ...] = (
    RoutingConfig("round-robin", "round-robin", True, "round-robin; Maru workers (pool loads, router unaware)"),
    RoutingConfig("kv-gpu", "kv", False, "KV router on vLLM's device KV events only (pool loads still on)"),
    RoutingConfig("kv-pool", "kv", True, "KV router with the pool's blocks at the host tier"),
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
class WorkerStats:
    requests: int = 0
    prompt_tokens: int = 0
    local_compute: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0  # tokens loaded through the connector, i.e. from the pool
    chunks_loaded: int = 0
    chunks_stored: int = 0


@dataclasses.dataclass
class ConfigResult:
    config: RoutingConfig
    host_weight: float | None
    requests: list[RequestRecord]
    workers: list[WorkerStats]

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
        return [w.requests for w in self.workers]

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


# -- metrics ---------------------------------------------------------------------------------------
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_SOURCE = re.compile(r'source="([^"]+)"')
WANTED = {
    "vllm:request_success_total": "requests",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:maru_connector_chunks_loaded_total": "chunks_loaded",
    "vllm:maru_connector_chunks_stored_total": "chunks_stored",
}
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def scrape(url: str) -> WorkerStats:
    """The counters of one worker's /metrics (summed over label sets)."""
    with urllib.request.urlopen(url, timeout=60) as resp:
        text = resp.read().decode(errors="replace")
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, value = m["name"], float(m["value"])
        if name in WANTED:
            totals[WANTED[name]] = totals.get(WANTED[name], 0.0) + value
        elif name == "vllm:prompt_tokens_by_source_total":
            src = _SOURCE.search(m["labels"] or "")
            if src and src.group(1) in SOURCES:
                totals[src.group(1)] = totals.get(src.group(1), 0.0) + value
    return WorkerStats(**{k: int(v) for k, v in totals.items()})


def _minus(a: WorkerStats, b: WorkerStats) -> WorkerStats:
    return WorkerStats(**{f.name: getattr(a, f.name) - getattr(b, f.name) for f in dataclasses.fields(WorkerStats)})


# -- one configuration -----------------------------------------------------------------------------
def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def _generate_instances(url: str) -> int:
    body = _get(f"{url}/health")
    try:
        health = json.loads(body) if body else {}
    except ValueError:
        return 0
    instances = health.get("instances") if isinstance(health, dict) else None
    return len({i.get("instance_id") for i in instances or []
                if isinstance(i, dict) and i.get("endpoint") == "generate"})


class WindowError(RuntimeError):
    """A request finished before the next one was routed: the in-flight window was not held."""


class _Stream:
    """A streaming completion held open (in flight on its worker) until `close()` cancels it.

    The client reads only the response headers; the engine keeps decoding (``max_tokens`` large,
    ``ignore_eos``) and the router keeps counting the request's blocks as active load until the
    connection is closed, which cancels the request in Dynamo and vLLM.
    """

    def __init__(self, base_url: str, payload: dict[str, object]) -> None:
        host, port = base_url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=600)
        self.conn.request("POST", "/v1/completions", body=json.dumps(payload),
                          headers={"content-type": "application/json"})
        self.resp = self.conn.getresponse()
        if self.resp.status != 200:
            raise RuntimeError(f"completion failed: HTTP {self.resp.status}: {self.resp.read()[:500]!r}")

    def close(self) -> None:
        try:
            self.conn.sock and self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()
        self.resp.close()


def _running(url: str) -> int:
    with urllib.request.urlopen(url, timeout=60) as resp:
        text = resp.read().decode(errors="replace")
    return int(sum(float(m["value"]) for line in text.splitlines()
                   if (m := _SAMPLE.match(line)) and m["name"] == "vllm:num_requests_running"))


def _wait_running(metric_urls: Sequence[str], want: int, name: str, index: int, timeout: float = 10.0) -> None:
    """Until the workers run `want` requests; fewer means one ended early (the window was not held).

    vLLM refreshes the gauge only when its engine steps, so an idle engine may keep showing a
    cancelled request: after `timeout` more than `want` is accepted.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = sum(_running(u) for u in metric_urls)
        if got == want:
            return
        if got < want:
            raise WindowError(f"[{name}] {got} requests running before request {index}, expected {want}: an "
                              f"earlier one finished decoding; raise --max-tokens")
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _system_port() -> int:
    """A free loopback port below 32768: Dynamo 1.6.1 parses DYN_SYSTEM_PORT as an i16."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((stack.LOOPBACK, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768 for DYN_SYSTEM_PORT")


def _selected_lines(frontend: ManagedProcess) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;]*m", "", frontend.log_text())
    return [line for line in text.splitlines() if "Selected worker" in line]


def _stop_all(group: ProcessGroup) -> None:
    """Frontend, then both workers at once, then the pool: SIGTERM, SIGKILL after 10 s."""
    procs = list(reversed(group.processes))
    workers = [p for p in procs if p.name.startswith("worker")]
    for p in procs:
        if p.name == "frontend":
            p.stop(STOP_GRACE_S)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(workers))) as ex:
        list(ex.map(lambda p: p.stop(STOP_GRACE_S), workers))
    for p in procs:
        if p.name != "frontend" and p not in workers:
            p.stop(STOP_GRACE_S)


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
) -> ConfigResult:
    """Start pool, frontend and workers for `config`, send `workload`, stop everything."""
    py = sys.executable
    run_dir = work_dir / config.name
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    pool_name = f"rc{uuid.uuid4().hex[:8]}"
    sock = Path(tempfile.gettempdir()) / f"maru-{pool_name}.sock"
    region = Path(f"/dev/shm/maru-{pool_name}")
    address = f"unix://{sock}"
    env = stack.StackEnv(discovery_dir=run_dir / "discovery", nats_url=nats_url)
    group = ProcessGroup()
    try:
        pool = group.start(ManagedProcess(
            "pool", [py, "-m", "maru_vllm.pool", "serve", "--name", pool_name, "--size", "512M",
                     "--listen", address, "--path", str(region), "--nats", nats_url],
            log_path=logs / "pool.log", env=env.build()))
        pool.wait_for_log(r"maru-pool serving on", timeout=60)

        metric_ports = [_system_port() for _ in range(workers)]
        worker_procs = []
        for i in range(workers):
            argv = [py, "-m", "maru_dynamo.components.maru_worker", "--model", model,
                    "--maru-pool-address", address, "--maru-pool-name", pool_name,
                    "--maru-chunk-tokens", str(CHUNK_TOKENS),
                    *([] if config.pool_events else ["--no-maru-pool-events"]),
                    "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager"]
            wenv = env.build(cpu_thread=stack.cpu_thread_for(i), DYN_SYSTEM_PORT=str(metric_ports[i]))
            worker_procs.append(group.start(ManagedProcess(f"worker{i}", argv, log_path=logs / f"worker{i}.log",
                                                           env=wenv)))
        frontend, url = stack.dynamo_frontend(env.build(), logs, router_mode=config.router_mode,
                                              extra_args=config.frontend_args(host_weight))
        group.start(frontend)

        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (model.encode() in (_get(f"{url}/v1/models") or b"") and _generate_instances(url) >= workers):
            for p in group:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited before the stack was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"stack not ready after {READY_TIMEOUT_S:.0f}s\n{group.log_tails(20)}")
            time.sleep(0.5)
        metric_urls = [f"http://{stack.LOOPBACK}:{p}/metrics" for p in metric_ports]
        for w, murl in zip(worker_procs, metric_urls):
            w.wait_for_http(murl, timeout=120)
            if config.pool_events:
                w.wait_for_log(r"pool '\S+' synced at seq", timeout=120)
        log(f"[{config.name}] ready: {url}")

        start = [scrape(u) for u in metric_urls]
        before = start
        open_streams: list[_Stream] = []
        records: list[RequestRecord] = []
        n_lines = 0
        for req in workload:
            # Hold exactly `window - 1` earlier requests in flight (decoding) at this routing decision.
            while len(open_streams) > window - 1:
                open_streams.pop(0).close()
            _wait_running(metric_urls, len(open_streams), config.name, req.index)
            # Window 1: a short completion. Window > 1: decode until cancelled (as long as the model allows).
            decode = max_tokens or (MAX_TOKENS if window == 1 else MAX_MODEL_LEN - len(req))
            stream = _Stream(url, {"model": model, "prompt": list(req.prompt), "max_tokens": decode,
                                   "min_tokens": decode, "ignore_eos": True, "temperature": 0, "stream": True})
            open_streams.append(stream)
            # Its first token means its prefill is done; the worker counters then say where it ran and
            # how its prompt was served; `settle_s` lets its KV/pool events reach the router.
            after = before
            deadline = time.monotonic() + 300
            while sum(a.prompt_tokens for a in after) < sum(b.prompt_tokens for b in before) + len(req):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"request {req.index}: no prefill counted after 300 s")
                time.sleep(0.2)
                after = [scrape(u) for u in metric_urls]
            delta = [_minus(a, b) for a, b in zip(after, before)]
            grew = [i for i in range(workers) if delta[i].prompt_tokens]
            if len(grew) != 1 or delta[grew[0]].prompt_tokens != len(req):
                raise RuntimeError(f"request {req.index}: prompt tokens counted per worker "
                                   f"{[d.prompt_tokens for d in delta]}, sent {len(req)}")
            d = delta[grew[0]]
            lines = _selected_lines(frontend)
            records.append(RequestRecord(req.index, req.session, req.turn, len(req),
                                         d.local_cache_hit + d.external_kv_transfer, grew[0],
                                         lines[-1].strip() if len(lines) > n_lines else ""))
            n_lines = len(lines)
            time.sleep(settle_s)
            before = after
        for st in open_streams:
            st.close()
        _wait_running(metric_urls, 0, config.name, len(workload))
        before = [scrape(u) for u in metric_urls]
        stats = [_minus(b, a) for a, b in zip(start, before)]
        return ConfigResult(config, host_weight if config.frontend_args(host_weight) else None, records, stats)
    except BaseException:
        log(f"[{config.name}] failed; last log lines:\n{group.log_tails(40)}")
        raise
    finally:
        _stop_all(group)
        region.unlink(missing_ok=True)
        sock.unlink(missing_ok=True)


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
        nats.wait_for_log(r"Server is ready", timeout=30)
        results = []
        for cfg in configs:
            t0 = time.monotonic()
            results.append(run_config(cfg, workload, model=model, nats_url=nats_url, work_dir=work_dir,
                                      host_weight=host_weight, settle_s=settle_s, window=window,
                                      max_tokens=max_tokens, log=log))
            log(f"[{cfg.name}] done in {time.monotonic() - t0:.0f}s")
        return results
    finally:
        nats.stop(STOP_GRACE_S)


# -- report ----------------------------------------------------------------------------------------
def format_table(results: Sequence[ConfigResult], workload: Workload | None = None) -> str:
    head = f"{'config':<12} {'prefill computed':>16} {'(by metrics)':>12} {'cached':>8} {'pool-loaded':>11} " \
           f"{'req/worker':>11} {'spread':>6} {'cv':>6}"
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(f"{r.config.name:<12} {r.prefill_computed:>16} {r.metrics_computed:>12} {r.cached_tokens:>8} "
                     f"{r.pool_loaded_tokens:>11} {'/'.join(map(str, r.requests_per_worker)):>11} "
                     f"{r.spread:>6} {r.cv:>6.3f}")
    by = {r.config.name: r for r in results}
    if "kv-pool" in by:
        for other in ("round-robin", "kv-gpu"):
            if other in by and by[other].prefill_computed:
                rows.append(f"prefill computed kv-pool / {other}: "
                            f"{by['kv-pool'].prefill_computed / by[other].prefill_computed:.3f}")
    if workload is not None:
        rows.append(f"workload: {len(workload)} requests, {workload.total_prompt_tokens} prompt tokens, "
                    f"{workload.unique_prefix_tokens()} in its prefix tree (ideal-cache lower bound)")
    return "\n".join(rows)


def format_routes(result: ConfigResult) -> str:
    lines = [f"[{result.config.name}] request: session/turn -> worker (prompt, cached)"]
    for r in result.requests:
        lines.append(f"  #{r.index:<3} s{r.session} t{r.turn} -> w{r.worker} ({r.prompt_tokens}, {r.cached_tokens})"
                     + (f"  | {r.router_line[r.router_line.find('Selected worker'):]}" if r.router_line else ""))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = WorkloadSpec()
    for field in dataclasses.fields(WorkloadSpec):
        ap.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=getattr(defaults, field.name))
    ap.add_argument("--model-size", default="tiny", help="fixture model (tiny, bench) or a model path")
    ap.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                    help="comma-separated subset of: " + ", ".join(c.name for c in CONFIGS))
    ap.add_argument("--host-weight", type=float, default=POOL_TIER_WEIGHT,
                    help="--router-host-cache-hit-weight for kv-pool (default maru_vllm.routing.POOL_TIER_WEIGHT)")
    ap.add_argument("--settle-s", type=float, default=1.0, help="pause after each request for its events")
    ap.add_argument("--window", type=int, default=1, help="requests in flight at each routing decision")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help=f"tokens generated per request (default {MAX_TOKENS}; with --window > 1, until cancelled)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the work dir with every process's log")
    ap.add_argument("--routes", action="store_true", help="also print where each request went")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    spec = WorkloadSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(WorkloadSpec)})
    wanted = args.configs.split(",")
    unknown = set(wanted) - {c.name for c in CONFIGS}
    if unknown:
        ap.error(f"unknown configs: {', '.join(sorted(unknown))}")
    from maru_vllm import models

    model = str(models.ensure_model(args.model_size)) if args.model_size in models.SPECS else args.model_size
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    tmp = tempfile.mkdtemp(prefix="maru-routing-")
    try:
        results = run_comparison(spec, model=model, work_dir=Path(tmp), host_weight=args.host_weight,
                                 settle_s=args.settle_s, window=args.window, max_tokens=args.max_tokens,
                                 configs=[c for c in CONFIGS if c.name in wanted], log=log)
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
