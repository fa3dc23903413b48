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

Size: the benchmark's driver (configurations, one run, the sweep, its report and JSON); the
load generator, probes, report and what-if live in traffic_load, traffic_probes,
traffic_report and real_traffic_whatif.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from harness import rotated, write_json  # noqa: E402
from lmcache_peer import start_lmcache_server  # noqa: E402
from maru_dynamo.graphs import client  # noqa: E402
from maru_vllm.fixtures.calibration import write_calibration  # noqa: E402
from maru_vllm.launch import ProcessFailed  # noqa: E402
from real_traffic_whatif import cache_config, calibration_from_runs, predict_rates  # noqa: E402
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
from traffic_probes import RatioProbe, engine_timing_probe, prefill_tokens_per_s, recompute_to_load_probe  # noqa: E402
from traffic_report import Summary, format_goodput, format_table, goodput, plot_cdf, plot_sweep, summarise  # noqa: E402

DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
MAX_MODEL_LEN = 4096
ENGINE_BLOCK_TOKENS = 128  # vLLM's KV block on CPU, set explicitly so --kv-cache-tokens means whole blocks
CHUNK_TOKENS = 128  # pool chunk = one engine block: a shared prefix is loadable block by block
STEP_TOKENS = 2048  # prompt tokens per engine step (vLLM CPU's default), set so the what-if knows it
POOL_SIZE = "1G"


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    engine: str  # graph worker engine: vllm (plain dynamo.vllm) or maru
    router_mode: str
    pool_events: bool = True
    description: str = ""
    lmcache: bool = False  # plain workers with LMCache's multiprocess server as their shared cache

    def graph(
        self,
        model: str,
        workers: int,
        kv_transfer: dict[str, object] | None = None,
        *,
        kv_cache_tokens: int | None = None,
        pool_size: str = POOL_SIZE,
    ) -> dict[str, object]:
        """The graph of this configuration; `kv_cache_tokens` sizes every worker's KV cache (whole
        engine blocks, ``--num-gpu-blocks-override``), the same for plain and Maru workers."""
        args: list[str] = [
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--block-size",
            str(ENGINE_BLOCK_TOKENS),
            "--max-num-batched-tokens",
            str(STEP_TOKENS),
        ]
        if kv_cache_tokens is not None:  # and the null block vLLM keeps out of every cache
            args += ["--num-gpu-blocks-override", str(kv_cache_tokens // ENGINE_BLOCK_TOKENS + 1)]
        if self.engine == "maru" and not self.pool_events:
            args.append("--no-maru-pool-events")
        if kv_transfer is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer)]
        return {
            "name": f"traffic-{self.name}",
            "model": model,
            "pool": {"name": "kv", "size": pool_size, "chunk_tokens": CHUNK_TOKENS},
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
LOAD_PARTS = ("acquire", "copy", "release")


@dataclasses.dataclass
class Run:
    """One configuration at one rate, one repeat: AIPerf's view and the engines' counters."""

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
    kv_blocks: int = 0  # with the null block, which never holds KV
    repeat: int = 0
    loadavg: tuple[float, float] = (0.0, 0.0)  # the machine's 1-minute load average before / after the replay
    prefill_probe_tokens_per_s: float = 0.0  # a cold prompt alone (traffic_probes.prefill_tokens_per_s)
    nats_msgs: int = 0  # messages and bytes into nats-server during the replay (its /varz)
    nats_bytes: int = 0
    replay_s: float = 0.0  # wall time of the AIPerf replay
    rate: float = 0.0  # the swept rate: arrivals/s (synthetic) or the trace's speedup
    ratio_probe: RatioProbe | None = None  # cold prefill vs pool hit of a median-length prompt (Maru only)
    load_chunks: int = 0  # pool chunks loaded in the replay and the seconds of each part of their loads
    load_parts: dict[str, float] = dataclasses.field(default_factory=dict)
    timing: dict[str, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)  # engine_timing_probe
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)  # CPU seconds of the replay by role

    @property
    def kv_cache_tokens(self) -> int:
        """The tokens one worker's KV cache holds (its blocks but the null block)."""
        return max(0, self.kv_blocks - 1) * self.block_size


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
    doc = client.get_json(varz_url, timeout=10)
    return int(doc.get("in_msgs", 0)), int(doc.get("in_bytes", 0))


def _metric_sum(url: str, name: str) -> float:
    from maru_vllm.launch.engine_metrics import metric_total, scrape

    return metric_total(scrape(url), name)


LOAD_COUNTERS = ("bytes_loaded", "load_seconds", "chunks_loaded", *(f"load_{p}_seconds" for p in LOAD_PARTS))


def _load_counters(metrics: Sequence[str]) -> dict[str, float]:
    """The connector's load counters summed over the engines (0 for plain engines)."""
    return {k: sum(_metric_sum(m, f"vllm:maru_connector_{k}_total") for m in metrics) for k in LOAD_COUNTERS}


def _cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a live process and its live descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


CPU_ROLES = ("engines", "frontend", "pool", "nats", "lmcache")


def _cpu_by_role(group: Any) -> dict[str, float]:
    """CPU seconds so far of the graph's processes, by role (workers' trees are the engines)."""
    out = dict.fromkeys(CPU_ROLES, 0.0)
    for p in group.processes:
        if p.proc is None or p.proc.poll() is not None:
            continue
        name = p.name
        role = (
            "engines"
            if name.startswith("worker")
            else "frontend"
            if name == "frontend"
            else "nats"
            if name == "nats-server"
            else "lmcache"
            if "lmcache" in name
            else "pool"
            if "pool" in name
            else None
        )
        if role is not None:
            out[role] += _tree_cpu_seconds(p.proc.pid)
    return out


def _children_cpu_seconds() -> float:
    """CPU seconds of this process's waited-for children (AIPerf and everything it started)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _warm_up(url: str, model: str, metrics: Sequence[str], log: Callable[[str], None]) -> None:
    """Distinct short streamed completions until every worker has served one (vLLM compiles its
    sampler on the first sampled request; plain workers are not warmed by the graph)."""
    import concurrent.futures

    from maru_vllm.launch.engine_metrics import read_counters

    def one(i: int) -> None:
        client.completion(url, model, f"warm-up {i} " * 8, max_tokens=4, timeout=120)

    for attempt in range(4):
        with concurrent.futures.ThreadPoolExecutor(len(metrics)) as ex:
            list(ex.map(one, range(attempt * 8, attempt * 8 + 2 * len(metrics))))
        if all(read_counters(m).requests > 0 for m in metrics):
            return
    log("[traffic] warning: not every worker served a warm-up request")


@dataclasses.dataclass(frozen=True)
class Testbed:
    """What every run of one invocation shares: model, workers, the KV cache and pool sizes, SLO."""

    model: str
    workers: int
    slo_ms: float
    kv_cache_tokens: int | None
    pool_size: str
    probe_tokens: int  # the traffic's median prompt length: the recompute-to-load probe's prompt


def run_config(
    cfg: Config,
    traffic_file: Path,
    traffic: Traffic,
    *,
    bed: Testbed,
    work_dir: Path,
    log: Callable[[str], None],
    repeat: int = 0,
    rate: float = 0.0,
) -> Run:
    """A fresh graph for `cfg`, warm-up, probes, AIPerf replay, counters; the graph is stopped after."""
    from maru_dynamo.graphs import plan as graph_plan
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
            lmcache = start_lmcache_server(
                group, gdir / "lmcache-server.log", chunk_tokens=CHUNK_TOKENS, l1_gb=_gib(bed.pool_size)
            )
        except BaseException:
            log(f"[{cfg.name}] LMCache server did not start; its log: {gdir / 'lmcache-server.log'}")
            group.stop_all()
            raise
    graph = cfg.graph(
        bed.model,
        bed.workers,
        lmcache.kv_transfer_config if lmcache is not None else None,
        kv_cache_tokens=bed.kv_cache_tokens,
        pool_size=bed.pool_size,
    )
    spec = parse_graph(graph, f"<{cfg.name}>")
    plan, varz = with_nats_monitoring(graph_plan.build_plan(spec, model=bed.model, work_dir=gdir))
    supervisor = graph_run.supervise(plan, group, out=log)
    try:
        graph_run.start_graph(plan, group, supervisor=supervisor)
        procs = {p.name: p for p in group.processes}
        if cfg.engine == "maru" and cfg.pool_events:
            for w in plan.workers:
                procs[w.name].wait_for_log(r"pool '\S+' synced at seq", timeout=120)
        metrics = [w.metrics_url for w in plan.workers if w.metrics_url]
        _warm_up(plan.url, bed.model, metrics, log)
        timing = engine_timing_probe(plan.url, bed.model, MAX_MODEL_LEN - 8)
        probe = prefill_tokens_per_s(timing["prefill_points"])
        ratio = (
            recompute_to_load_probe(plan.url, bed.model, bed.probe_tokens, chunk_tokens=CHUNK_TOKENS)
            if cfg.engine == "maru"
            else None
        )
        log(
            f"[{cfg.name}] graph ready in {time.monotonic() - t0:.0f}s: {plan.url}; prefill {probe:.0f} tokens/s"
            + (
                f"; {ratio.prompt_tokens}-token prompt cold {ratio.cold_s * 1000:.0f} ms, pool hit "
                f"{ratio.pool_hit_s * 1000:.0f} ms: recompute-to-load {ratio.recompute_to_load:.1f}x"
                if ratio is not None
                else ""
            )
        )
        before = [read_counters(m) for m in metrics]
        prefill_before = sum(_metric_sum(m, "vllm:request_prefill_time_seconds_sum") for m in metrics)
        load_before = _load_counters(metrics)
        front = procs["frontend"]
        assert front.proc is not None
        cpu0 = _cpu_seconds(front.proc.pid)
        roles0, aiperf0 = _cpu_by_role(group), _children_cpu_seconds()
        nats0 = nats_counters(varz)
        load0 = os.getloadavg()[0]
        replay0 = time.monotonic()
        artifacts = gdir / "aiperf"
        tokenizer, tok_env = tokenizer_cache(Path(bed.model), work_dir / "hf-hub")
        cmd = aiperf_command(
            url=plan.url,
            model=bed.model,
            tokenizer=tokenizer,
            trace_file=traffic_file,
            artifact_dir=artifacts,
            block_tokens=traffic.block_tokens,
            slo_ms=bed.slo_ms,
        )
        with open(gdir / "aiperf.log", "wb") as out:
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **tok_env}, check=False
            ).returncode
        if rc != 0:
            tail = (gdir / "aiperf.log").read_text(errors="replace").splitlines()[-25:]
            raise RuntimeError(f"[{cfg.name}] aiperf exited {rc}:\n" + "\n".join(tail))
        cpu1 = _cpu_seconds(front.proc.pid)
        roles1, aiperf1 = _cpu_by_role(group), _children_cpu_seconds()
        replay_s = time.monotonic() - replay0
        cpu = {k: roles1[k] - roles0[k] for k in CPU_ROLES} | {"aiperf": aiperf1 - aiperf0}
        nats1 = nats_counters(varz)
        # Engines count a request's tokens when it finishes; AIPerf returns once every one has.
        after = [read_counters(m) for m in metrics]
        delta = [a - b for a, b in zip(after, before)]
        prefill_after = sum(_metric_sum(m, "vllm:request_prefill_time_seconds_sum") for m in metrics)
        loads = {k: v - load_before[k] for k, v in _load_counters(metrics).items()}
        load = read_aiperf(artifacts)
        block_size, kv_blocks = cache_config(metrics[0])
        return Run(
            cfg.name,
            bed.workers,
            load,
            sum(d.local_compute for d in delta),
            sum(d.local_cache_hit + d.external_kv_transfer for d in delta),
            sum(d.external_kv_transfer for d in delta),
            [d.requests for d in delta],
            cpu1 - cpu0,
            prefill_after - prefill_before,
            int(loads["bytes_loaded"]),
            loads["load_seconds"],
            block_size,
            kv_blocks,
            repeat,
            (load0, os.getloadavg()[0]),
            probe,
            nats1[0] - nats0[0],
            nats1[1] - nats0[1],
            replay_s,
            rate,
            ratio,
            int(loads["chunks_loaded"]),
            {p: loads[f"load_{p}_seconds"] for p in LOAD_PARTS},
            timing,
            cpu,
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


def _gib(size: str) -> int:
    """A pool size (``8G``, ``512M``) in whole GiB, at least 1: the LMCache server's L1 size."""
    from maru_vllm.pool.region import parse_size

    return max(1, parse_size(size) >> 30)


# -- the testbed's ratios --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Ratios:
    """The testbed's ratios, measured in this run, next to a GPU deployment's (module doc)."""

    kv_cache_tokens: int  # per worker, as the engines report their KV cache
    pool_tokens: int  # the pool's bytes over the model's KV bytes per token
    unique_prompt_tokens: int  # the traffic's prefix tree: what an ideal shared cache computes
    recompute_to_load: float | None  # median over the Maru runs' probes
    probe_prompt_tokens: int

    def lines(self) -> list[str]:
        u = max(1, self.unique_prompt_tokens)
        r2l = f"{self.recompute_to_load:.1f}x" if self.recompute_to_load else "not measured (no Maru run)"
        return [
            f"ratios: worker KV cache {self.kv_cache_tokens:,} tokens / {u:,} unique prompt tokens = "
            f"{self.kv_cache_tokens / u:.3f} (deployment: {DEPLOYMENT['kv_over_unique']})",
            f"        pool {self.pool_tokens:,} tokens / unique prompt tokens = {self.pool_tokens / u:.2f} "
            f"(deployment: {DEPLOYMENT['pool_over_unique']})",
            f"        recompute-to-load ({self.probe_prompt_tokens}-token prompt: cold prefill / pool hit) = {r2l} "
            f"(deployment: {DEPLOYMENT['recompute_to_load']})",
        ]


# A GPU deployment's ratios, for the report: an H100 serving a Qwen2.5-32B-sized model (256 KiB of KV
# per token), the what-if's set-up (8 workers of 160k KV tokens, a 1 TB pool) against the full
# Mooncake traces (90.7M unique prompt tokens in the conversation trace, 21.3M in the synthetic
# one), and the seed's 32B request loaded from CXL in 0.124 s against 1.062 s cold.
DEPLOYMENT = {
    "kv_over_unique": "0.014 conversation / 0.060 synthetic trace",
    "pool_over_unique": "0.05 / 0.20 at 1 TB",
    "recompute_to_load": "8.6x",
}


def measured_ratios(runs: Sequence[Run], traffic: Traffic, bed: Testbed) -> Ratios:
    from maru_dynamo.components.whatif.spec import kv_bytes_per_token_of_model
    from maru_vllm.pool.region import parse_size

    kv = sorted(r.kv_cache_tokens for r in runs)
    probes = sorted(r.ratio_probe.recompute_to_load for r in runs if r.ratio_probe is not None)
    return Ratios(
        kv_cache_tokens=kv[len(kv) // 2] if kv else 0,
        pool_tokens=parse_size(bed.pool_size) // kv_bytes_per_token_of_model(bed.model),
        unique_prompt_tokens=traffic.unique_prefix_tokens(),
        recompute_to_load=round(median(probes), 2) if probes else None,
        probe_prompt_tokens=bed.probe_tokens,
    )


def whatif_report(
    runs: Sequence[Run],
    summaries: Sequence[Summary],
    traffic_files: dict[float, Path],
    traffic: Traffic,
    *,
    bed: Testbed,
    work: Path,
) -> tuple[str, dict[tuple[str, float], dict[str, float]]]:
    """The same scaled traffic at each rate through `maru-dynamo whatif`, calibrated on `runs`,
    beside the real figures; and the predictions keyed by (real config, rate) for the plot."""
    cal = calibration_from_runs(runs, bed.model, STEP_TOKENS)
    return predict_rates(
        [s.as_json() for s in summaries],
        traffic_files,
        cal,
        work=work,
        workers=bed.workers,
        trace_block_tokens=traffic.block_tokens,
        engine_block_tokens=runs[0].block_size,
        kv_cache_tokens=runs[0].kv_cache_tokens,
        pool_size=bed.pool_size,
    )


def parse_configs(text: str) -> list[Config]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in BY_NAME]
    if bad or not names:
        raise TrafficError(f"--configs {text!r}: unknown {bad[0] if bad else 'empty'}; use {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in dict.fromkeys(names)]


def parse_sweep(text: str | None, what: str) -> list[float] | None:
    """``--sweep R1,R2,...``: rates > 0, ascending, each once; None without the option."""
    if text is None:
        return None
    try:
        rates = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        rates = []
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise TrafficError(f"--sweep {text!r}: use comma-separated {what} > 0, e.g. 2,4,8")
    return rates


def build_traffic(args: argparse.Namespace, rate: float | None = None) -> Traffic:
    """The traffic at `rate` (synthetic: arrivals per second; trace: the speedup), by default the
    one of ``--rate`` / ``--speedup``. Every rate gives the same requests in the same order."""
    if args.synthetic:
        w = PrefixWorkload(
            requests=args.requests or 64,
            input_tokens=args.synthetic_isl,
            output_tokens=args.synthetic_osl,
            prefix_ratio=args.prefix_ratio,
            prefixes=args.prefixes,
            rate=rate or args.rate,
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
    speedup = rate or args.speedup
    return scale_trace(
        raw,
        name=f"{path.name}{sample} x{args.trace_block_size}/512 tokens, speedup {speedup:g}",
        block_tokens=args.trace_block_size,
        speedup=speedup,
        max_output=args.max_output_tokens,
        max_total=MAX_MODEL_LEN,
    )


def _parser() -> argparse.ArgumentParser:
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
    ap.add_argument(
        "--sweep",
        default=None,
        metavar="R1,R2,...",
        help="run every configuration at each rate (--synthetic: arrivals/s; --trace: the speedup), each on a "
        "fresh graph, and report each configuration's goodput under --slo-ttft-ms",
    )
    ap.add_argument("--configs", default=",".join(BY_NAME), help="comma-separated: " + ", ".join(BY_NAME))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", default="tiny", help="fixture name (tiny, medium, bench) or a model directory")
    ap.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"each worker's KV cache holds N tokens (whole {ENGINE_BLOCK_TOKENS}-token blocks; plain and Maru "
        "workers alike); default: the engine's own size",
    )
    ap.add_argument("--pool-size", default=POOL_SIZE, help=f"the Maru pool and LMCache's L1 (default {POOL_SIZE})")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput SLO on TTFT p90 (default 1000)")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the figures as JSON")
    ap.add_argument(
        "--detail-json", type=Path, default=None, metavar="FILE", help="also every run's figures, NATS volume, load"
    )
    ap.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="one rate: TTFT CDFs and prefill tokens; a sweep: TTFT p90 and prefill tokens against the rate",
    )
    ap.add_argument("--whatif", action="store_true", help="also replay the traffic with maru-dynamo whatif")
    ap.add_argument(
        "--calibration-out",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the what-if calibration measured by these runs (for real_traffic_scale.py)",
    )
    ap.add_argument("--keep-logs", action="store_true")
    return ap


def _validate(args: argparse.Namespace) -> tuple[list[Config], list[float], dict[float, Traffic]]:
    """The configurations, the rates and the traffic at each rate; `TrafficError` names a bad value."""
    from maru_vllm.pool.region import parse_size

    configs = parse_configs(args.configs)
    if not 1 <= args.workers <= 16:
        raise TrafficError(f"--workers {args.workers}: use 1 to 16")
    if args.repeats < 1:
        raise TrafficError(f"--repeats {args.repeats}: use an integer >= 1")
    if not args.slo_ttft_ms > 0:
        raise TrafficError(f"--slo-ttft-ms {args.slo_ttft_ms}: use milliseconds > 0")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < ENGINE_BLOCK_TOKENS * 2:
        raise TrafficError(
            f"--kv-cache-tokens {args.kv_cache_tokens}: use at least {2 * ENGINE_BLOCK_TOKENS} tokens "
            f"(whole {ENGINE_BLOCK_TOKENS}-token blocks)"
        )
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < MAX_MODEL_LEN:
        raise TrafficError(
            f"--kv-cache-tokens {args.kv_cache_tokens}: use at least the context, {MAX_MODEL_LEN} tokens "
            "(vLLM refuses a cache that cannot hold one whole request)"
        )
    try:
        parse_size(args.pool_size)
    except ValueError as exc:
        raise TrafficError(f"--pool-size {args.pool_size!r}: {exc}") from None
    rates = parse_sweep(args.sweep, "arrivals per second" if args.synthetic else "speedups") or [
        args.rate if args.synthetic else args.speedup
    ]
    return configs, rates, {rate: build_traffic(args, rate) for rate in rates}


def sweep(
    args: argparse.Namespace,
    configs: Sequence[Config],
    rates: Sequence[float],
    files: dict[float, Path],
    traffics: dict[float, Traffic],
    *,
    bed: Testbed,
    work: Path,
    log: Callable[[str], None],
    rate_unit: str,
) -> tuple[list[Run], bool]:
    """Every configuration at every rate, `args.repeats` times, rotated: (the runs done, whether
    all were). A run whose graph or load fails is tried once more on a fresh graph; a second
    failure ends the sweep, and what ran so far is still reported (a sweep takes hours here)."""
    runs: list[Run] = []
    for rep in range(args.repeats):
        for i, rate in enumerate(rates):
            for cfg in rotated(configs, rep + i):
                for attempt in (1, 2):
                    t0 = time.monotonic()
                    try:
                        run = run_config(
                            cfg, files[rate], traffics[rate], bed=bed, work_dir=work, log=log, repeat=rep, rate=rate
                        )
                        break
                    except (ProcessFailed, TrafficError, RuntimeError, OSError) as exc:
                        what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                        log(f"[{cfg.name}] {rate_unit} {rate:g}, repeat {rep + 1}, attempt {attempt} failed: {what}")
                        if attempt == 2:
                            log(f"[traffic] sweep stopped; reporting the {len(runs)} run(s) done")
                            return runs, False
                runs.append(run)
                log(
                    f"[{cfg.name}] {rate_unit} {rate:g}, repeat {rep + 1}: done in {time.monotonic() - t0:.0f}s, "
                    f"{run.load.completed} completed, {run.load.failed} failed, "
                    f"TTFT p90 {run.load.ttft(90):.0f} ms, prefill {run.prefill_tokens}"
                )
    return runs, True


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        configs, rates, traffics = _validate(args)
        if not AIPERF_BIN.exists():
            raise TrafficError(f"{AIPERF_BIN}: AIPerf is not installed; run 'make aiperf'")
    except TrafficError as exc:
        print(f"real_traffic.py: error: {exc}", file=sys.stderr)
        return 2
    from maru_dynamo.graphs.plan import resolve_model

    model = resolve_model(args.model)
    if not Path(model).is_dir():
        print(f"real_traffic.py: error: --model {args.model}: not a fixture name or a model directory", file=sys.stderr)
        return 2
    traffic = traffics[rates[0]]
    lengths = sorted(r.input_length for r in traffic.requests)
    bed = Testbed(
        model, args.workers, args.slo_ttft_ms, args.kv_cache_tokens, args.pool_size, lengths[len(lengths) // 2]
    )
    rate_unit = "req/s" if args.synthetic else "speedup"
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="maru-traffic-"))
    files = {rate: t.write(work / f"trace-{rate:g}.jsonl") for rate, t in traffics.items()}
    log(f"[traffic] {traffic.name}: {len(traffic.requests)} requests at {len(rates)} rate(s) ({rate_unit}) {rates}")
    runs: list[Run] = []
    ok = False
    try:
        runs, ok = sweep(args, configs, rates, files, traffics, bed=bed, work=work, log=log, rate_unit=rate_unit)
    finally:
        if args.keep_logs or not ok:
            log(f"[traffic] work dir kept: {work}")
    if not runs:
        return 1
    summaries = summarise(runs, [c.name for c in configs])
    ratios = measured_ratios(runs, traffic, bed)
    good = goodput(summaries, args.slo_ttft_ms)
    print(format_table(summaries, rate_unit))
    print(
        f"traffic: {traffic.name.rsplit(', speedup', 1)[0]}: {len(traffic.requests)} requests, "
        f"{traffic.input_tokens} input tokens, {traffic.unique_prefix_tokens()} in its prefix tree (ideal shared "
        f"cache); {traffic.dropped_too_long} dropped (longer than {MAX_MODEL_LEN})"
    )
    print("\n".join(ratios.lines()))
    print(format_goodput(good, rate_unit))
    predicted: dict[tuple[str, float], dict[str, float]] = {}
    rc = 0 if ok else 1
    if args.whatif:
        try:
            text, predicted = whatif_report(runs, summaries, files, traffic, bed=bed, work=work)
            print(text)
        except (RuntimeError, ValueError, OSError) as exc:
            print(f"real_traffic.py: the what-if could not run: {exc}", file=sys.stderr)
            rc = 1
    doc: dict[str, object] = {
        "trace": traffic.name,
        "requests": len(traffic.requests),
        "rate_unit": rate_unit,
        "kv_cache_tokens": ratios.kv_cache_tokens,
        "pool_tokens": ratios.pool_tokens,
        "unique_prompt_tokens": ratios.unique_prompt_tokens,
        "recompute_to_load": ratios.recompute_to_load,
        "goodput": good,
        "complete": ok,
        "results": [
            {**s.as_json(), **({"whatif": predicted[(s.config, s.rate)]} if (s.config, s.rate) in predicted else {})}
            for s in summaries
        ],
    }
    if args.json:
        write_json(args.json, doc, indent=1)
    if args.detail_json:
        detail = {
            **{k: v for k, v in doc.items() if k != "results"},
            "argv": list(argv) if argv is not None else sys.argv[1:],
            "calibration": msgspec.to_builtins(calibration_from_runs(runs, model, STEP_TOKENS)),
            "input_tokens": traffic.input_tokens,
            "prefix_tree_tokens": traffic.unique_prefix_tokens(),
            "repeats": args.repeats,
            "order": [
                [[c.name for c in rotated(configs, rep + i)] for i in range(len(rates))] for rep in range(args.repeats)
            ],
            "results": [s.detail() for s in summaries],
        }
        write_json(args.detail_json, detail, indent=1)
    if args.plot:
        title = f"{traffic.name.rsplit(', speedup', 1)[0]}: {len(traffic.requests)} requests, {args.workers} workers"
        if len(rates) > 1:
            label = "arrivals per second" if args.synthetic else "trace speedup"
            plot_sweep(summaries, args.plot, title, slo_ms=args.slo_ttft_ms, rate_label=label, predicted=predicted)
        else:
            plot_cdf(summaries, args.plot, title)
    if args.calibration_out:
        try:
            write_calibration(args.calibration_out, calibration_from_runs(runs, model, STEP_TOKENS))
        except RuntimeError as exc:
            print(f"real_traffic.py: no calibration: {exc}", file=sys.stderr)
    if not args.keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
