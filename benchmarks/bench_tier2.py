#!/usr/bin/env python3
"""TTFT of a prompt served from the second tier (Mooncake Store) against a cold prefill and a
local pool hit, on the `bench` model; and the tier's bandwidth against memcpy.

One run starts a nats-server, a mooncake_master, two pool services (domains A and B, each a
Mooncake Store client) and one vLLM engine with MaruKVConnector on each pool, each engine pinned
to its own core with vLLM's prefix cache off (so a repeat of a prompt can only come from the
pool). For every sample and prompt length it sends one fresh random prompt (a 1-token
completion) to:

* domain X: a cold prefill, whose chunks go into X's pool and on through to the tier;
* domain Y, once Y's pool has learned the chunks' keys: a tier-2 hit (Y's pool fetches the
  chunks from the tier, the engine loads them from the pool);
* domain Y again: a local pool hit (the chunks are in Y's pool now);

X and Y swap every sample (alternating), and every figure is the minimum over the samples.
Then, outside the engines: Mooncake's own get bandwidth for objects of one chunk's size between
two clients on this host, the tier's full fetch path (get, verify header digest and payload
checksum, copy into a buffer) over the same objects, and a memcpy of the same bytes.

Options: --lengths 1024,2048,4096,7936 --samples 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import alternated  # noqa: E402 - benchmarks/ is on sys.path when a script runs
from maru_dynamo.graphs import client  # noqa: E402
from maru_vllm.fixtures.models import ensure_model  # noqa: E402
from maru_vllm.launch import ProcessGroup, stack  # noqa: E402
from maru_vllm.launch.mooncake import MooncakeMaster  # noqa: E402
from maru_vllm.pool import PoolClient  # noqa: E402

CORES = {"A": 0, "B": 1}
MAX_MODEL_LEN = 8192
CHUNK = 256


def completion(url: str, model: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to a 1-token completion, prompt tokens served from a cache)."""
    dt, out = client.timed_completion(url, model, prompt)
    return dt, client.cached_tokens(out)


def stats(address: str) -> dict[str, Any]:
    with PoolClient.connect(address) as c:
        return c.stats()


def wait_for(check: Any, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Domains:
    def __init__(self, group: ProcessGroup, work: Path, model: str, pool_gb: int) -> None:
        logs = work / "logs"
        self.logs, self.model = logs, model
        nats_proc, nats_url = stack.nats_server(logs)
        group.start(nats_proc)
        nats_proc.wait_for_log(stack.NATS_READY_PATTERN, timeout=30)
        self.master = group.add(MooncakeMaster(logs / "mooncake-master.log")).serve()
        tier = [*self.master.pool_args(), "--mooncake-segment-size", f"{pool_gb}G"]
        self.pools: dict[str, str] = {}
        self.urls: dict[str, str] = {}
        for d in "AB":
            address = f"unix://{work}/pool-{d}.sock"
            pool = stack.PoolProcess(
                f"t2bench{d}{os.getpid()}",
                f"{pool_gb}G",
                logs / f"pool-{d}.log",
                listen=[address],
                nats=nats_url,
                extra_args=tier,
                name=f"pool-{d}",
                cpus=(CORES[d],),
            )
            group.add(pool)
            pool.serve()
            self.pools[d] = address
        for d in "AB":
            kv = {
                "kv_connector": "MaruKVConnector",
                "kv_connector_module_path": "maru_vllm.connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"maru_pool_address": self.pools[d]},
            }
            env = stack.StackEnv(discovery_dir=work / "disc").build(cpu_thread=CORES[d])
            proc, url = stack.vllm_openai_server(
                f"engine-{d}",
                model,
                env,
                logs,
                max_model_len=MAX_MODEL_LEN,
                kv_transfer_config=kv,
                cpus=(CORES[d],),
                extra_args=["--max-num-batched-tokens", "2048", "--no-enable-prefix-caching"],
            )
            group.start(proc)
            self.urls[d] = url
        for d, url in self.urls.items():
            next(p for p in group if p.name == f"engine-{d}").wait_for_http(f"{url}/v1/models", timeout=900)

    def ttft(self, d: str, prompt: list[int]) -> tuple[float, int]:
        return completion(self.urls[d], self.model, prompt)


def run_engines(args: argparse.Namespace, work: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    model = str(ensure_model("bench"))
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    with ProcessGroup() as group:
        dom = Domains(group, work, model, args.pool_gb)
        print(f"[bench] engines ready; logs in {dom.logs}", file=sys.stderr)
        for d in "AB":  # warm both engines and both directions of the tier once
            warm = [rng.randrange(32, 127) for _ in range(1025)]
            other = "B" if d == "A" else "A"
            dom.ttft(d, warm)
            wait_for(lambda other=other: stats(dom.pools[other])["tier2_keys"] >= 4 * 2)
            dom.ttft(other, warm)
        for sample in range(args.samples):
            cold, hit = alternated(("A", "B"), sample)
            for length in lengths:
                prompt = [rng.randrange(32, 127) for _ in range(length + 1)]
                row: dict[str, Any] = {"tokens": length, "sample": sample, "cold_domain": cold}
                keys_before = stats(dom.pools[hit])["tier2_keys"]
                row["cold"], row["cold_cached"] = dom.ttft(cold, prompt)
                t0 = time.monotonic()
                row["learned"] = wait_for(lambda: stats(dom.pools[hit])["tier2_keys"] >= keys_before + length // CHUNK)
                row["visible_after_s"] = time.monotonic() - t0  # from the cold answer to the keys in Y's directory
                before = stats(dom.pools[hit])
                row["tier2"], row["tier2_cached"] = dom.ttft(hit, prompt)
                after = stats(dom.pools[hit])
                row["tier2_fetched"] = after["tier2_hits"] - before["tier2_hits"]
                row["local_pool"], row["local_pool_cached"] = dom.ttft(hit, prompt)
                rows.append(row)
                print(
                    "[bench] "
                    + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                    file=sys.stderr,
                )
        tier = {d: {k: v for k, v in stats(a).items() if k.startswith("tier2")} for d, a in dom.pools.items()}
        a = stats(dom.pools["A"])
        tier["chunk_bytes"] = a["object_bytes"] // max(1, a["objects"])
    return rows, tier


def bandwidth(object_bytes: int, count: int, repeats: int) -> dict[str, float]:
    """Mooncake get, the tier's fetch path and memcpy over `count` objects of `object_bytes`."""
    import numpy as np

    from maru_vllm.pool.objects import payload_checksum
    from maru_vllm.pool.tier2 import codec
    from maru_vllm.pool.tier2.mooncake import MooncakeConfig, MooncakeStore

    work = Path(tempfile.mkdtemp(prefix="maru-t2bw-"))
    out: dict[str, float] = {"object_MiB": object_bytes / (1 << 20), "objects": count}
    with ProcessGroup() as group:
        master = group.add(MooncakeMaster(work / "master.log")).serve()
        seg = max(256 << 20, 2 * count * (object_bytes + 4096))
        cfg = MooncakeConfig(master.address, master.metadata_url, segment_size=seg, host="127.0.0.1")
        writer, reader = MooncakeStore(cfg), MooncakeStore(cfg)
        payload = memoryview(np.random.default_rng(0).integers(0, 255, object_bytes, dtype=np.uint8).tobytes())
        check = payload_checksum(payload)
        names = []
        for i in range(count):
            key = b"bw-%d" % i
            blob = codec.encode("bench", key, check, None, [], payload)
            assert writer.put(codec.object_name("bench", key), memoryview(blob))
            names.append((key, codec.object_name("bench", key), len(blob)))
        dst = np.empty(object_bytes, dtype=np.uint8)
        dst[:] = 1
        best_get = best_fetch = best_copy = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _key, name, size in names:
                assert reader.get(name, size) is not None
            best_get = min(best_get, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for key, name, size in names:
                obj = codec.decode(reader.get(name, size), "bench", key)  # type: ignore[arg-type]
                dst[:] = np.frombuffer(obj.payload, dtype=np.uint8)
            best_fetch = min(best_fetch, time.perf_counter() - t0)
            src = np.frombuffer(payload, dtype=np.uint8)
            t0 = time.perf_counter()
            for _ in names:
                dst[:] = src
            best_copy = min(best_copy, time.perf_counter() - t0)
        writer.close()
        reader.close()
    total = object_bytes * count
    out.update(
        mooncake_get_GBps=total / best_get / 1e9,
        tier_fetch_GBps=total / best_fetch / 1e9,
        memcpy_GBps=total / best_copy / 1e9,
    )
    out["get_over_memcpy"] = out["mooncake_get_GBps"] / out["memcpy_GBps"]
    out["fetch_over_memcpy"] = out["tier_fetch_GBps"] / out["memcpy_GBps"]
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    table: dict[str, dict[str, Any]] = {}
    for n in sorted({r["tokens"] for r in rows}):
        mine = [r for r in rows if r["tokens"] == n]
        t = {k: min(r[k] for r in mine) for k in ("cold", "tier2", "local_pool", "visible_after_s")}
        t["tier2_over_cold"] = t["tier2"] / t["cold"]
        t["local_pool_over_cold"] = t["local_pool"] / t["cold"]
        t["tier2_over_local_pool"] = t["tier2"] / t["local_pool"]
        t["tier2_fully_cached"] = all(r["tier2_cached"] >= n for r in mine)
        t["local_fully_cached"] = all(r["local_pool_cached"] >= n for r in mine)
        t["colds_uncached"] = all(not r["cold_cached"] for r in mine)
        table[str(n)] = t
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--lengths", default="1024,2048,4096,7936", help="loadable prompt tokens (each prompt is one longer)"
    )
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--pool-gb", type=int, default=1, help="each pool's size and its Mooncake segment, GiB")
    ap.add_argument("--bandwidth-objects", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print every figure as JSON instead of the table")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="maru-bench-t2-"))
    rows, tier = run_engines(args, work)
    table = summarize(rows)
    chunk_bytes = int(tier["chunk_bytes"]) or (4 << 20)
    bw = bandwidth(chunk_bytes, args.bandwidth_objects, repeats=5)
    result = {"model": "bench", "samples": args.samples, "table": table, "bandwidth": bw, "tier2_stats": tier}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"bench model, min of {args.samples} samples (domains alternate); chunk of {chunk_bytes / (1 << 20):.2f} MiB")
    print(
        f"{'tokens':>7} {'cold':>8} {'tier-2 hit':>11} {'local pool':>11} {'t2/cold':>8} {'t2/local':>9} {'visible':>8}"
    )
    for n, t in table.items():
        print(
            f"{n:>7} {t['cold']:>7.3f}s {t['tier2']:>10.3f}s {t['local_pool']:>10.3f}s"
            f" {t['tier2_over_cold']:>8.3f} {t['tier2_over_local_pool']:>9.2f} {t['visible_after_s']:>7.2f}s"
            + ("" if t["tier2_fully_cached"] and t["local_fully_cached"] and t["colds_uncached"] else "  (partial!)")
        )
    print(
        f"tier-2 bandwidth, {bw['objects']} objects of {bw['object_MiB']:.2f} MiB:"
        f" Mooncake get {bw['mooncake_get_GBps']:.2f} GB/s"
        f" ({bw['get_over_memcpy']:.2f}x memcpy), full fetch path {bw['tier_fetch_GBps']:.2f} GB/s"
        f" ({bw['fetch_over_memcpy']:.2f}x), memcpy {bw['memcpy_GBps']:.2f} GB/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
