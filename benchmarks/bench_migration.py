#!/usr/bin/env python3
"""A request whose worker dies mid-stream: how fast it resumes on another worker, from the pool.

One run starts the bundled agg graph (nats-server, the pool, two Maru workers, the frontend with
its default request migration) on the `bench` model through the graph runner's own library
(`build_plan`, `start_graph`, `supervise`), so a killed worker is started again between samples.
For each sample, alternating the order of the two measurements:

* recompute - a fresh prompt of L + K tokens (nothing of it cached anywhere), streamed: its time
  to first token is what a worker pays to compute the migrated sequence from scratch;
* migrate - a fresh prompt of L tokens, streamed; after K tokens the worker running it is
  SIGKILLed (its whole tree). The frontend sends prompt + K generated tokens to the other
  worker, which loads the prompt's chunks from the pool (they were stored while the first
  worker prefilled) and computes only the rest. Its resume time is from the kill to the next
  token on the client's stream, the frontend's detection and re-dispatch included.

Printed, all measured in this run: resume and recompute times (min and median of --samples),
their ratio, the frontend's own migration duration (its `model_migration_duration_seconds`:
failure detected -> recovered), the tokens the second worker loaded from the pool and computed
for each migrated request (its vLLM counters), whether every migrated stream arrived complete,
and new requests sent right after each kill (`--probe-s`; their HTTP statuses and slowest
latency: the window in which the dead worker may still be chosen).

Options: --prompt-tokens 3072 --kill-after 8 --samples 3 --model bench --probe-s 10 --json
--keep-logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import alternated  # noqa: E402 - benchmarks/ is on sys.path when a script runs
from maru_dynamo.graphs import client  # noqa: E402
from maru_dynamo.graphs import plan as graph_plan  # noqa: E402
from maru_dynamo.graphs import run as graph_run  # noqa: E402
from maru_dynamo.graphs.spec import load_graph, resolve_graph_path  # noqa: E402
from maru_vllm.launch import ProcessGroup  # noqa: E402
from maru_vllm.launch.engine_metrics import EngineCounters, read_counters, running_requests, scrape  # noqa: E402

CHUNK_TOKENS = 256


def fresh_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(length)]


def stream_tokens(url: str, model: str, prompt: list[int], max_tokens: int) -> Iterator[tuple[float, dict[str, Any]]]:
    """(arrival time, event) for every SSE event of a streaming completion; "[DONE]" as {"done": True}."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,  # one entry per token: a chunk may carry several
    }
    yield from client.stream_events(url, body, timeout=600)


def token_arrivals(events: Iterator[tuple[float, dict[str, Any]]]) -> Iterator[tuple[float, int]]:
    """(arrival time, tokens in it) for every chunk that carried tokens."""
    for at, event in events:
        for choice in event.get("choices") or []:
            if choice.get("text") is not None:
                yield at, max(1, len((choice.get("logprobs") or {}).get("tokens") or []))


def ttft(url: str, model: str, prompt: list[int]) -> float:
    start = time.monotonic()
    for at, _ in token_arrivals(stream_tokens(url, model, prompt, 2)):
        return at - start
    raise RuntimeError("no token came back")


def migration_seconds(url: str) -> tuple[float, float]:
    """The frontend's model_migration_duration_seconds (sum, count) over every label."""
    text = scrape(f"{url}/metrics", timeout=10)
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith("model_migration_duration_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif name.endswith("model_migration_duration_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


@dataclasses.dataclass
class Migrated:
    resume_s: float  # the kill -> the first token after the stream's stall
    stall_s: float  # the longest wait between two chunks of the stream (the client's view)
    frontend_s: float | None
    tokens: int
    want: int
    loaded: int  # prompt tokens the second worker loaded through the connector (the pool)
    computed: int  # ... and computed itself
    local_hit: int


def probe_new_requests(url: str, model: str, seconds: float, rng: random.Random) -> list[tuple[int, float]]:
    """(HTTP status, latency) of small requests sent one after another for `seconds`."""
    out: list[tuple[int, float]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        body = {"model": model, "prompt": fresh_prompt(rng, 64), "max_tokens": 4, "temperature": 0}
        start = time.monotonic()
        try:
            client.completions(url, body, timeout=120)
            status = 200
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError:
            status = 0
        out.append((status, time.monotonic() - start))
        time.sleep(0.2)
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        spec = load_graph(resolve_graph_path("agg"))
        self.model = graph_plan.resolve_model(args.model)
        self.plan = graph_plan.build_plan(spec, model=self.model, work_dir=graph_run.new_work_dir())
        self.group = ProcessGroup()
        self.metrics = {p.name: p.metrics_url for p in self.plan.workers if p.metrics_url}
        self.rng = random.Random(args.seed)
        self.lines: list[str] = []

    def log(self, line: str) -> None:
        print(line, flush=True)

    def counters(self) -> dict[str, EngineCounters]:
        return {name: read_counters(url) for name, url in self.metrics.items()}

    def wait_serving(self, timeout: float = 600) -> None:
        """Until every worker answers on its metrics port and the frontend knows them all."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.counters()
                if graph_run._worker_instances(self.plan.url) >= len(self.plan.workers):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not serving after {timeout:.0f}s:\n{self.group.log_tails(20)}")
            time.sleep(1)

    def migrate_once(self) -> Migrated:
        a = self.args
        prompt = fresh_prompt(self.rng, a.prompt_tokens)
        want = a.kill_after + a.tail_tokens
        arrivals: list[tuple[float, int]] = []
        failure: list[BaseException] = []

        def read() -> None:
            try:
                for arrival in token_arrivals(stream_tokens(self.plan.url, self.model, prompt, want)):
                    arrivals.append(arrival)
            except (OSError, ValueError) as exc:
                failure.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 600
        while sum(n for _, n in list(arrivals)) < a.kill_after:
            if failure or not reader.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the stream ended before {a.kill_after} tokens: {failure}")
            time.sleep(0.002)
        running = [n for n, url in self.metrics.items() if running_requests(url) > 0]
        if len(running) != 1:
            raise RuntimeError(f"expected the request running on one worker, found it on {running}")
        victim_name = running[0]
        (victim,) = [p for p in self.group if p.name == victim_name]
        survivor = next(n for n in self.metrics if n != victim_name)
        before = read_counters(self.metrics[survivor])
        mig_before = migration_seconds(self.plan.url)
        killed_at = time.monotonic()
        os.killpg(victim.pid, signal.SIGKILL)
        reader.join(600)
        if failure:
            raise RuntimeError(f"the migrated stream failed: {failure[0]}")
        delta = read_counters(self.metrics[survivor]) - before
        mig_after = migration_seconds(self.plan.url)
        times = [t for t, _ in arrivals]
        gaps = [(b - a_, b) for a_, b in itertools.pairwise(times)]
        stall, resumed = max(gaps) if gaps else (0.0, killed_at)
        frontend = None
        if mig_after[1] > mig_before[1]:
            frontend = (mig_after[0] - mig_before[0]) / (mig_after[1] - mig_before[1])
        return Migrated(
            resumed - killed_at,
            stall,
            frontend,
            sum(n for _, n in arrivals),
            want,
            delta.external_kv_transfer,
            delta.local_compute,
            delta.local_cache_hit,
        )

    def probe_after_kill(self) -> list[tuple[int, float]]:
        """Kill an idle worker and send new requests at once: are any refused while it is still listed?"""
        victim = next(p for p in self.group if p.name.startswith("worker:"))
        os.killpg(victim.pid, signal.SIGKILL)
        return probe_new_requests(self.plan.url, self.model, self.args.probe_s, self.rng)

    def run(self) -> dict[str, Any]:
        a = self.args
        self.log(f"[bench] graph on {self.model}; logs in {self.plan.work_dir / 'logs'}")
        supervisor = graph_run.supervise(self.plan, self.group, out=self.log)
        recompute: list[float] = []
        migrated: list[Migrated] = []
        probes: list[tuple[int, float]] = []
        try:
            graph_run.start_graph(self.plan, self.group, supervisor=supervisor)
            supervisor.start()
            self.wait_serving()
            ttft(self.plan.url, self.model, fresh_prompt(self.rng, 64))  # warm both paths once
            for sample in range(a.samples):
                for what in alternated(("recompute", "migrate"), sample):
                    if what == "recompute":
                        recompute.append(
                            ttft(self.plan.url, self.model, fresh_prompt(self.rng, a.prompt_tokens + a.kill_after))
                        )
                        self.log(f"[bench] sample {sample}: recompute {recompute[-1] * 1000:.0f} ms")
                    else:
                        m = self.migrate_once()
                        migrated.append(m)
                        self.log(
                            f"[bench] sample {sample}: resume {m.resume_s * 1000:.0f} ms (stall "
                            f"{m.stall_s * 1000:.0f} ms), {m.tokens}/{m.want} tokens, the other worker loaded "
                            f"{m.loaded} / computed {m.computed} prompt tokens"
                        )
                        self.wait_serving()
            if a.probe_s > 0:
                probes = self.probe_after_kill()
        except BaseException:
            self.log(f"[bench] failed; logs kept in {self.plan.work_dir / 'logs'}")
            graph_run.stop_graph(self.group, supervisor=supervisor)
            raise
        graph_run.stop_graph(self.group, supervisor=supervisor)
        if not a.keep_logs:
            shutil.rmtree(self.plan.work_dir, ignore_errors=True)
        return self.report(recompute, migrated, probes, supervisor.removed_segments)

    def report(
        self, recompute: list[float], migrated: list[Migrated], probes: list[tuple[int, float]], removed: list[Path]
    ) -> dict[str, Any]:
        a = self.args
        resume = [m.resume_s for m in migrated]
        stall = [m.stall_s for m in migrated]
        front = [m.frontend_s for m in migrated if m.frontend_s is not None]
        result = {
            "model": a.model,
            "prompt_tokens": a.prompt_tokens,
            "kill_after": a.kill_after,
            "samples": a.samples,
            "resume_ms": [round(v * 1000, 1) for v in resume],
            "stall_ms": [round(v * 1000, 1) for v in stall],
            "recompute_ms": [round(v * 1000, 1) for v in recompute],
            "frontend_migration_ms": [round(v * 1000, 1) for v in front],
            "ratio_min": min(resume) / min(recompute),
            "ratio_median": statistics.median(resume) / statistics.median(recompute),
            "loaded_tokens": [m.loaded for m in migrated],
            "computed_tokens": [m.computed for m in migrated],
            "complete": sum(m.tokens == m.want for m in migrated),
            "probes": len(probes),
            "probe_statuses": sorted({s for s, _ in probes}),
            "probe_failed": sum(s != 200 for s, _ in probes),
            "probe_max_s": max((t for _, t in probes), default=0.0),
            "removed_segments": len(removed),
        }
        full = a.prompt_tokens // CHUNK_TOKENS * CHUNK_TOKENS
        lines = [
            f"\nRequest migration on {a.model}: prompt {a.prompt_tokens} tokens, worker killed after "
            f"{a.kill_after} tokens; {a.samples} samples (min / median)",
            f"  resume from the pool (kill -> next token): {min(resume) * 1000:7.0f} / "
            f"{statistics.median(resume) * 1000:7.0f} ms",
            f"  recompute (TTFT of {a.prompt_tokens + a.kill_after} fresh tokens):      {min(recompute) * 1000:7.0f} / "
            f"{statistics.median(recompute) * 1000:7.0f} ms",
            f"  resume / recompute:                         {result['ratio_min']:7.2f} / {result['ratio_median']:7.2f}",
            f"  longest wait between two chunks of a migrated stream: min {min(stall) * 1000:.0f} ms, "
            f"median {statistics.median(stall) * 1000:.0f} ms",
        ]
        if front:
            lines.append(
                f"  frontend's migration duration (detected -> recovered): min {min(front) * 1000:.0f} ms, "
                f"median {statistics.median(front) * 1000:.0f} ms"
            )
        lines += [
            f"  second worker, per migrated request: loaded from the pool {result['loaded_tokens']} tokens "
            f"(the prompt's whole chunks: {full}), computed {result['computed_tokens']}",
            f"  migrated streams complete: {result['complete']} of {len(migrated)}",
            f"  new requests in the {a.probe_s:.0f} s after an idle worker is killed: {len(probes)} sent, "
            f"{result['probe_failed']} not 200 (statuses {result['probe_statuses']}), "
            f"slowest {result['probe_max_s'] * 1000:.0f} ms",
            f"  dead workers' /dev/shm segments removed by the supervisor: {len(removed)}",
        ]
        print("\n".join(lines), flush=True)
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench", help="fixture name or model directory (default: bench)")
    ap.add_argument("--prompt-tokens", type=int, default=3072)
    ap.add_argument("--kill-after", type=int, default=8, help="tokens streamed before the worker is killed")
    ap.add_argument("--tail-tokens", type=int, default=8, help="tokens asked for after the kill")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--probe-s", type=float, default=10.0, help="send new requests for this long after each kill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    ap.add_argument("--keep-logs", action="store_true", help="keep the graph's work dir with its logs")
    args = ap.parse_args()
    if args.prompt_tokens < CHUNK_TOKENS or args.kill_after < 1 or args.samples < 1:
        ap.error("--prompt-tokens must be >= 256, --kill-after and --samples >= 1")
    result = Bench(args).run()
    if args.json:
        print(json.dumps(result))
    return 0 if result["complete"] == args.samples and result["probe_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
