#!/usr/bin/env python3
"""Real traffic on the real stack: AIPerf replays a trace against plain Dynamo and against Maru.

Each configuration runs on a fresh graph (``graphs/run.py``: nats-server, a fresh pool, N
workers pinned one core each, Dynamo's frontend), back to back, the order rotated per repeat:

* ``plain-rr``    - plain ``dynamo.vllm`` workers (vLLM prefix caching, no pool), round-robin;
* ``plain-kv``    - plain ``dynamo.vllm`` workers behind Dynamo's KV router: what a Dynamo user runs;
* ``maru-rr``     - Maru workers (pool loads), round-robin;
* ``maru-kv-gpu`` - Maru workers, KV router on device events only (``--no-maru-pool-events``);
* ``maru-pool``   - Maru workers announcing the pool's blocks, KV router crediting them at the host tier;
* ``lmcache-kv``  - plain ``dynamo.vllm`` workers sharing one LMCache multiprocess server (vLLM's
  ``LMCacheMPConnector``, `lmcache_peer`), KV router on their device events: the peer.

Load: AIPerf 0.13 (``aiperf profile``, its own venv from ``make aiperf``) replays a
Mooncake-format trace with ``--fixed-schedule`` on the frontend's streaming completions endpoint,
the fixture model's tokenizer from its directory. Traffic is a published trace scaled to this
machine (``--trace FILE --trace-block-size N --speedup X --requests N``: each hash id becomes N
tokens; ``--sample-sessions K`` replays every K-th conversation session of the whole trace, which
keeps its prefix reuse where its first N requests do not) or Dynamo-router-benchmark-style
synthetic prefix traffic (``--synthetic``).

Per configuration (median over ``--repeats``): completed/failed, TTFT p50/p90/p99, ITL p50, output
tokens/s, goodput at ``--slo-ttft-ms``, AIPerf's schedule lag (sent minus scheduled), prefill tokens
computed and tokens loaded from the pool (the engines' ``vllm:prompt_tokens_by_source_total``),
requests per worker, and the frontend's CPU seconds per request (its router's cost: kv minus rr).
``--whatif`` replays the same scaled trace with ``maru-dynamo whatif`` calibrated on this run (the
engines' measured prefill speed and pool load bandwidth) and prints both side by side.

Usage: python benchmarks/real_traffic.py [--trace ../shared/traces/mooncake_conversation.jsonl
       --trace-block-size 16 --speedup 20 --requests 200 [--sample-sessions K] | --synthetic]
       [--configs ...] [--workers 2] [--repeats 1] [--json FILE] [--detail-json FILE] [--plot FILE.png]
       [--whatif]
Run it under the machine's slot limiter where others share the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from lmcache_peer import start_lmcache_server  # noqa: E402
from maru_vllm.calibration import write_calibration  # noqa: E402
from real_traffic_whatif import COUNTERPART, cache_config, calibration_from_runs, side_by_side, whatif_rows  # noqa: E402
from traffic_load import (  # noqa: E402
    AIPERF_BIN,
    LoadResult,
    PrefixWorkload,
    Traffic,
    TrafficError,
    aiperf_command,
    median,
    read_aiperf,
    read_mooncake,
    sample_sessions,
    scale_trace,
    synthetic_trace,
    tokenizer_cache,
)

DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
MAX_MODEL_LEN = 4096
CHUNK_TOKENS = 128  # pool chunk = one vLLM CPU block: a shared prefix is loadable block by block
POOL_SIZE = "1G"


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    engine: str  # graph worker engine: vllm (plain dynamo.vllm) or maru
    router_mode: str
    pool_events: bool = True
    description: str = ""
    lmcache: bool = False  # plain workers with LMCache's multiprocess server as their shared cache

    def graph(self, model: str, workers: int, kv_transfer: dict[str, object] | None = None) -> dict[str, object]:
        args: list[str] = ["--max-model-len", str(MAX_MODEL_LEN)]
        if self.engine == "maru" and not self.pool_events:
            args.append("--no-maru-pool-events")
        if kv_transfer is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer)]
        return {
            "name": f"traffic-{self.name}",
            "model": model,
            "pool": {"name": "kv", "size": POOL_SIZE, "chunk_tokens": CHUNK_TOKENS},
            "frontend": {"router_mode": self.router_mode},
            "workers": [{"name": "worker", "replicas": workers, "engine": self.engine, "args": args}],
        }


CONFIGS: tuple[Config, ...] = (
    Config("plain-rr", "vllm", "round-robin", description="plain dynamo.vllm, round-robin"),
    Config("plain-kv", "vllm", "kv", description="plain dynamo.vllm, Dynamo's KV router"),
    Config("maru-rr", "maru", "round-robin", description="Maru workers, round-robin"),
    Config("maru-kv-gpu", "maru", "kv", False, "Maru workers, KV router on device events only"),
    Config("maru-pool", "maru", "kv", True, "Maru workers, pool-aware KV router"),
    Config("lmcache-kv", "vllm", "kv", description="plain dynamo.vllm + LMCache MP server, KV router", lmcache=True),
)
BY_NAME = {c.name: c for c in CONFIGS}


@dataclasses.dataclass
class Run:
    """One configuration, one repeat: AIPerf's view and the engines' counters."""

    config: str
    workers: int
    load: LoadResult
    prefill_tokens: int
    cached_tokens: int
    pool_loaded_tokens: int
    requests_per_worker: list[int]
    frontend_cpu_s: float
    prefill_seconds: float  # the engines' vllm:request_prefill_time_seconds, summed
    load_bytes: int
    load_seconds: float
    block_size: int = 0  # the engines' KV block size and KV-cache blocks (vllm:cache_config_info)
    kv_blocks: int = 0
    repeat: int = 0
    loadavg: tuple[float, float] = (0.0, 0.0)  # the machine's 1-minute load average before / after the replay
    prefill_probe_tokens_per_s: float = 0.0  # a cold prompt alone (see _prefill_probe)
    nats_msgs: int = 0  # messages and bytes into nats-server during the replay (its /varz)
    nats_bytes: int = 0
    replay_s: float = 0.0  # wall time of the AIPerf replay


def with_nats_monitoring(plan: Any) -> tuple[Any, str | None]:
    """`plan` with its nats-server serving its monitoring endpoint on a free loopback port, and
    that endpoint's URL (None where the graph uses an outside NATS)."""
    from maru_vllm.launch.ports import free_port
    from maru_vllm.launch.stack import LOOPBACK

    port = free_port()
    out, url = [], None
    for p in plan.processes:
        if p.name == "nats-server":
            p = dataclasses.replace(p, argv=(*p.argv, "-m", str(port)))
            url = f"http://{LOOPBACK}:{port}/varz"
        out.append(p)
    return dataclasses.replace(plan, processes=tuple(out)), url


def nats_counters(varz_url: str | None) -> tuple[int, int]:
    """(messages, bytes) nats-server has received so far; (0, 0) without a monitoring URL."""
    if varz_url is None:
        return 0, 0
    with urllib.request.urlopen(varz_url, timeout=10) as resp:
        doc = json.loads(resp.read())
    return int(doc.get("in_msgs", 0)), int(doc.get("in_bytes", 0))


def _metric_sum(url: str, name: str) -> float:
    from maru_vllm.launch.engine_metrics import metric_total

    with urllib.request.urlopen(url, timeout=30) as resp:
        return metric_total(resp.read().decode(errors="replace"), name)


def _cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _warm_up(url: str, model: str, metrics: Sequence[str], log: Callable[[str], None]) -> None:
    """Distinct short streamed completions until every worker has served one (vLLM compiles its
    sampler on the first sampled request; plain workers are not warmed by the graph)."""
    import concurrent.futures

    from maru_vllm.launch.engine_metrics import read_counters

    def one(i: int) -> None:
        body = json.dumps({"model": model, "prompt": f"warm-up {i} " * 8, "max_tokens": 4, "stream": False})
        req = urllib.request.Request(f"{url}/v1/completions", body.encode(), {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()

    for attempt in range(4):
        with concurrent.futures.ThreadPoolExecutor(len(metrics)) as ex:
            list(ex.map(one, range(attempt * 8, attempt * 8 + 2 * len(metrics))))
        if all(read_counters(m).requests > 0 for m in metrics):
            return
    log("[traffic] warning: not every worker served a warm-up request")


PROBE_TOKENS = (16, 1536)


def _prefill_probe(url: str, model: str, rounds: int = 3) -> float:
    """Prefill tokens/s of a cold prompt alone: the latency of fresh 1536- and 16-character prompts (never
    seen, so computed in full), min of `rounds`, their difference over the difference in tokens.
    The per-request costs both pay (HTTP, routing, one decode step) cancel; run before the replay.

    Summed per-request prefill times (vllm:request_prefill_time_seconds) are no substitute: requests
    that prefill together each count the shared time, which under load understates the speed."""
    import random

    rng = random.Random(time.monotonic_ns())
    best = dict.fromkeys(PROBE_TOKENS, (math.inf, 0))  # (seconds, prompt tokens as the server counted)
    for _ in range(rounds):
        for n in PROBE_TOKENS:
            # random letters: about one token each with the byte-level fixture tokenizers
            prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            req = urllib.request.Request(f"{url}/v1/completions", body.encode(), {"content-type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=120) as resp:
                usage = json.loads(resp.read()).get("usage") or {}
            dt = time.perf_counter() - t0
            if dt < best[n][0]:
                best[n] = (dt, int(usage.get("prompt_tokens") or n))
    (t_short, n_short), (t_long, n_long) = best[PROBE_TOKENS[0]], best[PROBE_TOKENS[1]]
    return (n_long - n_short) / (t_long - t_short) if t_long > t_short and n_long > n_short else 0.0


def run_config(
    cfg: Config,
    traffic_file: Path,
    traffic: Traffic,
    *,
    model: str,
    workers: int,
    slo_ms: float,
    work_dir: Path,
    log: Callable[[str], None],
    repeat: int = 0,
) -> Run:
    """A fresh graph for `cfg`, warm-up, AIPerf replay, counters; the graph is stopped after."""
    from maru_dynamo.graphs import run as graph_run
    from maru_dynamo.graphs.spec import parse_graph
    from maru_vllm.launch import ProcessGroup
    from maru_vllm.launch.engine_metrics import read_counters

    gdir = Path(tempfile.mkdtemp(prefix=f"maru-traffic-{cfg.name}-", dir=work_dir))
    group = ProcessGroup()
    t0 = time.monotonic()
    lmcache = None
    if cfg.lmcache:
        try:
            lmcache = start_lmcache_server(group, gdir / "lmcache-server.log", chunk_tokens=CHUNK_TOKENS, l1_gb=1)
        except BaseException:
            log(f"[{cfg.name}] LMCache server did not start; its log: {gdir / 'lmcache-server.log'}")
            group.stop_all()
            raise
    spec = parse_graph(
        cfg.graph(model, workers, lmcache.kv_transfer_config if lmcache is not None else None), f"<{cfg.name}>"
    )
    plan, varz = with_nats_monitoring(graph_run.build_plan(spec, model=model, work_dir=gdir))
    supervisor = graph_run.supervise(plan, group, out=log)
    try:
        graph_run.start_graph(plan, group, supervisor=supervisor)
        procs = {p.name: p for p in group.processes}
        if cfg.engine == "maru" and cfg.pool_events:
            for w in plan.workers:
                procs[w.name].wait_for_log(r"pool '\S+' synced at seq", timeout=120)
        metrics = [w.metrics_url for w in plan.workers if w.metrics_url]
        _warm_up(plan.url, model, metrics, log)
        probe = _prefill_probe(plan.url, model)
        log(f"[{cfg.name}] graph ready in {time.monotonic() - t0:.0f}s: {plan.url}")
        before = [read_counters(m) for m in metrics]
        prefill_before = sum(_metric_sum(m, "vllm:request_prefill_time_seconds_sum") for m in metrics)
        load_b = [
            sum(_metric_sum(m, f"vllm:maru_connector_{k}_total") for m in metrics)
            for k in ("bytes_loaded", "load_seconds")
        ]
        front = procs["frontend"]
        assert front.proc is not None
        cpu0 = _cpu_seconds(front.proc.pid)
        nats0 = nats_counters(varz)
        load0 = os.getloadavg()[0]
        replay0 = time.monotonic()
        artifacts = gdir / "aiperf"
        tokenizer, tok_env = tokenizer_cache(Path(model), work_dir / "hf-hub")
        cmd = aiperf_command(
            url=plan.url,
            model=model,
            tokenizer=tokenizer,
            trace_file=traffic_file,
            artifact_dir=artifacts,
            block_tokens=traffic.block_tokens,
            slo_ms=slo_ms,
        )
        with open(gdir / "aiperf.log", "wb") as out:
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **tok_env}, check=False
            ).returncode
        if rc != 0:
            tail = (gdir / "aiperf.log").read_text(errors="replace").splitlines()[-25:]
            raise RuntimeError(f"[{cfg.name}] aiperf exited {rc}:\n" + "\n".join(tail))
        cpu1 = _cpu_seconds(front.proc.pid)
        replay_s = time.monotonic() - replay0
        nats1 = nats_counters(varz)
        # Engines count a request's tokens when it finishes; AIPerf returns once every one has.
        after = [read_counters(m) for m in metrics]
        delta = [a - b for a, b in zip(after, before)]
        prefill_after = sum(_metric_sum(m, "vllm:request_prefill_time_seconds_sum") for m in metrics)
        load_a = [
            sum(_metric_sum(m, f"vllm:maru_connector_{k}_total") for m in metrics)
            for k in ("bytes_loaded", "load_seconds")
        ]
        load = read_aiperf(artifacts)
        block_size, kv_blocks = cache_config(metrics[0])
        return Run(
            cfg.name,
            workers,
            load,
            sum(d.local_compute for d in delta),
            sum(d.local_cache_hit + d.external_kv_transfer for d in delta),
            sum(d.external_kv_transfer for d in delta),
            [d.requests for d in delta],
            cpu1 - cpu0,
            prefill_after - prefill_before,
            int(load_a[0] - load_b[0]),
            load_a[1] - load_b[1],
            block_size,
            kv_blocks,
            repeat,
            (load0, os.getloadavg()[0]),
            probe,
            nats1[0] - nats0[0],
            nats1[1] - nats0[1],
            replay_s,
        )
    except BaseException:
        log(f"[{cfg.name}] failed; logs in {gdir / 'logs'}")
        raise
    finally:
        graph_run.stop_graph(group, supervisor=supervisor)
        group.stop_all()
        if plan.pool_region is not None:
            plan.pool_region.unlink(missing_ok=True)
        if lmcache is not None:
            lmcache.remove_shared_memory()


# -- aggregation and report ------------------------------------------------------------------------
@dataclasses.dataclass
class Summary:
    config: str
    workers: int
    runs: list[Run]

    def _med(self, f: Callable[[Run], float]) -> float:
        return median([f(r) for r in self.runs])

    def as_json(self) -> dict[str, object]:
        return {
            "config": self.config,
            "workers": self.workers,
            "completed": int(self._med(lambda r: r.load.completed)),
            "failed": max(r.load.failed for r in self.runs),
            "ttft_p50_ms": round(self._med(lambda r: r.load.ttft(50)), 2),
            "ttft_p90_ms": round(self._med(lambda r: r.load.ttft(90)), 2),
            "ttft_p99_ms": round(self._med(lambda r: r.load.ttft(99)), 2),
            "itl_p50_ms": round(self._med(lambda r: median(r.load.itl_ms)), 3),
            "output_tokens_per_s": round(self._med(lambda r: r.load.output_tokens_per_s), 2),
            "prefill_tokens": int(self._med(lambda r: r.prefill_tokens)),
            "pool_loaded_tokens": int(self._med(lambda r: r.pool_loaded_tokens)),
        }

    def detail(self) -> dict[str, object]:
        """The summary's extras and every run's own figures (for the record beside --json)."""
        runs = [
            {
                "repeat": r.repeat,
                "completed": r.load.completed,
                "failed": r.load.failed,
                "ttft_p50_ms": round(r.load.ttft(50), 2),
                "ttft_p90_ms": round(r.load.ttft(90), 2),
                "ttft_p99_ms": round(r.load.ttft(99), 2),
                "itl_p50_ms": round(median(r.load.itl_ms), 3),
                "prefill_tokens": r.prefill_tokens,
                "pool_loaded_tokens": r.pool_loaded_tokens,
                "requests_per_worker": r.requests_per_worker,
                "frontend_cpu_s": round(r.frontend_cpu_s, 3),
                "nats_msgs": r.nats_msgs,
                "nats_bytes": r.nats_bytes,
                "replay_s": round(r.replay_s, 2),
                "prefill_probe_tokens_per_s": round(r.prefill_probe_tokens_per_s, 1),
                "loadavg_1m_before_after": [round(v, 2) for v in r.loadavg],
                "schedule_lag_p99_ms": r.load.schedule_lag_p99_ms,
            }
            for r in self.runs
        ]
        return {"config": self.config, **self.as_json(), **self.extras(), "runs": runs}

    def extras(self) -> dict[str, object]:
        n = max(1, int(self._med(lambda r: r.load.completed + r.load.failed)))
        return {
            "goodput_rps": self._med(lambda r: r.load.goodput_rps),
            "schedule_lag_p50_ms": self._med(lambda r: r.load.schedule_lag_p50_ms),
            "schedule_lag_p99_ms": self._med(lambda r: r.load.schedule_lag_p99_ms),
            "requests_per_worker": [sorted(r.requests_per_worker, reverse=True) for r in self.runs],
            "frontend_cpu_ms_per_request": self._med(lambda r: r.frontend_cpu_s) * 1000 / n,
            "nats_msgs_per_s": self._med(lambda r: r.nats_msgs / r.replay_s if r.replay_s else 0.0),
            "nats_kib_per_s": self._med(lambda r: r.nats_bytes / 1024 / r.replay_s if r.replay_s else 0.0),
            "nats_bytes_per_request": self._med(lambda r: r.nats_bytes) / n,
        }


def summarise(runs: Sequence[Run]) -> list[Summary]:
    names = list(dict.fromkeys(r.config for r in runs))
    return [Summary(n, runs[0].workers, [r for r in runs if r.config == n]) for n in names]


def format_table(summaries: Sequence[Summary], traffic: Traffic) -> str:
    head = (
        f"{'config':<12} {'done':>5} {'fail':>4} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} "
        f"{'out tok/s':>9} {'goodput':>7} {'lag p99':>7} {'prefill':>8} {'pool-ld':>8} {'fe ms/req':>9} "
        f"{'nats msg/s':>10} {'KiB/s':>7}  req/worker"
    )
    rows = [head, "-" * len(head)]
    for s in summaries:
        j, x = s.as_json(), s.extras()
        rows.append(
            f"{s.config:<12} {j['completed']:>5} {j['failed']:>4} {j['ttft_p50_ms']:>9.1f} {j['ttft_p90_ms']:>8.1f} "
            f"{j['ttft_p99_ms']:>8.1f} {j['itl_p50_ms']:>8.2f} {j['output_tokens_per_s']:>9.1f} "
            f"{x['goodput_rps']:>7.2f} {x['schedule_lag_p99_ms']:>7.1f} {j['prefill_tokens']:>8} "
            f"{j['pool_loaded_tokens']:>8} {x['frontend_cpu_ms_per_request']:>9.2f} "
            f"{x['nats_msgs_per_s']:>10.1f} {x['nats_kib_per_s']:>7.1f}  "
            + " ".join("/".join(map(str, r)) for r in x["requests_per_worker"])  # type: ignore[attr-defined]
        )
    rows.append(
        f"traffic: {traffic.name}: {len(traffic.requests)} requests over {traffic.duration_s:.0f}s, "
        f"{traffic.input_tokens} input tokens, {traffic.unique_prefix_tokens()} in its prefix tree "
        f"(ideal shared cache); {traffic.dropped_too_long} dropped (longer than {MAX_MODEL_LEN})"
    )
    return "\n".join(rows)


def plot(summaries: Sequence[Summary], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in summaries:
        ttft = sorted(t for r in s.runs for t in r.load.ttft_ms)
        ax1.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=s.config)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (ms)")
    ax1.set_ylabel("share of requests")
    ax1.set_title("TTFT CDF (all repeats)")
    ax1.legend()
    names = [s.config for s in summaries]
    ax2.bar(names, [s.as_json()["prefill_tokens"] for s in summaries], color="tab:blue", label="computed")  # type: ignore[misc]
    ax2.bar(
        names,
        [s.as_json()["pool_loaded_tokens"] for s in summaries],  # type: ignore[misc]
        bottom=[s.as_json()["prefill_tokens"] for s in summaries],  # type: ignore[misc]
        color="tab:orange",
        label="loaded from the pool",
    )
    ax2.set_ylabel("prompt tokens (median over repeats)")
    ax2.set_title("prefill tokens computed")
    ax2.legend(loc="lower right")
    ax2.tick_params(axis="x", rotation=20)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def whatif_report(
    runs: Sequence[Run],
    summaries: Sequence[Summary],
    traffic: Traffic,
    trace_file: Path,
    *,
    model: str,
    workers: int,
    work: Path,
) -> str:
    """The same scaled trace through `maru-dynamo whatif`, calibrated on `runs`, beside the real figures."""
    cal = calibration_from_runs(runs, model)
    cal_file = work / "calibration.json"
    write_calibration(cal_file, cal)
    # The what-if needs whole engine blocks per hash id: where the engines' blocks are larger than
    # the trace's, it simulates blocks of the trace's size (the same KV-cache tokens in all).
    block = math.gcd(runs[0].block_size, traffic.block_tokens)
    rows = whatif_rows(
        trace_file,
        cal_file,
        workers=workers,
        trace_block_size=traffic.block_tokens,
        block_size=block,
        gpu_blocks=runs[0].kv_blocks * runs[0].block_size // block,
        pool_size=POOL_SIZE,
        configs=sorted({COUNTERPART[s.config] for s in summaries if s.config in COUNTERPART}),
    )
    return side_by_side([s.as_json() for s in summaries], rows, cal)


def order_for(repeat: int, configs: Sequence[Config]) -> list[Config]:
    """The configurations rotated by `repeat` (each one goes first once in len(configs) repeats)."""
    k = repeat % len(configs)
    return list(configs[k:]) + list(configs[:k])


def parse_configs(text: str) -> list[Config]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in BY_NAME]
    if bad or not names:
        raise TrafficError(f"--configs {text!r}: unknown {bad[0] if bad else 'empty'}; use {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in dict.fromkeys(names)]


def build_traffic(args: argparse.Namespace) -> Traffic:
    if args.synthetic:
        w = PrefixWorkload(
            requests=args.requests or 64,
            input_tokens=args.synthetic_isl,
            output_tokens=args.synthetic_osl,
            prefix_ratio=args.prefix_ratio,
            prefixes=args.prefixes,
            rate=args.rate,
        )
        return synthetic_trace(w, args.trace_block_size)
    path = Path(args.trace)
    if args.requests is not None and args.requests < 1:
        raise TrafficError(f"--requests {args.requests}: use an integer >= 1")
    if args.sample_sessions is None:
        raw = read_mooncake(path, args.requests)
        sample = ""
    else:
        raw = sample_sessions(read_mooncake(path), args.sample_sessions)[: args.requests]
        sample = f", every {args.sample_sessions}th session"
    return scale_trace(
        raw,
        name=f"{path.name}{sample} x{args.trace_block_size}/512 tokens, speedup {args.speedup:g}",
        block_tokens=args.trace_block_size,
        speedup=args.speedup,
        max_output=args.max_output_tokens,
        max_total=MAX_MODEL_LEN,
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    ap.add_argument("--trace-block-size", type=int, default=16, help="tokens per trace hash id here (default 16)")
    ap.add_argument("--speedup", type=float, default=20.0, help="divide the trace's arrival gaps by this")
    ap.add_argument("--requests", type=int, default=None, help="first N requests of the trace (synthetic: 64)")
    ap.add_argument(
        "--sample-sessions",
        type=int,
        default=None,
        metavar="K",
        help="keep every K-th conversation session of the whole trace (all its turns) before --requests",
    )
    ap.add_argument("--max-output-tokens", type=int, default=32, help="cap on each scaled output (default 32)")
    ap.add_argument("--synthetic", action="store_true", help="prefix-ratio synthetic traffic instead of --trace")
    ap.add_argument("--prefix-ratio", type=float, default=0.75)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--synthetic-isl", type=int, default=1024)
    ap.add_argument("--synthetic-osl", type=int, default=16)
    ap.add_argument("--rate", type=float, default=2.0, help="synthetic arrivals per second (Poisson)")
    ap.add_argument("--configs", default=",".join(BY_NAME), help="comma-separated: " + ", ".join(BY_NAME))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", default="tiny", help="fixture name (tiny, bench) or a model directory")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput SLO on TTFT (default 1000)")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the figures as JSON")
    ap.add_argument(
        "--detail-json", type=Path, default=None, metavar="FILE", help="also every run's figures, NATS volume, load"
    )
    ap.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="TTFT CDFs and prefill tokens")
    ap.add_argument("--whatif", action="store_true", help="also replay the trace with maru-dynamo whatif")
    ap.add_argument(
        "--calibration-out",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the what-if calibration measured by these runs (for real_traffic_scale.py)",
    )
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args(argv)
    try:
        configs = parse_configs(args.configs)
        if not 1 <= args.workers <= 16:
            raise TrafficError(f"--workers {args.workers}: use 1 to 16")
        if args.repeats < 1:
            raise TrafficError(f"--repeats {args.repeats}: use an integer >= 1")
        if not args.slo_ttft_ms > 0:
            raise TrafficError(f"--slo-ttft-ms {args.slo_ttft_ms}: use milliseconds > 0")
        traffic = build_traffic(args)
        if not AIPERF_BIN.exists():
            raise TrafficError(f"{AIPERF_BIN}: AIPerf is not installed; run 'make aiperf'")
    except TrafficError as exc:
        print(f"real_traffic.py: error: {exc}", file=sys.stderr)
        return 2
    from maru_dynamo.graphs.run import resolve_model

    model = resolve_model(args.model)
    if not Path(model).is_dir():
        print(f"real_traffic.py: error: --model {args.model}: not a fixture name or a model directory", file=sys.stderr)
        return 2
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="maru-traffic-"))
    traffic_file = traffic.write(work / "trace.jsonl")
    log(f"[traffic] {traffic.name}: {len(traffic.requests)} requests; trace {traffic_file}")
    runs: list[Run] = []
    ok = False
    try:
        for rep in range(args.repeats):
            for cfg in order_for(rep, configs):
                t0 = time.monotonic()
                run = run_config(
                    cfg,
                    traffic_file,
                    traffic,
                    model=model,
                    workers=args.workers,
                    slo_ms=args.slo_ttft_ms,
                    work_dir=work,
                    log=log,
                    repeat=rep,
                )
                runs.append(run)
                log(
                    f"[{cfg.name}] repeat {rep + 1}: done in {time.monotonic() - t0:.0f}s, "
                    f"{run.load.completed} completed, {run.load.failed} failed"
                )
        ok = True
    finally:
        if args.keep_logs or not ok:
            log(f"[traffic] work dir kept: {work}")
    summaries = summarise(runs)
    summaries.sort(key=lambda s: [c.name for c in configs].index(s.config))
    print(format_table(summaries, traffic))
    if args.json:
        doc = {"trace": traffic.name, "requests": len(traffic.requests), "results": [s.as_json() for s in summaries]}
        args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    if args.detail_json:
        doc = {
            "trace": traffic.name,
            "requests": len(traffic.requests),
            "input_tokens": traffic.input_tokens,
            "prefix_tree_tokens": traffic.unique_prefix_tokens(),
            "repeats": args.repeats,
            "order": [[c.name for c in order_for(rep, configs)] for rep in range(args.repeats)],
            "results": [s.detail() for s in summaries],
        }
        args.detail_json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        plot(summaries, args.plot, f"{traffic.name}: {len(traffic.requests)} requests, {args.workers} workers")
    if args.calibration_out:
        try:
            write_calibration(args.calibration_out, calibration_from_runs(runs, model))
        except RuntimeError as exc:
            print(f"real_traffic.py: no calibration: {exc}", file=sys.stderr)
    if args.whatif:
        try:
            print(whatif_report(runs, summaries, traffic, traffic_file, model=model, workers=args.workers, work=work))
        except (RuntimeError, ValueError, OSError) as exc:
            print(f"real_traffic.py: the what-if could not run: {exc}", file=sys.stderr)
            return 1
    if not args.keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
