"""What the fake LMCache generations in this folder share (test doubles, not LMCache code).

The fakes stand in for the kernel and enum modules of LMCache generations that cannot be
installed here (see README.md); each fake module takes its parts from here, so the fakes
differ only in which module carries which of them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

#: The four transfer kernels every generation has.
KERNELS = (
    "multi_layer_kv_transfer",
    "single_layer_kv_transfer",
    "load_and_reshape_flash",
    "reshape_and_cache_back_flash",
)


class EngineKVFormat(enum.IntEnum):
    NL_X_TWO_NB_BS_NH_HS = 1
    NL_X_NB_TWO_BS_NH_HS = 2


class TransferDirection(enum.IntEnum):
    H2D = 0
    D2H = 1


def define_kernels(module_globals: dict[str, Any], tag: str, names: Iterable[str] = KERNELS) -> None:
    """Define each of `names` in a fake module (its `globals()`) as a function that only returns
    `(tag, name, args, kwargs)`, so a test can tell which fake a resolved kernel came from."""
    for name in names:
        module_globals[name] = _tagged(tag, name)


def _tagged(tag: str, name: str) -> Callable[..., tuple]:
    def kernel(*args: Any, **kwargs: Any) -> tuple:
        return (tag, name, args, kwargs)

    kernel.__name__ = name
    return kernel
