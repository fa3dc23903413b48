"""Ready means warm: the first burst after a graph reports ready, against a warm burst.

Starts the real graph (`graphs/run.py`'s build_plan / start_graph / stop_graph: nats-server, the
pool, the Maru workers, Dynamo's frontend), and the moment start_graph returns (what `maru-dynamo
graph run` announces as ready) sends a burst of streaming completions at a fixed concurrency,
then, after a pause, a second burst of the same shape. The load generator is `vllm bench serve`
(its random dataset, a seed per burst; `--load httpx`: an in-process streaming client, random
text, which also skips vllm's ~8 s start). Every prompt of both bursts is distinct, so the second
burst measures a warm graph, not a cache hit. Prints TTFT p50/p90/p99/mean of each burst and the ratio
first/warm; the target is p99 first <= 2x p99 warm.

Each round starts the graph twice, as it is and with the workers' warm-up before registration
turned off (`--no-maru-warmup`, what the first users paid before), in alternating order; the
medians of the ratios over the rounds are printed at the end. `--only warmup` skips the
comparison.

    .venv/bin/python benchmarks/bench_cold_start.py [--graph graphs/agg.yaml] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from harness import alternated, percentile
from maru_dynamo.graphs.client import aiter_events, stream_completion
from maru_dynamo.graphs.plan import build_plan, resolve_model
from maru_dynamo.graphs.run import new_work_dir, start_graph, stop_graph, supervise
from maru_dynamo.graphs.spec import GraphSpec, load_graph
from maru_vllm.launch import ProcessGroup

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Burst:
    name: str
    ttft_s: tuple[float, ...]
    wall_s: float

    def pct(self, q: float) -> float:
        return percentile(self.ttft_s, q)

    def row(self) -> str:
        ms = [1000 * v for v in (self.pct(50), self.pct(90), self.pct(99), statistics.fmean(self.ttft_s))]
        return f"{self.name:<12} {len(self.ttft_s):>4} " + " ".join(f"{v:>9.1f}" for v in ms) + f" {self.wall_s:>8.1f}"


def prompts(seed: int, n: int, min_len: int, max_len: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " "
    return ["".join(rng.choices(alphabet, k=rng.randint(min_len, max_len))) for _ in range(n)]


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft: float | None = None
    async with stream_completion(client, url, body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for event in aiter_events(resp):
            if ttft is None and any(c.get("text") for c in event.get("choices") or []):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("a stream ended without a token")
    return ttft


async def _burst(name: str, url: str, model: str, texts: Sequence[str], concurrency: int, max_tokens: int) -> Burst:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def run(text: str) -> float:
            async with sem:
                return await _one(client, url, model, text, max_tokens)

        t0 = time.perf_counter()
        ttfts = await asyncio.gather(*(run(t) for t in texts))
        return Burst(name, tuple(ttfts), time.perf_counter() - t0)


WARMUP_OFF = "--no-maru-warmup"


def graph_spec(path: str, warmup: bool) -> GraphSpec:
    spec = load_graph(Path(path))
    if warmup:
        return spec
    workers = tuple(dataclasses.replace(w, args=(*w.args, WARMUP_OFF)) for w in spec.workers)
    return dataclasses.replace(spec, workers=workers)


VLLM = Path(sys.executable).parent / "vllm"


def _vllm_bench_burst(name: str, url: str, model: str, seed: int, args: argparse.Namespace) -> Burst:
    """One burst sent by `vllm bench serve` (random-token prompts of the same length range)."""
    mid = (args.min_len + args.max_len) / 2
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            str(VLLM), "bench", "serve", "--backend", "openai", "--base-url", url, "--model", model,
            "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(round(mid)),
            "--random-range-ratio", f"{(args.max_len - mid) / mid:.4f}", "--random-output-len", str(args.max_tokens),
            "--ignore-eos", "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency),
            "--request-rate", "inf", "--seed", str(seed), "--ready-check-timeout-sec", "0", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", out, "--result-filename", "burst.json",
        ]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
        data = json.loads((Path(out) / "burst.json").read_text())
    if data.get("completed") != args.requests:
        raise RuntimeError(f"vllm bench serve completed {data.get('completed')} of {args.requests} requests")
    return Burst(name, tuple(float(t) for t in data["ttfts"]), float(data["duration"]))


def send_burst(name: str, url: str, model: str, seed: int, args: argparse.Namespace) -> Burst:
    if args.load == "vllm-bench":
        return _vllm_bench_burst(name, url, model, seed, args)
    texts = prompts(seed, args.requests, args.min_len, args.max_len)
    return asyncio.run(_burst(name, url, model, texts, args.concurrency, args.max_tokens))


def run_round(args: argparse.Namespace, round_no: int, warmup: bool) -> tuple[Burst, Burst]:
    spec = graph_spec(args.graph, warmup)
    model = resolve_model(args.model or spec.model)
    work_dir = new_work_dir()
    plan = build_plan(spec, model=model, work_dir=work_dir)
    group = ProcessGroup()
    supervisor = supervise(plan, group)  # only for its /dev/shm clean-up of a stop that had to SIGKILL
    try:
        t0 = time.monotonic()
        start_graph(plan, group, supervisor=supervisor)
        label = "warm-up on" if warmup else "warm-up off"
        print(
            f"[round {round_no}, {label}] graph ready after {time.monotonic() - t0:.1f} s; first burst now", flush=True
        )
        seed = 1000 * round_no
        first = send_burst("first", plan.url, model, seed + 1, args)
        time.sleep(args.pause_s)
        warm = send_burst("warm", plan.url, model, seed + 2, args)
        return first, warm
    finally:
        supervisor.watch(force=True)  # the segments the engines opened since they started
        stop_graph(group, supervisor=supervisor)
        if args.keep_logs:
            print(f"[round {round_no}] logs kept in {work_dir / 'logs'}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", default=str(ROOT / "graphs" / "agg.yaml"))
    p.add_argument("--model", default=None, help="fixture name or model directory (default: the graph's)")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--min-len", type=int, default=64, help="shortest prompt, tokens")
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt, tokens")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--pause-s", type=float, default=5.0, help="pause between the two bursts")
    p.add_argument("--rounds", type=int, default=1, help="rounds (each: the graph with and without warm-up)")
    p.add_argument("--only", choices=("warmup", "both"), default="both", help="warmup: no comparison run")
    p.add_argument(
        "--load",
        choices=("vllm-bench", "httpx"),
        default="vllm-bench",
        help="load generator: `vllm bench serve` (random dataset), or an in-process httpx streaming client "
        "(sends the first request the moment the graph is ready, without vllm's ~8 s start)",
    )
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    for name in ("requests", "concurrency", "min_len", "max_len", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.min_len > args.max_len:
        p.error(f"--min-len={args.min_len} is above --max-len={args.max_len}")
    ratios: dict[bool, list[float]] = {True: [], False: []}
    header = f"{'burst':<12} {'n':>4} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'mean ms':>9} {'wall s':>8}"
    for r in range(1, args.rounds + 1):
        order = [True] if args.only == "warmup" else alternated([True, False], r - 1)
        for warmup in order:
            first, warm = run_round(args, r, warmup)
            label = "warm-up on" if warmup else "warm-up off"
            print(header)
            print(first.row())
            print(warm.row())
            ratio = first.pct(99) / warm.pct(99)
            ratios[warmup].append(ratio)
            print(
                f"[round {r}, {label}] TTFT p99 first/warm = {ratio:.2f}x (target <= 2x); "
                f"p50 {first.pct(50) / warm.pct(50):.2f}x, mean "
                f"{statistics.fmean(first.ttft_s) / statistics.fmean(warm.ttft_s):.2f}x",
                flush=True,
            )
    for warmup, values in ratios.items():
        if values:
            label = "warm-up on " if warmup else "warm-up off"
            print(
                f"{label}: TTFT p99 first/warm, median of {len(values)}: {statistics.median(values):.2f}x "
                f"(min {min(values):.2f}x, max {max(values):.2f}x); target <= 2x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
