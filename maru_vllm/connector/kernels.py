"""Optional LMCache compiled transfer kernels, resolved across LMCache generations.

The connector works without them (pure torch page copies, see ``layouts``); the
kernels only speed up CUDA caches. Where they live has moved between releases:

(a) old builds: kernels *and* the ``EngineKVFormat`` / ``TransferDirection`` enums
    on ``lmcache.c_ops``;
(b) ``lmcache.c_ops`` is a device-ops shim carrying the kernels but not the
    enums, which come from ``lmcache.lmcache_native``;
(c) 0.5.4+: no ``lmcache.c_ops``. The compiled CUDA ops are the pybind module
    ``lmcache.cuda_ops`` (``cuda_ops.cpython-*.so``: ``multi_layer_kv_transfer``,
    ``single_layer_kv_transfer``, ``load_and_reshape_flash``,
    ``reshape_and_cache_back_flash``, ``multi_layer_block_kv_transfer``, ...),
    which LMCache itself binds onto its ``lmcache.device_ops`` singleton; the
    enums live only in ``lmcache.lmcache_native``. On a CPU-only host
    ``lmcache.cuda_ops`` fails to import (``libc10_cuda.so`` missing), and
    ``lmcache.device_ops`` then holds LMCache's *Python* fallbacks, which is why
    it is not used as a kernel source here.

Everything that resolves is bundled in one :class:`LMCacheKernels`; any missing
piece means ``None`` (torch path), logged once, never an error at call time.
Std ``logging`` is used: importing ``vllm.logger`` costs seconds.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "LMCacheKernels",
    "KernelProbe",
    "REQUIRED_KERNELS",
    "probe_lmcache_kernels",
    "resolve_lmcache_kernels",
    "resolve_fused_load",
    "kernels_usable_for",
]

REQUIRED_KERNELS: tuple[str, ...] = (
    "multi_layer_kv_transfer",
    "single_layer_kv_transfer",
    "load_and_reshape_flash",
    "reshape_and_cache_back_flash",
)
_OPTIONAL_KERNELS: tuple[str, ...] = ("multi_layer_block_kv_transfer",)
_ENUMS: tuple[str, ...] = ("EngineKVFormat", "TransferDirection")

SOURCE_GEN_A = "lmcache.c_ops"
SOURCE_GEN_B = "lmcache.c_ops+lmcache.lmcache_native"
SOURCE_GEN_C = "lmcache.cuda_ops+lmcache.lmcache_native"

_logged: set[str] = set()
_log_lock = threading.Lock()


def _log_once(level: int, msg: str, *args: object) -> None:
    """Log a message the first time it is seen in this process."""
    key = msg % args if args else msg
    with _log_lock:
        if key in _logged:
            return
        _logged.add(key)
    logger.log(level, msg, *args)


@dataclass(frozen=True)
class LMCacheKernels:
    """The resolved kernels and enums; call sites need not know the generation."""

    source: str
    multi_layer_kv_transfer: Callable[..., Any]
    single_layer_kv_transfer: Callable[..., Any]
    load_and_reshape_flash: Callable[..., Any]
    reshape_and_cache_back_flash: Callable[..., Any]
    EngineKVFormat: Any
    TransferDirection: Any
    multi_layer_block_kv_transfer: Callable[..., Any] | None = None

    def usable_for(self, tensor: torch.Tensor) -> bool:
        """True when these kernels may run on ``tensor`` (CUDA only)."""
        return kernels_usable_for(tensor)


@dataclass(frozen=True)
class KernelProbe:
    """What resolution found, for diagnostics: where kernels/enums came from and why not."""

    kernels: LMCacheKernels | None
    kernels_module: str | None
    enums_module: str | None
    problems: tuple[str, ...]


def kernels_usable_for(tensor: torch.Tensor) -> bool:
    """The compiled kernels take device pointers: only CUDA (incl. ROCm) tensors."""
    return tensor.device.type == "cuda"


def _import(name: str, problems: list[str]) -> ModuleType | None:
    """Import ``name`` or record why not (missing module, missing CUDA libs)."""
    try:
        return importlib.import_module(name)
    except (ImportError, OSError, RuntimeError) as exc:
        problems.append(f"{name}: {type(exc).__name__}: {exc}")
        return None


def _missing(module: ModuleType, names: tuple[str, ...]) -> list[str]:
    """Names absent from ``module`` (or present but not callable/type)."""
    return [n for n in names if not callable(getattr(module, n, None))]


def _module_with(name: str, names: tuple[str, ...], what: str, problems: list[str]) -> ModuleType | None:
    """Module ``name`` if it imports and has every one of ``names`` (else why not, in ``problems``)."""
    module = _import(name, problems)
    if module is None:
        return None
    gap = _missing(module, names)
    if gap:
        problems.append(f"{name} lacks {what} {gap}")
        return None
    return module


def _bundle(source: str, kmod: ModuleType, emod: ModuleType) -> LMCacheKernels:
    optional: dict[str, Any] = {n: getattr(kmod, n, None) for n in _OPTIONAL_KERNELS}
    return LMCacheKernels(
        source=source,
        **{n: getattr(kmod, n) for n in REQUIRED_KERNELS},
        **{n: getattr(emod, n) for n in _ENUMS},
        **optional,
    )


def probe_lmcache_kernels() -> KernelProbe:
    """Resolve kernels and enums across generations (a), (b), (c); never raises.

    Imports lmcache, so only call it when the kernels are wanted.
    """
    problems: list[str] = []
    if _import("lmcache", problems) is None:
        return KernelProbe(None, None, None, tuple(problems))

    kmod = _module_with("lmcache.c_ops", REQUIRED_KERNELS, "kernels", problems)
    kernels_in_c_ops = kmod is not None
    if kmod is None:
        kmod = _module_with("lmcache.cuda_ops", REQUIRED_KERNELS, "kernels", problems)

    emod: ModuleType | None
    if kmod is not None and kernels_in_c_ops and not _missing(kmod, _ENUMS):
        emod = kmod
    else:
        emod = _module_with("lmcache.lmcache_native", _ENUMS, "enums", problems)

    kernels = None
    if kmod is not None and emod is not None:
        if kmod is emod:
            source = SOURCE_GEN_A
        elif kernels_in_c_ops:
            source = SOURCE_GEN_B
        else:
            source = SOURCE_GEN_C
        kernels = _bundle(source, kmod, emod)
    return KernelProbe(
        kernels,
        None if kmod is None else kmod.__name__,
        None if emod is None else emod.__name__,
        tuple(problems),
    )


def resolve_lmcache_kernels(enabled: bool) -> LMCacheKernels | None:
    """The LMCache kernels, or ``None`` for the torch path.

    ``enabled=False`` returns ``None`` without importing lmcache. Otherwise the
    outcome (which generation, or why the torch path) is logged once.
    """
    if not enabled:
        return None
    probe = probe_lmcache_kernels()
    if probe.kernels is None:
        _log_once(
            logging.INFO,
            "LMCache transfer kernels unavailable, using the torch copy path (%s)",
            "; ".join(probe.problems) or "no kernel module found",
        )
        return None
    _log_once(logging.INFO, "Using LMCache transfer kernels from %s", probe.kernels.source)
    return probe.kernels


def resolve_fused_load(enable_fused_load: bool, kernels: LMCacheKernels | None) -> bool:
    """Whether to use the fused load; asking for it without kernels warns (once)."""
    if not enable_fused_load:
        return False
    if kernels is None:
        _log_once(
            logging.WARNING,
            "Fused load requested but LMCache kernels are unavailable; loading with the torch path instead",
        )
        return False
    return True
