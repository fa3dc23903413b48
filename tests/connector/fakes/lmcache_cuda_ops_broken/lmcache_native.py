"""FAKE lmcache_native (enums only)."""

import enum


class EngineKVFormat(enum.IntEnum):
    NL_X_TWO_NB_BS_NH_HS = 1
    NL_X_NB_TWO_BS_NH_HS = 2


class TransferDirection(enum.IntEnum):
    H2D = 0
    D2H = 1
