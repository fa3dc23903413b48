"""The worker side of the connector as tests build it: rank 0 over a real pool at `address`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from maru_vllm.connector.chunks import Slice
from maru_vllm.connector.object_format import HeadRange
from maru_vllm.connector.pool_access import PoolAccess
from maru_vllm.connector.worker import MaruWorkerSide
from tests.connector.sched_harness import BLOCK_SIZE


def worker_side(
    address: str,
    namespace: str,
    caches: Mapping[str, torch.Tensor],
    *,
    block_size: int,
    num_blocks: int,
    backend: str | None = "CPU_ATTN",
    timeout_s: float = 5.0,
    who: str = "test",
    use_lmcache_kernels: bool = False,
    enable_fused_load: bool = False,
    kv_layout: str | None = None,
    **options: Any,
) -> MaruWorkerSide:
    """A `MaruWorkerSide` with `caches` registered (attention `backend`, vLLM's `kv_layout`);
    `options` go to its constructor (write_behind, blocks_per_chunk)."""
    side = MaruWorkerSide(
        namespace=namespace,
        rank=0,
        pool=PoolAccess(address, None, timeout_s, True, who),
        block_size=block_size,
        num_blocks=num_blocks,
        use_lmcache_kernels=use_lmcache_kernels,
        enable_fused_load=enable_fused_load,
        **options,
    )
    side.register_kv_caches(caches, backend, kv_layout)
    return side


def small_worker(address: str, seed: int, namespace: str) -> tuple[MaruWorkerSide, dict[str, torch.Tensor]]:
    """A worker side over three small layers of random KV (16 blocks of 8 tokens), and its caches."""
    torch.manual_seed(seed)
    # vLLM 0.31 CPU layout: [num_blocks, kv_heads, block_size, 2 * head_size]
    caches = {f"layer{i}": torch.randn(16, 2, 8, 32).to(torch.bfloat16) for i in range(3)}
    return worker_side(address, namespace, caches, block_size=8, num_blocks=16), caches


def model_worker(
    address: str,
    namespace: str,
    *,
    block_size: int = BLOCK_SIZE,
    write_behind: bool = True,
    num_blocks: int = 64,
) -> tuple[MaruWorkerSide, dict[str, torch.Tensor]]:
    """A worker side whose layers are named and shaped like the test model's, and its caches."""
    torch.manual_seed(0)
    # vLLM 0.31 CPU layout: [num_blocks, kv_heads, block_size, 2 * head_size]
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.randn(num_blocks, 2, block_size, 128).to(torch.bfloat16)
        for i in range(2)
    }
    side = worker_side(
        address,
        namespace,
        caches,
        block_size=block_size,
        num_blocks=num_blocks,
        write_behind=write_behind,
        heads=HeadRange(0, 2, 2),
        slot=Slice(0, 0, 2),  # a TP 1 engine of the model: its one slice holds both KV heads
    )
    return side, caches


def buffer_address(view: memoryview) -> int:
    """Where a buffer's first byte is in this process's memory."""
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])
