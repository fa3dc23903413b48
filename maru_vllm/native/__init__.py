"""Optional compiled helpers, and the single switch that decides whether they are used.

`_copyhash` (copyhash.c) copies a pool payload to or from the pages of a CPU KV cache and
computes the payload's XXH3-64 checksum in the same pass, so verifying a load or checksumming
a store no longer costs a second pass over memory. Its hash is bit-identical to the `xxhash`
package's, so objects written with and without it are interchangeable: the pure path (torch
copies + `xxhash`) stays the reference and the fallback.

`MARU_NATIVE_COPY=0` forces the pure path. Without the compiled module (a build without a C
compiler, or an import failure) the pure path is used as well. Which path is in use is logged
once per process.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

ENV_NATIVE_COPY = "MARU_NATIVE_COPY"
_OFF_VALUES = frozenset({"0", "false", "no", "off"})


@functools.cache
def _load(setting: str) -> ModuleType | None:
    if setting.strip().lower() in _OFF_VALUES:
        logger.info("Maru data path: torch copies + xxhash checksums (%s=%s)", ENV_NATIVE_COPY, setting)
        return None
    try:
        from maru_vllm.native import _copyhash
    except ImportError as exc:
        logger.info("Maru data path: torch copies + xxhash checksums (compiled copy kernel unavailable: %s)", exc)
        return None
    logger.info("Maru data path: fused copy + checksum kernel (%s)", _copyhash.isa())
    return _copyhash


def copy_kernel() -> Any | None:
    """The compiled `_copyhash` module, or None when the pure path is to be used."""
    return _load(os.environ.get(ENV_NATIVE_COPY, "1"))


def path_name() -> str:
    """Which data path a copy takes now: ``native-<isa>`` or ``pure``."""
    k = copy_kernel()
    return "pure" if k is None else f"native-{k.isa()}"
