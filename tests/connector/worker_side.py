"""The worker side of the connector as tests build it: rank 0 over a real pool at `address`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from maru_vllm.connector.pool_access import PoolAccess
from maru_vllm.connector.worker import MaruWorkerSide


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
    **options: Any,
) -> MaruWorkerSide:
    """A `MaruWorkerSide` with `caches` registered (attention `backend`); `options` go to its
    constructor (write_behind, blocks_per_chunk, expected_format)."""
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
    side.register_kv_caches(caches, backend)
    return side
