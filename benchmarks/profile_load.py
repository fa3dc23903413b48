#!/usr/bin/env python3
"""Where a pool load's time goes, outside an engine: acquire round trip, checksum, copy, release.

Starts a real pool service, builds a paged KV cache with the `bench` model's geometry the way
vLLM 0.31 allocates it on CPU (one zeroed allocation, layer-major, every layer a view), stores
the chunks of one prompt from a second cache through the connector's worker side, then times
the worker side's load of all of them, and each of its parts, alternating them in one loop and
taking the minimum of the repeats. A memcpy of the same bytes out of the same region is timed
in the same loop. `bench_connector.py` runs this too, in its own run.

    python benchmarks/profile_load.py [--tokens 4096] [--repeats 15] [--cpu N] [--tiles 512,2048]
        [--algorithms] [--json]

"As served" is the data path this process uses (the fused copy + checksum kernel of
maru_vllm.native when built and not turned off); the pure path (torch copies + xxhash, what
MARU_NATIVE_COPY=0 selects) is timed in the same loop for comparison.

No assertions: it prints milliseconds and GB/s (or JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from harness import min_time  # noqa: E402 - benchmarks/ is on sys.path when a script runs
from maru_vllm.connector import layouts  # noqa: E402
from maru_vllm.connector.chunks import placeholder_meta  # noqa: E402
from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata  # noqa: E402
from maru_vllm.connector.pool_access import PoolAccess  # noqa: E402
from maru_vllm.connector.transfer import WholeChunk  # noqa: E402
from maru_vllm.connector.worker import MaruWorkerSide  # noqa: E402
from maru_vllm.fixtures.models import SPECS  # noqa: E402
from maru_vllm.launch import ProcessGroup, free_port  # noqa: E402
from maru_vllm.launch.stack import PoolProcess  # noqa: E402
from maru_vllm.native import ENV_NATIVE_COPY, copy_kernel, path_name  # noqa: E402
from maru_vllm.pool.objects import checksum_from_digest, checksum_of, payload_hasher  # noqa: E402

NS = "kv:profile"
LOAD = "load (worker side, as served)"
LOAD_PURE = "load, pure path (MARU_NATIVE_COPY=0)"
MEMCPY = "memcpy of the same bytes"
COPY_ONLY = "  copy only (no checksum)"
FUSED = "  copy + checksum (as served)"
PURE_COPY_ONLY = "  pure path: torch copies only"
PURE_FUSED = "  pure path: torch copies + tiled xxhash"
SEPARATE = "  checksum as a separate pass"


def bench_caches(
    layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int, seed: int
) -> dict[str, torch.Tensor]:
    """vLLM 0.31 CPU: one zeroed allocation, layer-major (LBHNC), each layer a [B, H, N, 2D] view."""
    g = torch.Generator().manual_seed(seed)
    big = torch.zeros(layers, num_blocks, kv_heads, block_size, 2 * head_dim, dtype=torch.bfloat16)
    big[:, :64].copy_(torch.randn(layers, 64, kv_heads, block_size, 2 * head_dim, generator=g))
    return {f"model.layers.{i}.self_attn.attn": big[i] for i in range(layers)}


def profile_load(
    tokens: int = 4096,
    repeats: int = 15,
    *,
    chunk_tokens: int = 256,
    block_size: int = 128,
    num_blocks: int = 160,
    tiles: tuple[int, ...] = (),
    model: str = "bench",
) -> dict[str, Any]:
    """Min-of-`repeats` milliseconds of a load of `tokens` tokens of the fixture `model`'s KV and its parts."""
    torch.set_num_threads(1)
    spec = SPECS[model]
    bpc = chunk_tokens // block_size
    chunks = tokens // chunk_tokens
    if chunks * bpc * 2 + 8 > num_blocks:
        num_blocks = chunks * bpc * 2 + 8
    work = Path(tempfile.mkdtemp(prefix="maru-profile-"))
    address = f"unix://{work}/pool.sock"
    samples: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        fn()
        samples.setdefault(name, []).append(time.perf_counter() - t0)

    with ProcessGroup() as group:
        group.add(
            PoolProcess(
                f"prof{free_port()}", "1G", work / "pool.log", listen=[address], cpus=tuple(os.sched_getaffinity(0))
            )
        ).serve()

        def side(seed: int) -> MaruWorkerSide:
            kv = bench_caches(spec.num_layers, num_blocks, spec.num_kv_heads, block_size, spec.head_dim, seed)
            w = MaruWorkerSide(
                namespace=NS,
                rank=0,
                pool=PoolAccess(address, None, 5.0, True, "profile"),
                block_size=block_size,
                num_blocks=num_blocks,
                use_lmcache_kernels=False,
                enable_fused_load=False,
            )
            w.register_kv_caches(kv, "CPU_ATTN")
            return w

        writer = side(1)
        keys = [f"chunk-{c}".encode() for c in range(chunks)]
        writer.store(
            MaruConnectorMetadata(
                stores=[
                    ChunkStore("w", keys[c], list(range(c * bpc, (c + 1) * bpc)), placeholder_meta(c))
                    for c in range(chunks)
                ]
            )
        )
        if writer.writer is not None:  # write-behind: wait until the writer thread committed them
            writer.writer.wait(timeout=60)
        if writer.take_counters().chunks_stored != chunks:
            raise RuntimeError("profile_load: storing the chunks failed")
        reader = side(2)
        codec = reader.codec
        assert codec is not None
        dest = list(range(chunks * bpc + 4, 2 * chunks * bpc + 4))
        meta = MaruConnectorMetadata(
            loads=[ChunkLoad("r", keys[c], dest[c * bpc : (c + 1) * bpc]) for c in range(chunks)]
        )
        nbytes = codec.chunk_nbytes(len(dest))
        client = reader.pool.client
        client.ping()  # connect and map the region now
        full_keys = [k + b"/r0" for k in keys]
        pins = [p for p in client.acquire(full_keys, NS, verify_payload=False) if p is not None]
        client.release(pins)
        # memcpy reference: the same number of bytes out of the same shared region, into a
        # touched heap buffer (the engine's KV cache is zeroed at start, so touched too)
        region = torch.frombuffer(client._region.view, dtype=torch.uint8)
        ref_src = region[1 << 20 : (1 << 20) + nbytes]
        ref_dst = torch.zeros(nbytes, dtype=torch.uint8)

        copier = reader.copier
        assert copier is not None

        def unpack_all(pins: list[Any], hashed: bool) -> None:
            # As the worker loads: the step's chunks in one batched pass where the kernel is built.
            items = [WholeChunk(ld.block_ids, p.data, 0, hashed) for ld, p in zip(meta.loads, pins)]
            digests = copier.unpack_whole_many(items)
            if digests is not None:
                if hashed and any(d is None or checksum_from_digest(d) != p.checksum for d, p in zip(digests, pins)):
                    raise RuntimeError("profile_load: checksum mismatch")
                return
            for ld, p in zip(meta.loads, pins):
                h = payload_hasher() if hashed else None
                codec.unpack(ld.block_ids, p.data, hasher=h)
                if h is not None and checksum_of(h) != p.checksum:
                    raise RuntimeError("profile_load: checksum mismatch")

        def pure(fn: Callable[[], object]) -> Callable[[], object]:
            def run() -> object:
                saved = os.environ.get(ENV_NATIVE_COPY)
                os.environ[ENV_NATIVE_COPY] = "0"
                try:
                    return fn()
                finally:
                    if saved is None:
                        del os.environ[ENV_NATIVE_COPY]
                    else:
                        os.environ[ENV_NATIVE_COPY] = saved

            return run

        for _ in range(repeats):
            timed(MEMCPY, lambda: ref_dst.copy_(ref_src))
            timed(LOAD, lambda: reader.load(meta))
            timed(LOAD_PURE, pure(lambda: reader.load(meta)))
            if reader.take_failed_blocks():
                raise RuntimeError("profile_load: a load failed")
            got: list[Any] = []
            timed(
                "  acquire round trip + header checks",
                lambda: got.extend(client.acquire(full_keys, NS, verify_payload=False)),
            )
            timed(COPY_ONLY, lambda: unpack_all(got, False))
            timed(FUSED, lambda: unpack_all(got, True))
            timed(PURE_COPY_ONLY, pure(lambda: unpack_all(got, False)))
            timed(PURE_FUSED, pure(lambda: unpack_all(got, True)))
            timed(SEPARATE, lambda: [dataclasses.replace(p, payload_verified=False).verify() for p in got])
            timed("  release round trip", lambda: client.release(got))
            for tile in tiles:
                layouts.TILE_BYTES, default = tile, layouts.TILE_BYTES
                got = client.acquire(full_keys, NS, verify_payload=False)
                timed(f"  pure path, {tile >> 10} KiB tiles", pure(lambda: unpack_all(got, True)))
                client.release(got)
                layouts.TILE_BYTES = default
        reader.take_counters()
        reader.pool.close()
        writer.pool.close()
    ms = {k: min(v) * 1e3 for k, v in samples.items()}
    # What verifying costs a load: copy + checksum minus the fastest copy without one, over the load.
    copy_floor = min(ms[COPY_ONLY], ms[PURE_COPY_ONLY])
    return {
        "tokens": tokens,
        "chunks": chunks,
        "bytes": nbytes,
        "repeats": repeats,
        "path": path_name(),
        "ms": ms,
        "GBps": {k: nbytes / v / 1e6 for k, v in ms.items()},
        "load_over_memcpy": ms[MEMCPY] / ms[LOAD],
        "load_pure_over_memcpy": ms[MEMCPY] / ms[LOAD_PURE],
        "checksum_share_of_load": max(0.0, ms[FUSED] - copy_floor) / ms[LOAD],
        "checksum_share_of_load_pure": max(0.0, ms[PURE_FUSED] - copy_floor) / ms[LOAD_PURE],
        "checksum_separate_pass_share": ms[SEPARATE] / (copy_floor + ms[SEPARATE]),
    }


def checksum_algorithms(nbytes: int = 64 << 20, repeats: int = 10) -> dict[str, float]:
    """GB/s of candidate checksums over `nbytes` of a /dev/shm mapping (one thread, min of repeats)."""
    import mmap
    import zlib

    import xxhash

    algos: dict[str, Callable[[memoryview], object]] = {
        "xxh3_64": xxhash.xxh3_64_intdigest,
        "xxh3_128": xxhash.xxh3_128_intdigest,
        "xxh64": xxhash.xxh64_intdigest,
        "xxh32": xxhash.xxh32_intdigest,
        "crc32 (zlib)": zlib.crc32,
    }
    kernel = copy_kernel()
    if kernel is not None:  # the same XXH3-64, computed by this project's compiled kernel
        algos[f"xxh3_64 (maru_vllm.native, {kernel.isa()})"] = kernel.hash
    try:
        import blake3

        algos["blake3 (1 thread)"] = lambda b: blake3.blake3(b).digest()
    except ImportError:
        pass
    path = Path(f"/dev/shm/maru-profile-algos-{os.getpid()}")
    out: dict[str, float] = {}
    try:
        with open(path, "w+b") as f:
            f.truncate(nbytes)
            mm = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        view = memoryview(mm)
        view[:] = os.urandom(1 << 20) * (nbytes >> 20)
        for name, fn in algos.items():
            out[name] = nbytes / min_time(lambda fn=fn: fn(view), repeats) / 1e9
        view.release()
        mm.close()
    finally:
        path.unlink(missing_ok=True)
    return out


def print_profile(rep: dict[str, Any]) -> None:
    print(
        f"load of {rep['tokens']} tokens ({rep['chunks']} chunks, {rep['bytes'] / 2**20:.0f} MiB), "
        f"outside an engine, min of {rep['repeats']}; data path as served: {rep['path']}"
    )
    for k, v in rep["ms"].items():
        print(f"  {k:42s} {v:8.3f} ms  {rep['GBps'][k]:7.2f} GB/s")
    print(
        f"  load / memcpy bandwidth {rep['load_over_memcpy']:.2f} (pure path {rep['load_pure_over_memcpy']:.2f}); "
        f"checksum share of a load {rep['checksum_share_of_load']:.1%} (pure path "
        f"{rep['checksum_share_of_load_pure']:.1%}; as a separate pass {rep['checksum_separate_pass_share']:.1%})"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--cpu", type=int, help="pin this process (and its pool service) to this core")
    ap.add_argument("--tiles", default="", help="also time these checksum tile sizes, KiB, comma separated")
    ap.add_argument("--algorithms", action="store_true", help="also time candidate checksum algorithms")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    tiles = tuple(int(t) << 10 for t in args.tiles.split(",") if t)
    rep = profile_load(args.tokens, args.repeats, tiles=tiles)
    if args.algorithms:
        rep["checksum_GBps"] = checksum_algorithms()
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_profile(rep)
        for name, gbps in rep.get("checksum_GBps", {}).items():
            print(f"  checksum {name:18s} {gbps:6.1f} GB/s over 64 MiB of shared memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
