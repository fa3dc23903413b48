"""The KV-cache space of a vLLM engine on a CPU install, when its user sized none.

vLLM on CPU sizes its KV cache from `VLLM_CPU_KVCACHE_SPACE` (GiB) or `--kv-cache-memory-bytes`;
with neither it reserves `--gpu-memory-utilization` (0.92 by default) of the node's memory and
refuses to start when that much is not free - on any machine that runs anything else, and for
the second engine of a host always. So the worker components pick a space themselves when the
user gave no size at all: a tenth of the memory available now, 1 to 8 GiB, which leaves room for
the engine itself and its neighbours. Too little memory for even that stops the worker with one
line saying what to set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping, Sequence

from maru_vllm.launch.argv import has_flag

logger = logging.getLogger(__name__)

ENV = "VLLM_CPU_KVCACHE_SPACE"
SIZE_FLAGS = (
    "--kv-cache-memory-bytes",
    "--kv_cache_memory_bytes",
    "--gpu-memory-utilization",
    "--gpu_memory_utilization",
)
GIB = 1 << 30
MIN_GIB, MAX_GIB = 1, 8
SHARE_OF_AVAILABLE = 0.1
ENGINE_GIB = 3  # what one vLLM CPU engine (three processes, a small model) takes besides its KV cache


class NotEnoughMemory(RuntimeError):
    """Less memory is available than one CPU engine with the smallest KV space needs."""


def pick_kv_space_gib(argv: Sequence[str], environ: Mapping[str, str], available_bytes: int) -> int | None:
    """GiB of KV cache to give the engine, or None when the user sized it (env or flag)."""
    if environ.get(ENV, "") != "" or has_flag(argv, *SIZE_FLAGS):
        return None
    gib = min(MAX_GIB, max(MIN_GIB, int(available_bytes * SHARE_OF_AVAILABLE / GIB)))
    if available_bytes < (gib + ENGINE_GIB) * GIB:
        raise NotEnoughMemory(
            f"only {available_bytes / GIB:.1f} GiB of memory is available, a vLLM CPU engine needs about "
            f"{gib + ENGINE_GIB} GiB with a {gib} GiB KV cache; free memory, or set {ENV}=<GiB of KV cache> "
            f"(or --kv-cache-memory-bytes) to what this engine may use"
        )
    return gib


def apply_default_kv_space(argv: Sequence[str], environ: MutableMapping[str, str] = os.environ) -> int | None:
    """On a CPU install with no KV size given, set `VLLM_CPU_KVCACHE_SPACE` in `environ` (returns it)."""
    from maru_vllm.launch.stack import cpu_engines

    if not cpu_engines():
        return None
    import psutil

    gib = pick_kv_space_gib(argv, environ, psutil.virtual_memory().available)
    if gib is not None:
        environ[ENV] = str(gib)
        logger.warning(
            "No KV cache size given on this CPU install: using %s=%d (GiB); set it, or "
            "--kv-cache-memory-bytes, to choose",
            ENV,
            gib,
        )
    return gib
