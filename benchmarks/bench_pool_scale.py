#!/usr/bin/env python3
"""Scale benchmark: a pool of 10^5-10^6 connector chunks, the event relay, and Dynamo's KV router.

Everything is the real component, each in its own process: nats-server, the pool service
(`python -m maru_vllm.pool serve`), a worker stand-in running our `KvEventRelay` plus Dynamo's
own `KvEventPublisher` on a served Dynamo endpoint (what `dynamo.vllm` + our hook run, minus the
engine), and Dynamo's `KvRouter` (`maru_dynamo.components.router_probe`). Chunks are what
MaruKVConnector commits (`ChunkMeta`: block hashes, token ids; `--chunk-tokens` per chunk,
`--chunks-per-prompt` chained chunks per prompt) with empty payloads - the pool's metadata and
the router's state do not depend on payload size, and a 1 TB region does not fit here.

A host runs one pool and W workers, each with its own relay; `--workers W ...` measures each W
on the same filled pool, with a fresh router and W fresh worker stand-ins per W:

* fill: commits/s into the pool, and the service's RSS per chunk, whole (VmRSS, which counts
  the region pages the service itself wrote: object metadata) and private (RssAnon);
* resync of all W at once (as after a host restart): relay start -> Dynamo's router credits the
  last prompt at the host tier to every worker (`resync_all_s`); relay+publisher RSS (the
  largest process, and what the relay added to it once synced), its peak during the resync,
  once the router credits all, and once glibc's malloc was asked to return free memory
  (`relay_rss_peak_mib`, `_settled_mib`, `_trimmed_mib`), the relay's own tables
  (`relay_view_mib`) and the most bytes of batches that waited in the relay for Dynamo's
  publisher (`relay_unsent_max_mib`);
* router memory: the router process's RSS before and after it holds every pool block for W
  workers (per block and worker);
* events: chunks/s from commit to router credit at every worker for `--live-chunks` new chunks,
  the lag of the last one, and one chunk's commit -> credit on a quiet pool;
* lookup: p50/p99 of `KvRouter.get_overlap_scores` for random pool prompts (timed inside the
  router process), each checked to match every block at the host tier for every worker;
* one relay restarted (its worker restarts) while the others run: start -> router credit
  (`resync_s`), and the pool service's RSS at the end;
* with `--announce-cap N`, that relay restarted once more announcing at most N chunks (the
  pool's most recently used): its resync, RSS, and the share of random pool prompts the router
  then credits to it in full (`capped_*`).

The stand-ins' publishers run without Dynamo's worker-local KV indexer unless `--local-indexer`
(dynamo.vllm turns it on by default; it holds every announced block in the worker too).

`--memory` instead measures the service's RSS per object for the issue's two cases (50,000
empty objects; 40,000 objects with ~2 KiB connector metadata), optionally against another
checkout (`--code-root`) for a before/after comparison.

Usage: python benchmarks/bench_pool_scale.py [--chunks 100000 1000000] [--workers 1 4 8] [--json out.json]
       python benchmarks/bench_pool_scale.py --memory [--code-root DIR]
`--json` writes the last run's figures at the top level (`chunks`, `workers`, `relay_rss_mib`,
`resync_s`, `resync_all_s`, `service_rss_mib`, `router_rss_mib`, `lookup_p50_ms`, ...) and every
run under `runs`. 10^6 chunks need ~1 GiB for the pool service plus a 1.7 GiB region in /dev/shm
(the chunks' metadata lives there), ~0.8-0.9 GiB of router per worker and ~1 GiB per worker
stand-in (most of it vLLM's imports); W=8 at 10^6 needs ~20 GiB free.

Size: one benchmark whose stages (fill, resync, relay restarts, router memory) share its
stand-ins and measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import write_json  # noqa: E402 - benchmarks/ is on sys.path when a script runs
from maru_vllm.connector.chunks import ChunkGeometry, chunk_key  # noqa: E402
from maru_vllm.launch import ProcessGroup, free_port  # noqa: E402
from maru_vllm.launch.lines import StdoutLines  # noqa: E402
from maru_vllm.launch.stack import NATS_READY_PATTERN, PoolProcess, StackEnv, nats_server  # noqa: E402
from maru_vllm.pool import PoolClient  # noqa: E402

NS = "kv:bench:1"
ENDPOINT = "bench.backend.generate"
MiB = 1 << 20


# -- workload --------------------------------------------------------------------------------
class Workload:
    """Prompts of `chunks_per_prompt` chained chunks; block hashes like vLLM's (32 bytes)."""

    def __init__(self, block_size: int, chunk_tokens: int, chunks_per_prompt: int) -> None:
        self.geometry = ChunkGeometry(block_size, chunk_tokens // block_size)
        self.cpp = chunks_per_prompt

    def prompt_tokens(self, p: int) -> list[int]:
        rng = random.Random(p)
        return [rng.randrange(150_000) for _ in range(self.cpp * self.geometry.chunk_tokens)]

    def prompt_hashes(self, p: int) -> list[bytes]:
        n = self.cpp * self.geometry.blocks_per_chunk
        return [hashlib.blake2b(b"%d/%d" % (p, b), digest_size=32).digest() for b in range(n)]

    def chunks(self, first_prompt: int, prompts: int):
        """(key, ChunkMeta) of every chunk of prompts first_prompt.., in prompt order."""
        g = self.geometry
        for p in range(first_prompt, first_prompt + prompts):
            tokens, hashes = self.prompt_tokens(p), self.prompt_hashes(p)
            for c in range(self.cpp):
                yield chunk_key(g.chunk_hash(hashes, c), 0), g.chunk_meta(hashes, tokens, c, None)


def fill(client: PoolClient, work: Workload, first_prompt: int, prompts: int, batch: int = 1000) -> tuple[int, float]:
    """Store the prompts' chunks; (stored, seconds spent in reserve+commit)."""
    stored, spent = 0, 0.0
    items: list[tuple[bytes, Any]] = []

    def flush() -> None:
        nonlocal stored, spent, items
        t0 = time.perf_counter()
        res = client.reserve([(k, 0) for k, _ in items], NS)
        ok = client.commit([r for r in res if r], [m for (_, m), r in zip(items, res) if r])
        spent += time.perf_counter() - t0
        stored += sum(ok)
        items = []

    for item in work.chunks(first_prompt, prompts):
        items.append(item)
        if len(items) >= batch:
            flush()
    if items:
        flush()
    return stored, spent


# -- processes -------------------------------------------------------------------------------
def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_private(pid: int) -> int:
    """The process's private resident memory (RssAnon): its RSS without the shared-memory pages
    it touched, which for the pool service are the region's (payloads and object metadata)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_anon(pid: int) -> int:
    """The process's anonymous resident memory (RssAnon): heap, arenas, anonymous maps."""
    return rss_private(pid)


def malloc_trim() -> bool:
    """Ask glibc's malloc to give free memory back to the system (False where there is none)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0) >= 0)
    except (OSError, AttributeError):
        return False


class PeakRss:
    """The largest RSS of `pid`, sampled every 50 ms in a thread until `stop()`."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss(self.pid))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


class Stack:
    """nats-server + pool service + (later) router probe and worker stand-in, in a temp dir."""

    def __init__(
        self, chunks: int, code_root: Path = REPO, nats: bool = True, shared_snapshot_pages: int | None = None
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
        self.name = f"scale-{uuid.uuid4().hex[:8]}"
        self.procs: list[subprocess.Popen] = []
        self.servers = ProcessGroup()
        self.nats_url = None
        if nats:
            if shutil.which("nats-server") is None:
                raise SystemExit("nats-server is not on PATH (make setup installs it)")
            nats_proc, self.nats_url = nats_server(self.dir)
            self.servers.start(nats_proc).wait_for_log(NATS_READY_PATTERN, timeout=30)
        # per chunk: 64 B header of the empty payload, its ~1.2 KiB metadata block, slab slack
        size = max(64 * MiB, chunks * 1792)
        self.pool = PoolProcess(
            self.name,
            size,
            self.dir / "pool.log",
            listen=[f"unix://{self.dir / 'pool.sock'}"],
            nats=self.nats_url,
            extra_args=[
                "--log-level",
                "WARNING",
                "--max-objects",
                str(2 * chunks + 100_000),
                "--metadata-budget",
                "16G",
                *([] if shared_snapshot_pages is None else ["--shared-snapshot-pages", str(shared_snapshot_pages)]),
            ],
            env=dict(os.environ, PYTHONPATH=str(code_root)),
            cwd=code_root,
        )
        self.servers.add(self.pool)
        self.address = self.pool.serve().address
        self.env = StackEnv(discovery_dir=self.dir / "discovery", nats_url=self.nats_url).build(
            PYTHONPATH=str(REPO), DYN_LOG=os.environ.get("BENCH_DYN_LOG", "warn")
        )

    def _spawn(
        self, cmd: list[str], log: str, env: dict[str, str] | None = None, cwd: Path = REPO, stdin: bool = False
    ) -> subprocess.Popen:
        p = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=open(self.dir / log, "ab"),
            text=True,
            env=dict(os.environ, **(env or {})),
            cwd=cwd,
            stdin=subprocess.PIPE if stdin else None,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def print_logs(self, tail: int = 3000) -> None:
        for log in sorted(self.dir.glob("*.log")):
            print(f"--- {log.name} (last {tail} chars)\n{log.read_text(errors='replace')[-tail:]}", file=sys.stderr)

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.servers.stop_all(15)
        self.pool.region_path.unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)


class Router:
    """Dynamo's KvRouter in its own process (maru_dynamo.components.router_probe)."""

    def __init__(self, stack: Stack, block_size: int, log: str = "router.log", event_threads: int = 4) -> None:
        self.proc = stack._spawn(
            [
                sys.executable,
                "-m",
                "maru_dynamo.components.router_probe",
                "--endpoint",
                ENDPOINT,
                "--block-size",
                str(block_size),
                "--timeout",
                "300",
                "--event-threads",
                str(event_threads),
            ],
            log=log,
            env=stack.env,
            stdin=True,
        )
        self.lines = StdoutLines(self.proc)

    def scores(self, tokens: list[int]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"token_ids": tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.lines.wait_for("{", 120))

    def host_blocks(self, tokens: list[int]) -> dict[int, int]:
        """Host-tier blocks of `tokens` the router credits, per worker id."""
        rows = self.scores(tokens).get("workers") or []
        return {int(r.get("worker_id") or 0): int(r.get("host_pinned_blocks") or 0) for r in rows}

    def wait_credit(self, tokens: list[int], blocks: int, workers: set[int], timeout: float) -> float:
        """Poll until the router credits `blocks` host blocks of `tokens` to every worker in
        `workers`; the wall time then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            credited = self.host_blocks(tokens)
            if all(credited.get(w, 0) >= blocks for w in workers):
                return time.time()
            time.sleep(0.05)
        raise TimeoutError(f"router did not credit {blocks} blocks to workers {sorted(workers)} within {timeout}s")

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Worker:
    """One worker stand-in process (`--role worker`): a Dynamo endpoint, our relay, Dynamo's publisher."""

    def __init__(self, stack: Stack, args: argparse.Namespace, log: str, announce_cap: int | None = None) -> None:
        self.proc = stack._spawn(
            [
                sys.executable,
                __file__,
                "--role",
                "worker",
                "--pool-address",
                stack.address,
                "--pool-name",
                stack.name,
                "--nats",
                stack.nats_url or "",
                "--block-size",
                str(args.block_size),
                "--timeout",
                str(args.timeout),
                *(["--local-indexer"] if args.local_indexer else []),
                *(["--announce-cap", str(announce_cap)] if announce_cap else []),
            ],
            log=log,
            env=stack.env,
            stdin=True,
        )
        self.lines = StdoutLines(self.proc)
        self.worker_id = 0
        self.synced: dict[str, Any] = {}

    def wait_serving(self) -> None:
        self.worker_id = int(self.lines.wait_for("serving", 180).split()[1])

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_synced(self, timeout: float) -> dict[str, Any]:
        self.synced = json.loads(self.lines.wait_for("{", timeout))
        return self.synced

    def rss(self) -> int:
        return rss(self.proc.pid) if self.proc.poll() is None else 0

    def memory(self, timeout: float = 60.0) -> dict[str, Any]:
        """Its RSS now, its largest since the relay started, and its RSS once glibc's malloc
        was asked to give free memory back (`rss_trimmed`; None without glibc)."""
        self.send("mem")
        return json.loads(self.lines.wait_for("{", timeout))

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# -- worker stand-in (child process) ---------------------------------------------------------
async def worker_main(args: argparse.Namespace) -> None:
    """A served Dynamo endpoint + Dynamo's KvEventPublisher fed by our KvEventRelay."""
    from dynamo.llm import KvEventPublisher, ModelInput, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    from maru_vllm.events.nats_source import PoolSourceConfig
    from maru_vllm.events.pool_view import NamespaceFilter
    from maru_vllm.events.relay import KvEventRelay

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp")
    endpoint = runtime.endpoint(ENDPOINT)

    async def generate(request: Any, context: Any = None):  # never called: the bench only routes
        yield {"ok": True}

    serving = asyncio.ensure_future(endpoint.serve_endpoint(generate))
    # A model card, as dynamo.vllm registers one: the router ignores KV events of a worker without
    await register_model(
        ModelInput.Tokens,
        ModelType.Completions,
        endpoint,
        "maru-scale-bench",
        "maru-scale-bench",
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=args.block_size,
        skip_model_assets=True,
    )
    print(f"serving {endpoint.connection_id()}", flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.readline()  # "go": the router is up and subscribed
    rss_before = rss(os.getpid())
    peak = PeakRss(os.getpid())
    cpu0 = cpu_s(os.getpid())
    t0 = time.time()
    relay = KvEventRelay(
        upstream=f"tcp://127.0.0.1:{free_port()}",  # no engine: nothing publishes vLLM events here
        pool=PoolSourceConfig(args.nats, args.pool_name, pool_address=args.pool_address, request_timeout_s=120),
        namespaces=NamespaceFilter.exactly(NS),
        block_size=args.block_size,
        max_announced_chunks=args.announce_cap,
    )
    relay_endpoint = await relay.start()
    publisher = KvEventPublisher(
        endpoint=endpoint,
        kv_block_size=args.block_size,
        zmq_endpoint=relay_endpoint,
        enable_local_indexer=args.local_indexer,
    )
    assert relay.source is not None
    await relay.source.wait_synced(args.timeout)
    t1 = time.time()
    print(
        json.dumps(
            {
                "relay_start": t0,
                "synced": t1,
                "objects": len(relay.view),
                "rss_before": rss_before,
                "rss": rss(os.getpid()),
                "view_bytes": relay.view.nbytes,
                "cpu_s": cpu_s(os.getpid()) - cpu0,  # the relay and Dynamo's publisher, start -> synced
                "full_announcements": relay.stats.full_announcements,
            }
        ),
        flush=True,
    )
    while True:  # report relay progress (and, on "mem", memory) on request
        line = await reader.readline()
        if not line:
            break
        report: dict[str, Any] = {"stats": relay.stats.__dict__, "source": relay.source.stats.__dict__}
        report.update(rss=rss(os.getpid()), anon=rss_anon(os.getpid()), peak=peak.peak)
        if line.strip() == b"mem":  # what glibc would hand back: the rest is held, not cached
            report["rss_trimmed"] = rss(os.getpid()) if malloc_trim() else None
        print(json.dumps(report), flush=True)
    peak.stop()
    del publisher
    await relay.stop()
    serving.cancel()
    runtime.shutdown()


# -- one pool size, W workers ----------------------------------------------------------------
def start_workers(stack: Stack, args: argparse.Namespace, n: int, tag: str) -> tuple[Router, list[Worker]]:
    """A fresh router and `n` fresh worker stand-ins, all serving, the router subscribed."""
    workers = [Worker(stack, args, f"worker-{tag}-{i}.log") for i in range(n)]
    for w in workers:
        w.wait_serving()
    router = Router(stack, args.block_size, log=f"router-{tag}.log", event_threads=args.router_event_threads)
    router.lines.wait_for("ready", 300)
    time.sleep(1.0)  # let the router's event subscription settle
    return router, workers


def run_workers(
    args: argparse.Namespace, stack: Stack, client: PoolClient, work: Workload, prompts: int, n_workers: int, out: dict
) -> tuple[dict[str, Any], int]:
    """W relays on the filled pool: resync of all W at once, live events, lookups, one relay's
    restart. Returns (results, prompts in the pool now)."""
    bpc = work.geometry.blocks_per_chunk
    full = args.chunks_per_prompt * bpc
    res: dict[str, Any] = dict(
        out, workers=n_workers, router_event_threads=args.router_event_threads, local_indexer=args.local_indexer
    )
    tag = f"{out['chunks']}-w{n_workers}"
    router, workers = start_workers(stack, args, n_workers, tag)
    try:
        res["router_rss_empty_mib"] = rss(router.proc.pid) / MiB
        last = work.prompt_tokens(prompts - 1)
        cpu0 = (cpu_s(stack.pool.pid), cpu_s(router.proc.pid))
        pages0 = client.stats()
        for w in workers:  # all W together, as after a host's restart
            w.send("go")
        synced = [w.wait_synced(args.timeout) for w in workers]
        credited = router.wait_credit(last, full, {w.worker_id for w in workers}, args.timeout)
        # where the time went: CPU seconds of each part, start -> the router credits all
        res["resync_all_cpu_service_s"] = cpu_s(stack.pool.pid) - cpu0[0]
        res["resync_all_cpu_router_s"] = cpu_s(router.proc.pid) - cpu0[1]
        pages1 = client.stats()
        for k in ("snapshot_pages_encoded", "snapshot_pages_shared"):
            res[f"resync_all_{k}"] = pages1.get(k, 0) - pages0.get(k, 0)
        res["resync_all_cpu_relay_s"] = max(s["cpu_s"] for s in synced)  # relay + publisher, the busiest
        res["resync_all_full_announcements"] = sum(s["full_announcements"] for s in synced)
        start = min(s["relay_start"] for s in synced)
        res["resync_all_s"] = credited - start
        res["resync_all_relay_s"] = max(s["synced"] for s in synced) - start
        res["relay_objects"] = synced[0]["objects"]
        res["relay_rss_mib"] = max(s["rss"] for s in synced) / MiB
        res["relay_rss_delta_mib"] = max(s["rss"] - s["rss_before"] for s in synced) / MiB
        res["process_rss_before_relay_mib"] = max(s["rss_before"] for s in synced) / MiB
        time.sleep(2.0)
        # where the growth is: the largest RSS during the resync, RSS once the router credits
        # all (the publisher has sent everything), and what of it is free memory malloc keeps
        mem = [w.memory() for w in workers]
        res["relay_rss_peak_mib"] = max(m["peak"] for m in mem) / MiB
        res["relay_rss_settled_mib"] = max(m["rss"] for m in mem) / MiB
        if all(m.get("rss_trimmed") for m in mem):
            res["relay_rss_trimmed_mib"] = max(m["rss_trimmed"] for m in mem) / MiB
        res["relay_view_mib"] = max(s["view_bytes"] for s in synced) / MiB
        res["relay_unsent_max_mib"] = max(m["stats"].get("unsent_max_bytes", 0) for m in mem) / MiB
        res["router_rss_mib"] = rss(router.proc.pid) / MiB
        res["router_rss_per_block_worker_b"] = (
            (res["router_rss_mib"] - res["router_rss_empty_mib"]) * MiB / (out["blocks"] * n_workers)
        )
        print(
            f"[{out['chunks']} x W={n_workers}] resync of all: relays {res['resync_all_relay_s']:.1f} s, router "
            f"credits all {res['resync_all_s']:.1f} s (CPU s: relay+publisher {res['resync_all_cpu_relay_s']:.1f} "
            f"each at most, pool {res['resync_all_cpu_service_s']:.1f}, router {res['resync_all_cpu_router_s']:.1f}; "
            f"pool pages encoded {res['resync_all_snapshot_pages_encoded']}, shared "
            f"{res['resync_all_snapshot_pages_shared']}); "
            f"relay+publisher RSS {res['relay_rss_mib']:.0f} MiB "
            f"(+{res['relay_rss_delta_mib']:.0f} MiB for the relay, its tables {res['relay_view_mib']:.0f} MiB; "
            f"peak {res['relay_rss_peak_mib']:.0f}, settled {res['relay_rss_settled_mib']:.0f}, malloc-trimmed "
            f"{res.get('relay_rss_trimmed_mib', float('nan')):.0f} MiB); router RSS {res['router_rss_empty_mib']:.0f} "
            f"-> {res['router_rss_mib']:.0f} MiB",
            flush=True,
        )

        # live events: new chunks from commit to router credit at every worker
        live_prompts = max(1, args.live_chunks // args.chunks_per_prompt)
        t0 = time.time()
        n, _ = fill(client, work, prompts, live_prompts, batch=64)
        t_committed = time.time()
        ids = {w.worker_id for w in workers}
        t_credit = router.wait_credit(work.prompt_tokens(prompts + live_prompts - 1), full, ids, args.timeout)
        prompts += live_prompts
        res["live_chunks"] = n
        res["commit_chunks_per_s"] = n / (t_committed - t0)
        res["event_chunks_per_s"] = n / (t_credit - t0)  # per worker; the router handles W times as many
        res["event_lag_s"] = t_credit - t_committed  # last commit -> router credit at every worker
        # one chunk on a quiet pool: its commit -> credit at every worker
        t0 = time.time()
        fill(client, work, prompts, 1, batch=64)
        res["event_lag_one_ms"] = 1000 * (router.wait_credit(work.prompt_tokens(prompts), full, ids, 60) - t0)
        prompts += 1
        print(
            f"[{out['chunks']} x W={n_workers}] events: {n} chunks committed at {res['commit_chunks_per_s']:.0f}/s, "
            f"credited at every worker at {res['event_chunks_per_s']:.0f} chunks/s (router: "
            f"{res['event_chunks_per_s'] * n_workers:.0f} chunk events/s), last one {res['event_lag_s']:.2f} s after "
            f"its commit; one chunk on a quiet pool {res['event_lag_one_ms']:.0f} ms",
            flush=True,
        )

        rng = random.Random(7)
        lat, wrong = [], 0
        for _ in range(args.lookups):
            p = rng.randrange(prompts - 1)
            s = router.scores(work.prompt_tokens(p))
            lat.append(s["probe_lookup_s"])
            rows = s.get("workers") or []
            wrong += sum(int(r.get("host_pinned_blocks") or 0) != full for r in rows) + (len(rows) != n_workers)
        lat.sort()
        res["lookup_p50_ms"] = 1000 * statistics.median(lat)
        res["lookup_p99_ms"] = 1000 * lat[int(0.99 * (len(lat) - 1))]
        res["lookups_not_fully_matched"] = wrong
        print(
            f"[{out['chunks']} x W={n_workers}] lookup ({full} blocks/prompt): p50 {res['lookup_p50_ms']:.3f} ms, "
            f"p99 {res['lookup_p99_ms']:.3f} ms; {wrong} of {args.lookups} x {n_workers} rows not fully matched",
            flush=True,
        )

        # one relay restarts (its worker restarts) while the others keep running
        again, s, credited, (res["resync_cpu_service_s"], res["resync_cpu_router_s"]) = restart_relay(
            args, stack, router, work, prompts, workers, f"worker-{tag}-restart.log"
        )
        res["resync_cpu_relay_s"] = s["cpu_s"]
        m = again.memory()
        res["restart_rss_synced_mib"], res["restart_rss_peak_mib"] = s["rss"] / MiB, m["peak"] / MiB
        res["restart_rss_delta_mib"] = (s["rss"] - s["rss_before"]) / MiB
        res["resync_s"] = credited - s["relay_start"]
        res["resync_relay_s"] = s["synced"] - s["relay_start"]
        res["relay_rss_mib"] = max(res["relay_rss_mib"], s["rss"] / MiB, *(w.rss() / MiB for w in workers))
        res["service_rss_mib"] = rss(stack.pool.pid) / MiB
        res["service_private_end_mib"] = rss_private(stack.pool.pid) / MiB
        print(
            f"[{out['chunks']} x W={n_workers}] one relay restarted: synced {res['resync_relay_s']:.1f} s, router "
            f"credits all {res['resync_s']:.1f} s after its start (CPU s: relay+publisher "
            f"{res['resync_cpu_relay_s']:.1f}, pool {res['resync_cpu_service_s']:.1f}, "
            f"router {res['resync_cpu_router_s']:.1f}); its RSS +{res['restart_rss_delta_mib']:.0f} MiB once synced "
            f"(peak {res['restart_rss_peak_mib']:.0f} MiB); pool service RSS "
            f"{res['service_rss_mib']:.0f} MiB (private {res['service_private_end_mib']:.0f} MiB)",
            flush=True,
        )
        if args.announce_cap:
            run_capped_restart(args, stack, router, work, prompts, workers, res, tag)
    finally:
        for w in workers:
            w.stop()
        router.stop()
    return res, prompts


def restart_relay(
    args: argparse.Namespace,
    stack: Stack,
    router: Router,
    work: Workload,
    prompts: int,
    workers: list[Worker],
    log: str,
    announce_cap: int | None = None,
) -> tuple[Worker, dict[str, Any], float, tuple[float, float]]:
    """Worker 0 restarts (its relay resyncs) while the others keep running: the new worker, its
    sync report, when the router credited it the last prompt committed in full, and the pool's
    and the router's CPU seconds meanwhile."""
    full = args.chunks_per_prompt * work.geometry.blocks_per_chunk
    workers[0].stop()
    again = Worker(stack, args, log, announce_cap=announce_cap)
    workers[0] = again
    again.wait_serving()
    time.sleep(1.0)
    cpu0 = (cpu_s(stack.pool.pid), cpu_s(router.proc.pid))
    again.send("go")
    s = again.wait_synced(args.timeout)
    credited = router.wait_credit(work.prompt_tokens(prompts - 1), full, {again.worker_id}, args.timeout)
    return again, s, credited, (cpu_s(stack.pool.pid) - cpu0[0], cpu_s(router.proc.pid) - cpu0[1])


def run_capped_restart(
    args: argparse.Namespace,
    stack: Stack,
    router: Router,
    work: Workload,
    prompts: int,
    workers: list[Worker],
    res: dict[str, Any],
    tag: str,
) -> None:
    """Worker 0 restarts with a relay that announces at most `--announce-cap` chunks (the pool's
    most recently used): its resync, memory, and what share of random pool prompts the router
    then credits to it in full."""
    cap = args.announce_cap
    full = args.chunks_per_prompt * work.geometry.blocks_per_chunk
    # the last prompt committed is among the most recently used: credited once the resync is through
    capped, s, credited, (cpu_service, cpu_router) = restart_relay(
        args, stack, router, work, prompts, workers, f"worker-{tag}-capped.log", announce_cap=cap
    )
    m = capped.memory()
    res.update(
        announce_cap=cap,
        capped_objects=s["objects"],
        capped_resync_s=credited - s["relay_start"],
        capped_resync_relay_s=s["synced"] - s["relay_start"],
        capped_cpu_relay_s=s["cpu_s"],
        capped_cpu_service_s=cpu_service,
        capped_cpu_router_s=cpu_router,
        capped_rss_delta_mib=(s["rss"] - s["rss_before"]) / MiB,
        capped_rss_peak_mib=m["peak"] / MiB,
        capped_view_mib=s["view_bytes"] / MiB,
    )
    rng = random.Random(11)
    sample = [rng.randrange(prompts) for _ in range(min(args.lookups, 500))]
    matched = sum(router.host_blocks(work.prompt_tokens(p)).get(capped.worker_id, 0) >= full for p in sample)
    res["capped_prompts_credited_share"] = matched / len(sample)
    # what a cap on the most recently used chunks can credit of prompts drawn uniformly from the pool
    res["capped_expected_share"] = min(1.0, cap / (prompts * args.chunks_per_prompt))
    print(
        f"[{res['chunks']} x W={res['workers']}] relay restarted with an announce cap of {cap} chunks: "
        f"{s['objects']} objects, synced {res['capped_resync_relay_s']:.1f} s, router credits the newest "
        f"{res['capped_resync_s']:.1f} s after its start (CPU s: relay+publisher {s['cpu_s']:.1f}, pool "
        f"{res['capped_cpu_service_s']:.1f}, router {res['capped_cpu_router_s']:.1f}); its RSS "
        f"+{res['capped_rss_delta_mib']:.0f} MiB once synced (tables {res['capped_view_mib']:.1f} MiB); "
        f"{100 * res['capped_prompts_credited_share']:.1f}% of {len(sample)} random pool prompts credited in full "
        f"(the cap's share of the pool: {100 * res['capped_expected_share']:.1f}%)",
        flush=True,
    )


def run_scale(args: argparse.Namespace, chunks: int) -> list[dict[str, Any]]:
    work = Workload(args.block_size, args.chunk_tokens, args.chunks_per_prompt)
    prompts = chunks // args.chunks_per_prompt
    bpc = work.geometry.blocks_per_chunk
    out: dict[str, Any] = {
        "chunks": prompts * args.chunks_per_prompt,
        "blocks": prompts * args.chunks_per_prompt * bpc,
        "block_size": args.block_size,
        "chunk_tokens": args.chunk_tokens,
    }
    results = []
    # Room for the live chunks every W run adds, so that no chunk is evicted (lookups stay full).
    stack = Stack(
        chunks + (args.live_chunks + args.chunks_per_prompt) * len(args.workers),
        shared_snapshot_pages=args.shared_snapshot_pages,
    )
    try:
        client = PoolClient.connect(stack.address, populate=False, timeout=120)
        rss0, private0 = rss(stack.pool.pid), rss_private(stack.pool.pid)
        stored, spent = fill(client, work, 0, prompts)
        st = client.stats()
        out["fill_chunks_per_s"] = stored / spent
        out["service_rss_filled_mib"] = rss(stack.pool.pid) / MiB
        out["service_rss_per_chunk_b"] = (rss(stack.pool.pid) - rss0) / stored
        out["service_private_mib"] = rss_private(stack.pool.pid) / MiB
        out["service_private_per_chunk_b"] = (rss_private(stack.pool.pid) - private0) / stored
        out["pool_metadata_mib"] = st["metadata_bytes"] / MiB
        print(
            f"[{chunks}] pool filled: {stored} chunks at {out['fill_chunks_per_s']:.0f}/s, service RSS "
            f"{out['service_rss_filled_mib']:.0f} MiB ({out['service_rss_per_chunk_b']:.0f} B/chunk; private "
            f"{out['service_private_mib']:.0f} MiB, {out['service_private_per_chunk_b']:.0f} B/chunk; metadata "
            f"{out['pool_metadata_mib']:.0f} MiB)",
            flush=True,
        )
        for n_workers in args.workers:
            # ~200 B of router per block and worker, ~0.8 GiB per worker stand-in, 2 GiB to spare
            need = out["blocks"] * n_workers * 200 + n_workers * (800 * MiB) + 2048 * MiB
            if mem_available() < need:
                print(
                    f"[{chunks} x W={n_workers}] skipped: {mem_available() / MiB:.0f} MiB available, "
                    f"the run needs ~{need / MiB:.0f} MiB",
                    flush=True,
                )
                continue
            res, prompts = run_workers(args, stack, client, work, prompts, n_workers, out)
            results.append(res)
        client.close()
    except BaseException:
        stack.print_logs()
        raise
    finally:
        stack.close()
    return results


# -- memory per object -----------------------------------------------------------------------
def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Service RSS per object: 50,000 empty objects, 40,000 with ~2 KiB connector metadata."""
    out: dict[str, Any] = {"code_root": str(args.code_root)}
    work = Workload(16, 256, 1)  # 16 blocks of 16 tokens: ~2 KiB of msgpack, as the issue measured
    for label, n, with_meta in (("empty", 50_000, False), ("meta_2k", 40_000, True)):
        stack = Stack(n, code_root=Path(args.code_root), nats=False)
        try:
            with PoolClient.connect(stack.address, heartbeat=False, populate=False, timeout=120) as c:
                time.sleep(0.5)
                rss0 = rss(stack.pool.pid)
                if with_meta:
                    stored, _ = fill(c, work, 0, n)
                else:
                    stored = 0
                    for lo in range(0, n, 1000):
                        res = c.reserve([(b"e%09d" % i, 0) for i in range(lo, lo + 1000)], NS)
                        stored += sum(c.commit([r for r in res if r]))
                time.sleep(0.5)
                out[f"{label}_objects"] = stored
                out[f"{label}_rss_mib"] = rss(stack.pool.pid) / MiB
                out[f"{label}_bytes_per_object"] = (rss(stack.pool.pid) - rss0) / stored
            print(
                f"{label}: {stored} objects, service RSS {out[f'{label}_rss_mib']:.0f} MiB, "
                f"{out[f'{label}_bytes_per_object']:.0f} B/object",
                flush=True,
            )
        finally:
            stack.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[100_000])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--chunks-per-prompt", type=int, default=4)
    ap.add_argument(
        "--workers", type=int, nargs="+", default=[1], help="relays (worker stand-ins) on the one pool, per run"
    )
    ap.add_argument(
        "--router-event-threads", type=int, default=4, help="the router's KV indexer threads (Dynamo's default: 4)"
    )
    ap.add_argument(
        "--local-indexer",
        action="store_true",
        help="the stand-ins' publishers keep Dynamo's worker-local KV indexer (dynamo.vllm's default)",
    )
    ap.add_argument(
        "--announce-cap",
        type=int,
        default=None,
        metavar="N",
        help="after the other phases, restart one relay announcing at most N chunks (the pool's most recently used)",
    )
    ap.add_argument(
        "--shared-snapshot-pages",
        type=int,
        default=None,
        metavar="N",
        help="the pool's --shared-snapshot-pages (0: every relay's pages encoded for it; default: the pool's)",
    )
    ap.add_argument("--live-chunks", type=int, default=20_000)
    ap.add_argument("--lookups", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds any one phase may take")
    ap.add_argument("--memory", action="store_true", help="measure service RSS per object only")
    ap.add_argument("--code-root", default=str(REPO), help="--memory: run the service from this checkout")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--role", default="bench", choices=("bench", "worker"), help=argparse.SUPPRESS)
    ap.add_argument("--pool-address", help=argparse.SUPPRESS)
    ap.add_argument("--pool-name", help=argparse.SUPPRESS)
    ap.add_argument("--nats", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "worker":
        asyncio.run(worker_main(args))
        return
    results: dict[str, Any] = {}
    if args.memory:
        results["memory"] = run_memory(args)
    else:
        runs = [r for n in args.chunks for r in run_scale(args, n)]
        # the last run's figures at the top level (the largest pool with the last --workers), all in "runs"
        results = {**(runs[-1] if runs else {}), "runs": runs}
    if args.json:
        write_json(args.json, results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
