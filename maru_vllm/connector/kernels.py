"""Optional LMCache compiled transfer kernels, resolved across LMCache releases.

The connector works without them (pure torch page copies, see ``layouts``); the
kernels only speed up CUDA caches. Supported: the releases in
``maru_vllm.versions.LMCACHE`` (0.4.3 - 0.5.6); any other installed release takes the
torch path with one warning naming it. Where a release keeps each piece:

* 0.4.3 - 0.4.4: kernels and enums (the format enum named ``GPUKVFormat``) in the compiled
  ``lmcache.c_ops``; detection ``gpu_connector.utils.discover_gpu_kv_format`` (the format only);
* 0.4.5 - 0.4.7: the same modules; detection ``gpu_connector.utils.normalize_kv_and_discover_format``;
* 0.5.0 - 0.5.3: kernels and enums (``EngineKVFormat``) in ``lmcache.c_ops``; detection
  ``gpu_connector.kv_format.detection.detect_format``;
* 0.5.4 - 0.5.6: kernels in the compiled ``lmcache.cuda_ops``, enums only in ``lmcache.lmcache_native``
  (a CPU extension); detection as 0.5.0.

(``gpu_connector`` is ``lmcache.v1.gpu_connector``.) The block kernel
``multi_layer_block_kv_transfer`` takes the same arguments in every one of them (0.5.4+
takes the enums as their ints, which LMCache's enums convert to). Its page-geometry and
pointer helpers (``make_page_buffer_shape_desc``, ``get_group_data_ptrs``) exist from 0.4.5;
on 0.4.3 - 0.4.4 they are composed from that release's own getters, as its multiprocess
server does. vLLM's layout name becomes LMCache's layout hint through
``lmcache.integration.vllm.utils.translate_vllm_kv_cache_layout`` from 0.5.5, before that by
the same names (``LBNHC`` -> ``NHD``, ``LBHNC`` -> ``HND``). LMCache's torch implementation
of the block kernel (same object format; the fallback when a launch fails) is in
``lmcache.python_ops_fallback`` (0.4.7 - 0.5.2), ``lmcache.v1.platform.torch_ops``
(0.5.3 - 0.5.5) and ``lmcache.v1.platform.torch_ops.mp_mem_kernels`` (0.5.6); 0.4.3 - 0.4.6
have none. On a CPU-only host the compiled modules fail to import (``libc10_cuda.so``), and
0.4.6 - 0.5.3 then put LMCache's Python fallbacks at ``lmcache.c_ops``: those are not kernels.

Everything that resolves is bundled in one :class:`LMCacheKernels`; any missing piece
means ``None`` (torch path), logged once, never an error at call time. Std ``logging`` is
used: importing ``vllm.logger`` costs seconds.
"""

from __future__ import annotations

import importlib
import logging
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from maru_vllm.versions import LMCACHE, release_numbers

logger = logging.getLogger(__name__)

__all__ = [
    "LMCacheKernels",
    "CopierAPI",
    "KernelProbe",
    "REQUIRED_KERNELS",
    "probe_lmcache_kernels",
    "resolve_lmcache_kernels",
    "resolve_fused_load",
    "kernels_usable_for",
    "kernel_path_summary",
    "lmcache_copier_api",
    "unsupported_release",
]

REQUIRED_KERNELS: tuple[str, ...] = (
    "multi_layer_kv_transfer",
    "single_layer_kv_transfer",
    "load_and_reshape_flash",
    "reshape_and_cache_back_flash",
)
_OPTIONAL_KERNELS: tuple[str, ...] = ("multi_layer_block_kv_transfer",)
_ENUMS: tuple[str, ...] = ("EngineKVFormat", "TransferDirection")
# 0.4.x names the engine KV format enum GPUKVFormat.
_ENUM_NAMES: dict[str, tuple[str, ...]] = {
    "EngineKVFormat": ("EngineKVFormat", "GPUKVFormat"),
    "TransferDirection": ("TransferDirection",),
}

SOURCE_GEN_A = "lmcache.c_ops"
SOURCE_GEN_B = "lmcache.c_ops+lmcache.lmcache_native"
SOURCE_GEN_C = "lmcache.cuda_ops+lmcache.lmcache_native"

_GPU_UTILS = "lmcache.v1.gpu_connector.utils"
_DETECTORS: tuple[tuple[str, str], ...] = (
    ("lmcache.v1.gpu_connector.kv_format.detection", "detect_format"),  # 0.5.0+
    (_GPU_UTILS, "normalize_kv_and_discover_format"),  # 0.4.5 - 0.4.7
    (_GPU_UTILS, "discover_gpu_kv_format"),  # 0.4.3 - 0.4.4: the format only
)
_TORCH_BLOCK_KERNEL: tuple[str, ...] = (
    "lmcache.v1.platform.torch_ops.mp_mem_kernels",  # 0.5.6
    "lmcache.v1.platform.torch_ops",  # 0.5.3 - 0.5.5
    "lmcache.python_ops_fallback",  # 0.4.7 - 0.5.2
)
# vLLM KVCacheLayout names -> LMCache's kv_layout hint, for releases before 0.5.5.
_LAYOUT_HINTS = {"NHD": "NHD", "HND": "HND", "LBNHC": "NHD", "LBHNC": "HND"}

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
class CopierAPI:
    """LMCache's Python helpers the block copier calls, found where the installed release keeps them."""

    detector: str  # module.function of the layout detection, for diagnostics
    EngineKVFormat: Any
    TransferDirection: Any
    _detect: Callable[..., Any]
    _engine: Any  # EngineType.VLLM
    _returns_paged: bool
    _utils: ModuleType
    _desc_type: Any  # the kernel module's PageBufferShapeDesc (0.4.3 - 0.4.4)
    _translate: Callable[[str], str] | None

    def layout_hint(self, kv_layout: str) -> str:
        """LMCache's ``kv_layout`` hint for vLLM's layout name; NotImplementedError: unsupported."""
        if self._translate is not None:
            return self._translate(kv_layout)
        if kv_layout in _LAYOUT_HINTS:
            return _LAYOUT_HINTS[kv_layout]
        raise NotImplementedError(f"this LMCache release cannot copy the {kv_layout!r} KV cache layout")

    def detect(self, layers: list[torch.Tensor], kv_layout: str | None) -> tuple[Any, Any]:
        """(engine KV format, the caches as LMCache addresses them) by the release's detector."""
        hints: dict[str, Any] = {} if kv_layout is None else {"kv_layout": self.layout_hint(kv_layout)}
        if self._returns_paged:
            fmt, paged = self._detect(layers, self._engine, hints)
            return fmt, paged
        return self._detect(layers, self._engine, layout_hints=hints), layers

    def shape_desc(self, paged: Any, fmt: Any, num_layers: int, num_blocks: int, block_size: int) -> Any:
        """The block kernel's ``PageBufferShapeDesc`` of these caches."""
        make = getattr(self._utils, "make_page_buffer_shape_desc", None)
        if make is not None:
            return make(paged, fmt, 0, num_layers, num_blocks, block_size)
        u, first = self._utils, [paged[0]]
        mla = bool(u.is_mla(fmt))
        desc = self._desc_type()
        desc.kv_size, desc.nl, desc.nb, desc.bs = (1 if mla else 2), num_layers, num_blocks, block_size
        desc.nh = 1 if mla else int(u.get_num_heads(first, fmt))
        desc.hs = int(u.get_head_size(first, fmt))
        desc.element_size = paged[0].element_size()
        return desc

    def group_ptrs(self, paged: Any, fmt: Any, num_layers: int) -> list[int]:
        """The per-layer base pointers the compiled block kernel reads."""
        get = getattr(self._utils, "get_group_data_ptrs", None)
        if get is not None:
            return list(get(paged, fmt, list(range(num_layers))))
        return [int(t.data_ptr()) for t in paged]

    def torch_block_kernel(self) -> tuple[Callable[..., Any] | None, str]:
        """LMCache's torch implementation of the block kernel and where it was found, or None and why."""
        problems: list[str] = []
        for name in _TORCH_BLOCK_KERNEL:
            module = _import(name, problems)
            fn = None if module is None else getattr(module, "multi_layer_block_kv_transfer", None)
            if callable(fn):
                return fn, name
        return None, "this LMCache release has no torch implementation of it (" + "; ".join(problems) + ")"


@dataclass(frozen=True)
class LMCacheKernels:
    """The resolved kernels and enums; call sites need not know the release."""

    source: str
    multi_layer_kv_transfer: Callable[..., Any]
    single_layer_kv_transfer: Callable[..., Any]
    load_and_reshape_flash: Callable[..., Any]
    reshape_and_cache_back_flash: Callable[..., Any]
    EngineKVFormat: Any
    TransferDirection: Any
    multi_layer_block_kv_transfer: Callable[..., Any] | None = None
    copier_api: CopierAPI | None = None
    version: str | None = None

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
    version: str | None = None
    unsupported: str | None = None  # set when the installed release is outside the supported ones


def kernels_usable_for(tensor: torch.Tensor) -> bool:
    """The compiled kernels take device pointers: only CUDA (incl. ROCm) tensors."""
    return tensor.device.type == "cuda"


def unsupported_release(version: str | None) -> str | None:
    """Why ``version`` of LMCache takes the torch path, or None when it is a supported release."""
    if version is None or LMCACHE.covers(version):
        return None
    span = LMCACHE.span
    if release_numbers(version) < release_numbers(LMCACHE.releases[0]):
        return f"LMCache {version} is older than the supported {span}"
    if release_numbers(version) > release_numbers(LMCACHE.releases[-1]):
        return f"LMCache {version} is newer than the supported {span}"
    return f"LMCache {version} is not one of the supported releases ({span})"


def _import(name: str, problems: list[str]) -> ModuleType | None:
    """Import ``name`` or record why not (missing module, missing CUDA libs)."""
    try:
        return importlib.import_module(name)
    except (ImportError, OSError, RuntimeError) as exc:
        problems.append(f"{name}: {type(exc).__name__}: {exc}")
        return None


def _find(module: ModuleType, name: str) -> Any:
    """Attribute ``name`` of ``module`` under any of the names releases gave it, or None."""
    for alias in _ENUM_NAMES.get(name, (name,)):
        value = getattr(module, alias, None)
        if callable(value):
            return value
    return None


def _missing(module: ModuleType, names: tuple[str, ...]) -> list[str]:
    """Names absent from ``module`` (or present but not callable/type)."""
    return [n for n in names if _find(module, n) is None]


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


def _python_fallback(module: ModuleType) -> str | None:
    """Where ``module``'s kernels come from when they are LMCache's Python fallbacks, not compiled ops
    (0.4.6 - 0.5.3 put those at ``lmcache.c_ops`` when the compiled module does not load)."""
    fn = getattr(module, REQUIRED_KERNELS[0], None)
    fn = getattr(fn, "__func__", fn)  # 0.5.3: a method of its device ops
    origin = str(getattr(fn, "__module__", None) or "")
    return origin if isinstance(fn, types.FunctionType) and origin.split(".")[0] == "lmcache" else None


def _copier_api(kmod: ModuleType, emod: ModuleType, problems: list[str]) -> CopierAPI | None:
    """The block copier's LMCache helpers of the installed release, or None (why, in ``problems``)."""
    lm_utils = _import("lmcache.utils", problems)
    gpu_utils = _import(_GPU_UTILS, problems)
    if lm_utils is None or gpu_utils is None:
        return None
    detect = detector = None
    for module_name, fn_name in _DETECTORS:
        module = gpu_utils if module_name == _GPU_UTILS else _import(module_name, [])
        if module is not None and callable(getattr(module, fn_name, None)):
            detect, detector = getattr(module, fn_name), f"{module_name}.{fn_name}"
            break
    if detect is None or detector is None:
        problems.append(f"no LMCache KV layout detection found ({', '.join(f for _, f in _DETECTORS)})")
        return None
    desc_type = getattr(emod, "PageBufferShapeDesc", None) or getattr(kmod, "PageBufferShapeDesc", None)
    composed = ("is_mla", "get_num_heads", "get_head_size")
    if not hasattr(gpu_utils, "make_page_buffer_shape_desc") and (
        desc_type is None or any(not hasattr(gpu_utils, n) for n in composed)
    ):
        problems.append(f"{_GPU_UTILS} lacks make_page_buffer_shape_desc and the getters to compose it")
        return None
    vllm_utils = _import("lmcache.integration.vllm.utils", [])
    translate = getattr(vllm_utils, "translate_vllm_kv_cache_layout", None) if vllm_utils else None
    return CopierAPI(
        detector=detector,
        EngineKVFormat=_find(emod, "EngineKVFormat"),
        TransferDirection=_find(emod, "TransferDirection"),
        _detect=detect,
        _engine=lm_utils.EngineType.VLLM,
        _returns_paged=not detector.endswith("discover_gpu_kv_format"),
        _utils=gpu_utils,
        _desc_type=desc_type,
        _translate=translate,
    )


def _bundle(source: str, kmod: ModuleType, emod: ModuleType, problems: list[str]) -> LMCacheKernels:
    block = getattr(kmod, "multi_layer_block_kv_transfer", None)
    api = None
    if block is not None:
        api = _copier_api(kmod, emod, problems)
        if api is None:
            block = None  # without the release's helpers the block copier cannot be built
    return LMCacheKernels(
        source=source,
        **{n: getattr(kmod, n) for n in REQUIRED_KERNELS},
        **{n: _find(emod, n) for n in _ENUMS},
        multi_layer_block_kv_transfer=block,
        copier_api=api,
        version=LMCACHE.installed(),
    )


def probe_lmcache_kernels() -> KernelProbe:
    """Resolve kernels, enums and the copier's helpers for the installed release; never raises.

    Imports lmcache, so only call it when the kernels are wanted.
    """
    problems: list[str] = []
    version = LMCACHE.installed()
    reason = unsupported_release(version)
    if reason is not None:
        return KernelProbe(None, None, None, (reason,), version, reason)
    if _import("lmcache", problems) is None:
        return KernelProbe(None, None, None, tuple(problems), version)

    kmod = _module_with("lmcache.c_ops", REQUIRED_KERNELS, "kernels", problems)
    origin = None if kmod is None else _python_fallback(kmod)
    if origin is not None:
        problems.append(f"lmcache.c_ops holds LMCache's Python fallbacks ({origin}): its compiled ops did not load")
        kmod = None
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
        kernels = _bundle(source, kmod, emod, problems)
    return KernelProbe(
        kernels,
        None if kmod is None else kmod.__name__,
        None if emod is None else emod.__name__,
        tuple(problems),
        version,
    )


def resolve_lmcache_kernels(enabled: bool) -> LMCacheKernels | None:
    """The LMCache kernels, or ``None`` for the torch path.

    ``enabled=False`` returns ``None`` without importing lmcache. Otherwise the
    outcome (which release and module, or why the torch path) is logged once; an
    unsupported release is one warning naming it.
    """
    if not enabled:
        return None
    probe = probe_lmcache_kernels()
    if probe.unsupported is not None:
        _log_once(logging.WARNING, "%s: using the torch copy path", probe.unsupported)
        return None
    if probe.kernels is None:
        _log_once(
            logging.INFO,
            "LMCache transfer kernels unavailable, using the torch copy path (%s)",
            "; ".join(probe.problems) or "no kernel module found",
        )
        return None
    if probe.kernels.multi_layer_block_kv_transfer is None and probe.problems:
        _log_once(
            logging.INFO,
            "LMCache's block kernel cannot be used, pages move by torch copies (%s)",
            "; ".join(probe.problems),
        )
    _log_once(logging.INFO, "Using LMCache transfer kernels from %s", probe.kernels.source)
    return probe.kernels


def lmcache_copier_api() -> CopierAPI:
    """The block copier's LMCache helpers (also where the compiled kernels do not load, for LMCache's
    torch kernel); ImportError, saying why, when they do not resolve."""
    problems: list[str] = []
    reason = unsupported_release(LMCACHE.installed())
    if reason is not None:
        raise ImportError(reason)
    emod = _module_with("lmcache.c_ops", _ENUMS, "enums", problems) or _module_with(
        "lmcache.lmcache_native", _ENUMS, "enums", problems
    )
    api = None if emod is None else _copier_api(emod, emod, problems)
    if api is None:
        raise ImportError("LMCache's copier helpers did not resolve: " + "; ".join(problems))
    return api


def kernel_path_summary(device_type: str, use_lmcache_kernels: bool = True) -> str:
    """One phrase for the start-up line: which copy path an engine on ``device_type`` takes and why.

    ``kernel path: LMCache 0.5.6 (lmcache.cuda_ops)``, ``torch path: CPU engine``,
    ``torch path: LMCache 0.4.2 is older than the supported 0.4.3 - 0.5.6``,
    ``torch path: LMCache not installed``. Imports lmcache only on a CUDA engine with the
    kernels enabled.
    """
    if device_type != "cuda":
        return f"torch path: {device_type.upper()} engine"
    if not use_lmcache_kernels:
        return "torch path: maru_use_lmcache_kernels is off"
    version = LMCACHE.installed()
    reason = unsupported_release(version)
    if reason is not None:
        return f"torch path: {reason}"
    probe = probe_lmcache_kernels()
    if probe.problems and probe.problems[0].startswith("lmcache: "):
        return "torch path: LMCache not installed"
    named = f"LMCache {version or '(version unknown)'}"
    kernels = probe.kernels
    if kernels is None:
        # A module this release does not have at all says less than why the one it has failed.
        telling = [p for p in probe.problems if "No module named" not in p] or list(probe.problems) or ["none found"]
        return f"torch path: {named} kernels unavailable ({telling[0]})"
    if kernels.multi_layer_block_kv_transfer is None:
        why = probe.problems[-1] if probe.problems else f"{probe.kernels_module} has no multi_layer_block_kv_transfer"
        return f"torch path: {named} block kernel unusable ({why})"
    return f"kernel path: {named} ({probe.kernels_module})"


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
