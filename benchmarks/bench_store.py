#!/usr/bin/env python3
"""Stores into the Maru pool: bandwidth vs memcpy, how long a step is held, and the miss tax.

    python benchmarks/bench_store.py [--chunks 16] [--repeats 7] [--core 0] [--engines] [--json]

Everything runs the real connector worker side (`MaruWorkerSide` + `StoreWriter`) against a
real pool service, on the `bench` model's KV geometry (16 layers, 4 KV heads, head 64, bf16,
block 128, vLLM 0.31's single CPU allocation), pinned to one core like a vLLM CPU engine.
Configurations alternate and each figure is the minimum over `--repeats` samples.

1. Store bandwidth: one step stores `--chunks` chunks (16 = a 4096-token prompt, 64 MiB);
   the writer's own time (reserve, page copy, checksum, commit) against a memcpy of the same
   number of bytes; plus the parts measured separately.
2. Step hold per stored byte: how long `wait_for_save` keeps the step, write-behind vs inline.
3. Miss tax at a prefill rate: a prompt of `--chunks` chunks prefilled in steps of 2048 tokens
   whose forward takes (step's KV bytes / KV rate). `gpu`: the rate of the seed's GPU run
   (Qwen2.5-32B: 1.1 GB of KV in a 1.06 s cold prefill), the host idle while the GPU computes
   (sleep); `cpu`: this machine's measured rate, the forward a fixed amount of matmul work on
   the same core, so a background copy competes with it. TTFT with the connector (inline or
   write-behind) over TTFT without it.
4. `--engines`: cold TTFT of two real vLLM engines on the same core, with and without the
   connector, alternating distinct prompts (under `flock /tmp/maru-heavy.lock` on shared hosts).

Prints ratios measured in this run; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from harness import rotated  # noqa: E402 - benchmarks/ is on sys.path when a script runs
from maru_dynamo.graphs import client  # noqa: E402
from maru_vllm.connector.chunks import placeholder_meta  # noqa: E402
from maru_vllm.connector.metadata import ChunkStore, MaruConnectorMetadata  # noqa: E402
from maru_vllm.connector.pool_access import PoolAccess  # noqa: E402
from maru_vllm.connector.transfer import WholeChunk  # noqa: E402
from maru_vllm.connector.worker import MaruWorkerSide  # noqa: E402
from maru_vllm.launch import ProcessGroup, free_port  # noqa: E402
from maru_vllm.launch.stack import PoolProcess  # noqa: E402
from maru_vllm.native import ENV_NATIVE_COPY, path_name  # noqa: E402
from maru_vllm.pool import PoolClient  # noqa: E402
from maru_vllm.pool.objects import payload_checksum  # noqa: E402

LAYERS, KV_HEADS, HEAD, BLOCK = 16, 4, 64, 128  # the `bench` fixture model
BLOCKS_PER_CHUNK = 2  # 256-token chunks
STEP_TOKENS = 2048  # --max-num-batched-tokens of the engine benchmarks
GPU_KV_RATE = 1.1e9 / 1.06  # bytes of KV a GPU prefill produces per second (seed: Qwen2.5-32B)
NS = "bench-store"


def kv_caches(num_blocks: int) -> dict[str, torch.Tensor]:
    big = torch.randn(LAYERS, num_blocks, KV_HEADS, BLOCK, 2 * HEAD).to(torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": big[i] for i in range(LAYERS)}


class Rig:
    """A pool service, a write-behind worker side and an inline one over the same caches."""

    def __init__(self, group: ProcessGroup, work: Path, num_blocks: int) -> None:
        self.address = f"unix://{work}/pool.sock"
        group.add(PoolProcess(f"bstore{free_port()}", "2G", work / "pool.log", listen=[self.address])).serve()
        self.caches = kv_caches(num_blocks)
        self.sides = {}
        for mode, behind, checksum in (
            ("write-behind", True, True),
            ("inline", False, True),
            ("no checksum", True, False),
        ):
            side = MaruWorkerSide(
                namespace=NS,
                rank=0,
                pool=PoolAccess(self.address, None, 10.0, checksum, mode),
                block_size=BLOCK,
                num_blocks=num_blocks,
                use_lmcache_kernels=False,
                enable_fused_load=False,
                write_behind=behind,
            )
            side.register_kv_caches(self.caches, "CPU_ATTN")
            side.pool.client.ping()  # connect before the timed runs
            self.sides[mode] = side
        self.client = PoolClient.connect(self.address, checksum=True)
        self.chunk_bytes = self.sides["inline"].codec.chunk_nbytes(BLOCKS_PER_CHUNK)
        self._n = 0

    def stores(self, chunks: int, first_chunk: int = 0) -> list[ChunkStore]:
        """`chunks` new chunks (fresh keys) over consecutive blocks, as a fresh request has, with
        metadata and part keys the size an engine commits (a block's token ids and hash, one part
        key per leading block)."""
        self._n += 1
        return [
            ChunkStore(
                f"req{self._n}",
                f"k{self._n}-{c}".encode(),
                [BLOCKS_PER_CHUNK * c + b for b in range(BLOCKS_PER_CHUNK)],
                placeholder_meta(c, BLOCKS_PER_CHUNK, BLOCK),
                [f"k{self._n}-{c}-part{b}".encode().ljust(32, b".") for b in range(BLOCKS_PER_CHUNK - 1)],
            )
            for c in range(first_chunk, first_chunk + chunks)
        ]

    def clear(self) -> None:
        for side in self.sides.values():
            side.writer.wait()
        self.client.remove(None, NS)

    def close(self) -> None:
        for side in self.sides.values():
            side.shutdown()
            side.pool.close()
        self.client.close()


def store_once(rig: Rig, mode: str, chunks: int) -> tuple[float, float, int]:
    """(seconds the step was held, seconds the writer worked, bytes stored) for one step's stores."""
    side = rig.sides[mode]
    side.take_counters()
    side.store(MaruConnectorMetadata(stores=rig.stores(chunks)))
    side.writer.wait()
    c = side.take_counters()
    assert c is not None and c.chunks_stored == chunks, c
    rig.clear()
    return c.store_hold_seconds, c.store_seconds, c.bytes_stored


def parts_once(rig: Rig, chunks: int) -> dict[str, float]:
    """The store's parts timed one by one: round trips, page copy (+ checksum, as served), commit;
    and, for comparison, the pure path's copy and a checksum as a separate pass."""
    side = rig.sides["inline"]
    codec, copier = side.codec, side.copier
    stores = rig.stores(chunks)
    t0 = time.perf_counter()
    res = rig.client.reserve([(s.key, rig.chunk_bytes) for s in stores], NS)
    t1 = time.perf_counter()
    # As the writer copies: the whole job in one batched pass where the kernel is built.
    sums = copier.pack_whole_many([WholeChunk(s.block_ids, r.buffer) for s, r in zip(stores, res)])
    if sums is None:
        sums = [codec.pack_with_checksum(s.block_ids, r.buffer) for s, r in zip(stores, res)]
    for r, checksum in zip(res, sums):
        r.payload_checksum = checksum
    t2 = time.perf_counter()
    with pure_path():
        for s, r in zip(stores, res):
            codec.pack(s.block_ids, r.buffer)
    t3 = time.perf_counter()
    with pure_path():
        for r in res:
            payload_checksum(r.buffer)
    t4 = time.perf_counter()
    rig.client.commit(res, [None] * len(res))  # hashes only what the copy did not (the pure path)
    t5 = time.perf_counter()
    rig.clear()
    return {
        "reserve": t1 - t0,
        f"page copy as served ({path_name()})": t2 - t1,
        "page copy, pure path (torch)": t3 - t2,
        "checksum as a separate pass (xxhash)": t4 - t3,
        "commit": t5 - t4,
    }


@contextlib.contextmanager
def pure_path() -> Iterator[None]:
    """Torch copies + xxhash (MARU_NATIVE_COPY=0) for the duration."""
    saved = os.environ.get(ENV_NATIVE_COPY)
    os.environ[ENV_NATIVE_COPY] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[ENV_NATIVE_COPY]
        else:
            os.environ[ENV_NATIVE_COPY] = saved


def memcpy_once(nbytes: int, bufs: dict[str, torch.Tensor]) -> float:
    if "src" not in bufs:
        bufs["src"] = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        bufs["dst"] = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    t0 = time.perf_counter()
    bufs["dst"].copy_(bufs["src"])
    return time.perf_counter() - t0


# ---- 3. miss tax at a prefill rate -----------------------------------------------------------
class CpuForward:
    """A fixed amount of matmul work on this core that takes `seconds` when it has the core alone."""

    def __init__(self) -> None:
        self.a = torch.randn(256, 256)
        t0 = time.perf_counter()
        for _ in range(200):
            self.a @ self.a
        self.per_iter = (time.perf_counter() - t0) / 200

    def __call__(self, seconds: float) -> None:
        for _ in range(max(1, round(seconds / self.per_iter))):
            self.a @ self.a


def prefill_once(rig: Rig, mode: str | None, chunks: int, forward: Callable[[float], None], kv_rate: float) -> float:
    """TTFT of one prompt of `chunks` chunks: steps of STEP_TOKENS, stores after each forward."""
    side = rig.sides[mode] if mode else None
    chunks_per_step = STEP_TOKENS // (BLOCK * BLOCKS_PER_CHUNK)
    all_stores = rig.stores(chunks)
    t0 = time.perf_counter()
    for first in range(0, chunks, chunks_per_step):
        step = all_stores[first : first + chunks_per_step]
        meta = MaruConnectorMetadata(stores=step)
        if side is not None:
            side.handle_preemptions(meta)
        forward(len(step) * rig.chunk_bytes / kv_rate)
        if side is not None:
            side.store(meta)
            side.finished_stores(set(), meta)
    return time.perf_counter() - t0


def alternate(samples: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Minimum of each configuration over `repeats` rounds, configurations interleaved; each
    round starts one configuration later, so none always runs right after the same one (the
    memcpy sweeps 128 MiB through the caches: whatever always ran next would pay for it)."""
    best = {k: float("inf") for k in samples}
    for r in range(repeats):
        for k in rotated(list(samples), r):
            best[k] = min(best[k], samples[k]())
    return best


# ---- 4. real engines --------------------------------------------------------------------------
def engine_miss_tax(args: argparse.Namespace) -> dict[str, float]:

    from maru_vllm.fixtures.models import ensure_model
    from maru_vllm.launch import stack

    def ttft(url: str, model: str, prompt: list[int]) -> float:
        return client.timed_completion(url, model, prompt)[0]

    model = str(ensure_model("bench"))
    work = Path(tempfile.mkdtemp(prefix="maru-bstore-eng-"))
    address = f"unix://{work}/pool.sock"
    with ProcessGroup() as group:
        group.add(PoolProcess(f"bse{free_port()}", "2G", work / "pool.log", listen=[address])).serve()
        kv = {
            "kv_connector": "MaruKVConnector",
            "kv_connector_module_path": "maru_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"maru_pool_address": address},
        }
        urls = {}
        for name, cfg in (("with", kv), ("without", None)):
            env = stack.StackEnv(discovery_dir=work / "disc").build(cpu_thread=args.core, VLLM_CPU_KVCACHE_SPACE="1")
            proc, url = stack.vllm_openai_server(
                name,
                model,
                env,
                work,
                max_model_len=8192,
                kv_transfer_config=cfg,
                extra_args=["--max-num-batched-tokens", str(STEP_TOKENS)],
            )
            proc.cpus = frozenset({args.core})
            group.start(proc)
            urls[name] = url
        for name, url in urls.items():
            next(p for p in group if p.name == name).wait_for_http(f"{url}/v1/models", timeout=600)
        for i, url in enumerate(urls.values()):
            ttft(url, model, [65 + i] * 300)  # warm kernels
        rng = random.Random(0)
        best = {k: float("inf") for k in urls}
        for _ in range(args.engine_repeats):
            for name, url in urls.items():  # distinct prompts: every request is a miss
                prompt = [rng.randrange(32, 127) for _ in range(args.chunks * 256 + 1)]
                best[name] = min(best[name], ttft(url, model, prompt))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=16, help="chunks per prompt (16 = 4096 tokens, 64 MiB)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--core", type=int, default=0, help="the one core everything runs on")
    ap.add_argument(
        "--cpu-kv-rate",
        type=float,
        default=64 * 2**20 / 2.5,
        help="bytes of KV a prefill of the bench model produces per second on this CPU "
        "(measured: a 4096-token cold prefill, 64 MiB of KV, takes ~2.5 s)",
    )
    ap.add_argument("--engines", action="store_true", help="also measure the miss tax with real vLLM engines")
    ap.add_argument("--engine-repeats", type=int, default=5)
    ap.add_argument("--engines-only", action="store_true", help="only part 4 (the one that needs the heavy lock)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    results: dict[str, object] = {"chunks": args.chunks}
    work = Path(tempfile.mkdtemp(prefix="maru-bstore-"))
    if args.engines_only:
        args.engines = True
    with ProcessGroup() as group:
        if args.engines_only:
            return report(args, results, engine_miss_tax(args))
        rig = Rig(group, work, num_blocks=max(64, args.chunks * BLOCKS_PER_CHUNK))
        nbytes = args.chunks * rig.chunk_bytes
        results["bytes_per_prompt"] = nbytes
        bufs: dict[str, torch.Tensor] = {}
        holds: dict[str, float] = {}
        work_s: dict[str, float] = {}

        def sample(mode: str) -> Callable[[], float]:
            def run() -> float:
                hold, busy, _stored = store_once(rig, mode, args.chunks)
                holds[mode] = min(holds.get(mode, float("inf")), hold)
                work_s[mode] = min(work_s.get(mode, float("inf")), busy)
                return busy

            return run

        def sample_pure() -> float:
            with pure_path():
                _hold, busy, _stored = store_once(rig, "write-behind", args.chunks)
            work_s["pure path"] = min(work_s.get("pure path", float("inf")), busy)
            return busy

        configs = {
            "write-behind": sample("write-behind"),
            "inline": sample("inline"),
            "no checksum": sample("no checksum"),
            "pure path": sample_pure,
            "memcpy": lambda: memcpy_once(nbytes, bufs),
        }
        alternate(configs, 2)  # warm-up
        holds.clear()
        work_s.clear()
        best = alternate(configs, args.repeats)
        holds.pop("no checksum")
        parts: dict[str, float] = {}
        for _ in range(args.repeats):
            for k, v in parts_once(rig, args.chunks).items():
                parts[k] = min(parts.get(k, float("inf")), v)
        gbps = lambda s: nbytes / s / 1e9  # noqa: E731
        results["memcpy_GBps"] = gbps(best["memcpy"])
        results["store_GBps"] = gbps(work_s["write-behind"])
        results["store_over_memcpy"] = best["memcpy"] / work_s["write-behind"]
        results["path"] = path_name()
        results["store_pure_path_GBps"] = gbps(work_s["pure path"])
        results["store_pure_path_over_memcpy"] = best["memcpy"] / work_s["pure path"]
        results["store_no_checksum_GBps"] = gbps(work_s["no checksum"])
        results["store_no_checksum_over_memcpy"] = best["memcpy"] / work_s["no checksum"]
        results["parts_GBps"] = {k: gbps(v) for k, v in parts.items()}
        results["hold_ns_per_MiB"] = {m: holds[m] / (nbytes / 2**20) * 1e9 for m in holds}
        results["hold_s"] = dict(holds)

        forward_cpu = CpuForward()
        taxes: dict[str, dict[str, float]] = {}
        for label, fwd, rate in (("gpu", time.sleep, GPU_KV_RATE), ("cpu", forward_cpu, args.cpu_kv_rate)):
            reps = args.repeats if label == "gpu" else max(3, args.repeats // 2)

            def one(mode: str | None, fwd: Callable[[float], None] = fwd, rate: float = rate) -> float:
                t = prefill_once(rig, mode, args.chunks, fwd, rate)
                rig.clear()  # after the TTFT: a write-behind copy may still be running then
                return t

            ttfts = alternate({m: (lambda m=m: one(m)) for m in (None, "inline", "write-behind")}, reps)
            base = ttfts[None]
            taxes[label] = {
                "ttft_without_s": base,
                "kv_rate_GBps": rate / 1e9,
                **{f"tax_{m}": ttfts[m] / base - 1 for m in ("inline", "write-behind")},
            }
        results["miss_tax_sim"] = taxes
        rig.close()
    return report(args, results, engine_miss_tax(args) if args.engines else None)


def report(args: argparse.Namespace, results: dict, eng: dict[str, float] | None) -> int:
    if eng is not None:
        results["engines"] = {
            "cold_with_s": eng["with"],
            "cold_without_s": eng["without"],
            "miss_tax": eng["with"] / eng["without"] - 1,
        }
    if args.json:
        print(json.dumps(results, indent=2, default=str))
        return 0
    if args.engines:
        e = results["engines"]
        print(
            f"vLLM engines (bench model, {args.chunks * 256 + 1}-token prompts), same core, cold TTFT min of "
            f"{args.engine_repeats}: with connector {e['cold_with_s']:.3f} s, without "
            f"{e['cold_without_s']:.3f} s, miss tax {e['miss_tax'] * 100:+.2f}%"
        )
    if "store_GBps" not in results:
        return 0
    taxes = results["miss_tax_sim"]
    nbytes = results["bytes_per_prompt"]
    mib = nbytes / 2**20
    print(
        f"bench-model KV, {args.chunks} chunks = {mib:.0f} MiB per prompt, one core ({args.core}), "
        f"min of {args.repeats}; data path as served: {results['path']}"
    )
    print(
        f"  store (writer: reserve + page copy + checksum + commit) {results['store_GBps']:6.2f} GB/s | "
        f"memcpy of the same bytes {results['memcpy_GBps']:6.2f} GB/s | store/memcpy {results['store_over_memcpy']:.2f}"
    )
    print(
        f"  store on the pure path (MARU_NATIVE_COPY=0) {results['store_pure_path_GBps']:6.2f} GB/s | "
        f"store/memcpy {results['store_pure_path_over_memcpy']:.2f}"
    )
    print(
        f"  store with maru_checksum=false {results['store_no_checksum_GBps']:6.2f} GB/s | "
        f"store/memcpy {results['store_no_checksum_over_memcpy']:.2f}"
    )
    print("  parts: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in results["parts_GBps"].items()))
    for m, ns in results["hold_ns_per_MiB"].items():
        print(
            f"  step held by the store ({m:12s}) {results['hold_s'][m] * 1e3:8.3f} ms per prompt "
            f"= {ns / 1e3:8.2f} us per MiB stored"
        )
    for label, t in taxes.items():
        print(
            f"  miss tax at {label.upper()} prefill rate ({t['kv_rate_GBps']:.3f} GB/s of KV, TTFT without "
            f"{t['ttft_without_s'] * 1e3:.0f} ms): inline {t['tax_inline'] * 100:+.2f}%, "
            f"write-behind {t['tax_write-behind'] * 100:+.2f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
