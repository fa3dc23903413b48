#!/usr/bin/env python3
"""GPU <-> pool: load and store bandwidth of the connector's copies against cudaMemcpy of the same bytes.

    python benchmarks/bench_gpu_transfer.py [--layers 64] [--kv-heads 8] [--head-size 128]
        [--block-size 16] [--chunks 16] [--repeats 7] [--json]

Needs an NVIDIA GPU; without one it says so and exits with status 77 ("skipped").
The defaults are Qwen2.5-32B's KV geometry (64 layers, 8 KV heads, head 128, bf16): 16
chunks of 256 tokens = 1 GiB, the seed's 1.1 GB prefix. KV caches are vLLM 0.31's single
allocation on the GPU; a real pool service holds the objects in shared memory.

For each copier the connector can use (torch page copies; LMCache's block kernel when it
resolves) and with the pool region registered with CUDA (DMA) or not (driver-staged), it
times the real worker side: a store (reserve, device->region copy, checksum, commit) and a
load (acquire, region->device copy, release), and compares their bandwidth with
`cudaMemcpy` of the same number of bytes between the same GPU and a pinned host buffer
(torch `copy_` into `pin_memory()`), measured alternately in the same run; minimum of N.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

SKIPPED = 77


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=16, help="chunks of 256 tokens per prompt")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_gpu_transfer: no CUDA device here (torch.cuda.is_available() is False); this benchmark "
            "measures copies between a GPU's KV cache and the pool and needs an NVIDIA GPU. Skipped.",
            file=sys.stderr,
        )
        return SKIPPED

    from maru_vllm.connector import transfer
    from maru_vllm.connector.chunks import placeholder_meta
    from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
    from maru_vllm.connector.pool_access import PoolAccess
    from maru_vllm.connector.worker import MaruWorkerSide
    from maru_vllm.launch import ProcessGroup, free_port
    from maru_vllm.launch.stack import PoolProcess
    from maru_vllm.pool import PoolClient

    bpc = 256 // args.block_size
    num_blocks = args.chunks * bpc * 2
    big = torch.randn(
        args.layers, num_blocks, args.kv_heads, args.block_size, 2 * args.head_size, dtype=torch.bfloat16, device="cuda"
    )
    kv = {f"model.layers.{i}.self_attn.attn": big[i] for i in range(args.layers)}
    work = Path(tempfile.mkdtemp(prefix="maru-bgpu-"))
    address = f"unix://{work}/pool.sock"
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "chunks": args.chunks}
    with ProcessGroup() as group:
        nbytes_region = int(big.numel() * 2 * 1.5) + (256 << 20)
        group.add(PoolProcess(f"bgpu{free_port()}", nbytes_region, work / "pool.log", listen=[address])).serve(120)
        admin = PoolClient.connect(address)
        configs = [("torch", False)]
        if transfer.copy_format("cuda", True) == transfer.FORMAT_LMCACHE_BLOCK:
            configs.append(("lmcache", True))
        rows: dict[str, dict[str, float]] = {}
        n = 0

        def make_side(namespace: str, kernels: bool) -> MaruWorkerSide:
            side = MaruWorkerSide(
                namespace=namespace,
                rank=0,
                pool=PoolAccess(address, None, 30.0, True, "bench"),
                block_size=args.block_size,
                num_blocks=num_blocks,
                use_lmcache_kernels=kernels,
                enable_fused_load=kernels,
                blocks_per_chunk=bpc,
                write_behind=False,
            )
            side.register_kv_caches(kv, "FLASH_ATTN", "LBHNC")  # the layout `big` has
            return side

        def close_side(side: MaruWorkerSide) -> None:
            side.shutdown()
            if side.host_registry is not None:
                side.host_registry.close()
            side.pool.close()

        def chunk_stores(tag: str) -> list[ChunkStore]:
            return [
                ChunkStore("r", f"{tag}-{c}".encode(), list(range(c * bpc, (c + 1) * bpc)), placeholder_meta(c))
                for c in range(args.chunks)
            ]

        def chunk_loads(stores: list[ChunkStore]) -> list[ChunkLoad]:
            return [
                ChunkLoad("r2", s.key, list(range(num_blocks // 2 + i * bpc, num_blocks // 2 + (i + 1) * bpc)))
                for i, s in enumerate(stores)
            ]

        for name, kernels in configs:
            for registered in (True, False):
                side = make_side(f"bgpu-{name}", kernels)
                if not registered:
                    side.host_registry = side.writer.host_registry = None
                chunk_bytes = side.copier.chunk_nbytes(bpc)
                total = chunk_bytes * args.chunks
                src = torch.empty(total, dtype=torch.uint8, device="cuda")
                host = torch.empty(total, dtype=torch.uint8).pin_memory()
                best = {
                    "store": float("inf"),
                    "load": float("inf"),
                    "memcpy D2H": float("inf"),
                    "memcpy H2D": float("inf"),
                }
                for _ in range(args.repeats + 1):
                    n += 1
                    stores = chunk_stores(str(n))
                    side.take_counters()
                    side.store(MaruConnectorMetadata(stores=stores))
                    if side.writer is not None:  # write-behind: the copy finishes on the writer thread
                        side.writer.wait(timeout=60)
                    c = side.take_counters()
                    best["store"] = min(best["store"], c.store_seconds)
                    t0 = time.perf_counter()
                    side.load(MaruConnectorMetadata(loads=chunk_loads(stores)))
                    torch.cuda.synchronize()
                    best["load"] = min(best["load"], time.perf_counter() - t0)
                    assert not side.take_failed_blocks()
                    for label, dst, s in (("memcpy D2H", host, src), ("memcpy H2D", src, host)):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        dst.copy_(s, non_blocking=True)
                        torch.cuda.synchronize()
                        best[label] = min(best[label], time.perf_counter() - t0)
                    admin.remove(None, f"bgpu-{name}")
                gb = lambda s: total / s / 1e9  # noqa: E731
                rows[f"{name}{'' if registered else ' (region not registered)'}"] = {
                    "store_GBps": gb(best["store"]),
                    "load_GBps": gb(best["load"]),
                    "memcpy_D2H_GBps": gb(best["memcpy D2H"]),
                    "memcpy_H2D_GBps": gb(best["memcpy H2D"]),
                    "store_over_memcpy": best["memcpy D2H"] / best["store"],
                    "load_over_memcpy": best["memcpy H2D"] / best["load"],
                    "bytes": total,
                }
                close_side(side)
                del src, host
        if len(configs) == 2:
            # One namespace for both copiers: each loads the other's objects (converted by torch).
            for writer, reader in ((False, True), (True, False)):
                w, r = make_side("bgpu-mixed", writer), make_side("bgpu-mixed", reader)
                best_load = float("inf")
                for _ in range(args.repeats + 1):
                    n += 1
                    stores = chunk_stores(str(n))
                    w.store(MaruConnectorMetadata(stores=stores))
                    if w.writer is not None:
                        w.writer.wait(timeout=60)
                    t0 = time.perf_counter()
                    r.load(MaruConnectorMetadata(loads=chunk_loads(stores)))
                    torch.cuda.synchronize()
                    best_load = min(best_load, time.perf_counter() - t0)
                    assert not r.take_failed_blocks()
                    admin.remove(None, "bgpu-mixed")
                label = f"{'lmcache' if reader else 'torch'} loading {'lmcache' if writer else 'torch'} objects"
                rows[label] = {"load_GBps": w.copier.chunk_nbytes(bpc) * args.chunks / best_load / 1e9}
                close_side(w)
                close_side(r)
        admin.close()
        results["copiers"] = rows
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"{results['gpu']}: {args.chunks} chunks, {next(iter(rows.values()))['bytes'] / 2**30:.2f} GiB, "
        f"min of {args.repeats}"
    )
    for name, r in rows.items():
        if "store_GBps" not in r:
            print(f"  {name:36s} load {r['load_GBps']:6.2f} GB/s")
            continue
        print(
            f"  {name:36s} store {r['store_GBps']:6.2f} GB/s ({r['store_over_memcpy']:.2f}x cudaMemcpy D2H "
            f"{r['memcpy_D2H_GBps']:.1f}) | load {r['load_GBps']:6.2f} GB/s ({r['load_over_memcpy']:.2f}x "
            f"cudaMemcpy H2D {r['memcpy_H2D_GBps']:.1f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
