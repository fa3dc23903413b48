"""FAKE gen_a kernel module for tests; the functions only return a tag."""

import enum


def _tagged(name):
    def kernel(*args, **kwargs):
        return ("gen_a", name, args, kwargs)

    kernel.__name__ = name
    return kernel


for _name in (
    "multi_layer_kv_transfer",
    "single_layer_kv_transfer",
    "load_and_reshape_flash",
    "reshape_and_cache_back_flash",
):
    globals()[_name] = _tagged(_name)


class EngineKVFormat(enum.IntEnum):
    NL_X_TWO_NB_BS_NH_HS = 1
    NL_X_NB_TWO_BS_NH_HS = 2


class TransferDirection(enum.IntEnum):
    H2D = 0
    D2H = 1
