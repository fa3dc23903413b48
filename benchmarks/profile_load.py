#!/usr/bin/env python3
"""Where a pool load's time goes, outside an engine: acquire round trip, checksum, copy, release.

Starts a real pool service, builds a paged KV cache with the `bench` model's geometry the way
vLLM 0.31 allocates it (one zeroed allocation, every layer a view), stores N chunks from a second
cache through the connector's worker side, then times the worker side's load of all of them,
step by step, alternating configurations (checksum on / off) and taking the minimum of the
repeats. A plain memcpy of the same bytes from the same region is timed in the same loop.

    python benchmarks/profile_load.py [--tokens 4096] [--repeats 15] [--json]

No assertions: it prints a table (or JSON) of milliseconds and GB/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from maru_vllm.connector import layouts  # noqa: E402
from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata  # noqa: E402
from maru_vllm.connector.pool_access import PoolAccess  # noqa: E402
from maru_vllm.connector.worker import MaruWorkerSide  # noqa: E402
from maru_vllm.launch import ManagedProcess, ProcessGroup, free_port  # noqa: E402
from maru_vllm.models import SPECS  # noqa: E402
from maru_vllm.pool.objects import checksum_of, payload_hasher  # noqa: E402

NS = "kv:profile"


def bench_caches(layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
                 seed: int) -> dict[str, torch.Tensor]:
    """vLLM 0.31 CPU: one zeroed allocation, layer-major, each layer a [B, H, N, 2D] view."""
    g = torch.Generator().manual_seed(seed)
    big = torch.zeros(layers, num_blocks, kv_heads, block_size, 2 * head_dim, dtype=torch.bfloat16)
    big[:, :64].copy_(torch.randn(layers, 64, kv_heads, block_size, 2 * head_dim, generator=g))
    return {f"model.layers.{i}.self_attn.attn": big[i] for i in range(layers)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = SPECS["bench"]
    bpc = args.chunk_tokens // args.block_size
    chunks = args.tokens // args.chunk_tokens
    work = Path(tempfile.mkdtemp(prefix="maru-profile-"))
    address = f"unix://{work}/pool.sock"
    report: dict[str, object] = {"tokens": args.tokens, "chunks": chunks}
    with ProcessGroup() as group:
        pool = group.start(ManagedProcess("pool", [sys.executable, "-m", "maru_vllm.pool", "serve", "--name",
                                                   f"prof{free_port()}", "--size", "1G", "--listen", address],
                                          log_path=work / "pool.log"))
        pool.wait_for_log("maru-pool serving on", timeout=60)

        def side(seed: int, checksum: bool) -> tuple[MaruWorkerSide, dict[str, torch.Tensor]]:
            kv = bench_caches(spec.num_layers, args.num_blocks, spec.num_kv_heads, args.block_size,
                              spec.head_dim, seed)
            w = MaruWorkerSide(namespace=NS, rank=0, pool=PoolAccess(address, None, 5.0, checksum, "profile"),
                               block_size=args.block_size, num_blocks=args.num_blocks,
                               use_lmcache_kernels=False, enable_fused_load=False)
            w.register_kv_caches(kv, "CPU_ATTN")
            return w, kv

        writer, _ = side(1, True)
        keys = [f"chunk-{c}".encode() for c in range(chunks)]
        writer.store(MaruConnectorMetadata(stores=[
            ChunkStore("w", keys[c], list(range(c * bpc, (c + 1) * bpc)), {"chunk": c}) for c in range(chunks)]))
        assert writer.take_counters().chunks_stored == chunks, "store failed"
        reader, kv = side(2, True)
        codec = reader.codec
        assert codec is not None
        dest = list(range(100, 100 + chunks * bpc))
        meta = MaruConnectorMetadata(loads=[
            ChunkLoad("r", keys[c], dest[c * bpc:(c + 1) * bpc]) for c in range(chunks)])
        nbytes = codec.chunk_nbytes(len(dest))
        client = reader.pool.client
        client.ping()  # connect (and map the region) now
        region = torch.frombuffer(client._region.view, dtype=torch.uint8)  # noqa: SLF001 - same memory as the pool
        # memcpy reference: same byte count out of the region into a heap buffer
        ref_dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
        ref_src = region[1 << 20:(1 << 20) + nbytes]

        samples: dict[str, list[float]] = {}

        def timed(name: str, fn) -> None:  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            fn()
            samples.setdefault(name, []).append(time.perf_counter() - t0)

        full_keys = [k + b"/r0" for k in keys]

        def unpack_all(pins: list, hashed: bool) -> None:  # type: ignore[type-arg]
            for ld, p in zip(meta.loads, pins):
                h = payload_hasher() if hashed else None
                codec.unpack(ld.block_ids, p.data, hasher=h)
                if h is not None and checksum_of(h) != p.checksum:
                    raise AssertionError("checksum mismatch")

        for _ in range(args.repeats):
            timed("memcpy of the same bytes", lambda: ref_dst.copy_(ref_src))
            timed("load (worker side, as served)", lambda: reader.load(meta))
            assert not reader.take_failed_blocks()
            pins: list = []  # type: ignore[type-arg]
            timed("  acquire round trip + header check", lambda: pins.extend(
                client.acquire(full_keys, NS, verify_payload=False)))
            timed("  copy only (no checksum)", lambda: unpack_all(pins, False))
            timed("  copy + checksum fused per tile", lambda: unpack_all(pins, True))
            timed("  checksum as a separate pass", lambda: [p.verify() for p in [
                dataclasses.replace(p, payload_verified=False) for p in pins]])
            timed("  release round trip", lambda: client.release(pins))
            for tile in (512 << 10, 1 << 20, 2 << 20):
                layouts.TILE_BYTES, default = tile, layouts.TILE_BYTES
                pins = client.acquire(full_keys, NS, verify_payload=False)
                timed(f"  (tile {tile >> 10} KiB) copy + checksum", lambda: unpack_all(pins, True))
                client.release(pins)
                layouts.TILE_BYTES = default
        reader.take_counters()
    mins = {k: min(v) for k, v in samples.items()}
    report.update({"bytes": nbytes, "ms": {k: round(v * 1e3, 3) for k, v in mins.items()},
                   "GBps": {k: round(nbytes / v / 1e9, 2) for k, v in mins.items()}})
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{chunks} chunks, {nbytes / 2**20:.0f} MiB, min of {args.repeats}")
        for k, v in mins.items():
            print(f"  {k:40s} {v * 1e3:8.3f} ms  {nbytes / v / 1e9:7.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
