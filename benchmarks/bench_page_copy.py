"""Time KVCacheSet.pack/unpack of one chunk against a plain contiguous copy of the same bytes.

    python benchmarks/bench_page_copy.py [--layers 16] [--blocks 2] [--block-size 128]
        [--kv-heads 8] [--head-size 64] [--dtype bfloat16] [--iters 200]

Prints bandwidths and the pack/unpack : memcpy ratios measured in this run, for
three cache arrangements: vLLM 0.31's single allocation (all layers views of one
buffer, LBHNC), independent per-layer [B, H, N, C] tensors, and the legacy
FlashAttention [2, B, N, H, D] layout (K and V slabs strided). No assertions.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time
from collections.abc import Callable

import torch

from maru_vllm.connector.layouts import KVCacheSet


def _paired_median_s(fn: Callable[[], object], ref: Callable[[], object], iters: int) -> tuple[float, float]:
    """Medians of ``fn`` and ``ref`` sampled alternately, so both see the same noise."""
    for _ in range(max(3, iters // 10)):
        fn()
        ref()
    a, b = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        ref()
        t2 = time.perf_counter()
        a.append(t1 - t0)
        b.append(t2 - t1)
    return statistics.median(a), statistics.median(b)


def _caches(kind: str, a: argparse.Namespace, num_blocks: int, dtype: torch.dtype):
    L, H, N, D = a.layers, a.kv_heads, a.block_size, a.head_size
    if kind == "vllm-0.31 single alloc":
        big = torch.randn(L, num_blocks, H, N, 2 * D).to(dtype)
        return {f"l{i}": big[i] for i in range(L)}, None
    if kind == "per-layer [B,H,N,C]":
        return {f"l{i}": torch.randn(num_blocks, H, N, 2 * D).to(dtype) for i in range(L)}, None
    if kind == "legacy [2,B,N,H,D]":
        return {f"l{i}": torch.randn(2, num_blocks, N, H, D).to(dtype) for i in range(L)}, "FLASH_ATTN"
    raise ValueError(kind)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--blocks", type=int, default=2, help="blocks per chunk")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--num-blocks", type=int, default=32, help="blocks in each cache")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (on small VMs >1 thread stalls intermittently)"
    )
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)

    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{a.layers} layers x {a.blocks} blocks x {a.block_size} tokens x "
        f"{a.kv_heads} kv heads x head {a.head_size} ({a.dtype})"
    )
    # Consecutive ids (one run) and scattered ids (one run per block).
    id_sets = {"consecutive": list(range(5, 5 + a.blocks)), "scattered": [5 + 3 * i for i in range(a.blocks)]}
    for kind in ("vllm-0.31 single alloc", "per-layer [B,H,N,C]", "legacy [2,B,N,H,D]"):
        src, backend = _caches(kind, a, a.num_blocks, dtype)
        dst, _ = _caches(kind, a, a.num_blocks, dtype)
        cs = KVCacheSet(src, a.block_size, backend_name=backend)
        cd = KVCacheSet(dst, a.block_size, backend_name=backend)
        nbytes = cs.chunk_nbytes(a.blocks)
        # Anonymous shared mapping: same kind of memory as the pool's objects.
        shm = mmap.mmap(-1, nbytes)
        view = memoryview(shm)
        m_src = torch.randn(nbytes // 4)
        m_dst = torch.empty_like(m_src)
        memcpy = lambda: m_dst.copy_(m_src)  # noqa: E731
        gbs = lambda t: nbytes / t / 1e9  # noqa: E731
        print(
            f"\n[{kind}] chunk {nbytes / 2**20:.2f} MiB, "
            f"one strided copy per run across layers: {cs._stack is not None}"
        )
        ro = view.toreadonly()
        for label, ids in id_sets.items():
            for op, fn in (("pack", lambda: cs.pack(ids, view)), ("unpack", lambda: cd.unpack(ids, ro))):
                t_op, t_mem = _paired_median_s(fn, memcpy, a.iters)
                print(
                    f"  {op:6s} {label:11s} {t_op * 1e3:7.3f} ms {gbs(t_op):6.2f} GB/s | "
                    f"memcpy {t_mem * 1e3:7.3f} ms {gbs(t_mem):6.2f} GB/s | "
                    f"{op}/memcpy bandwidth ratio {t_mem / t_op:4.2f}"
                )
        ro.release()
        view.release()
        shm.close()


if __name__ == "__main__":
    main()
