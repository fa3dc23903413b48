"""FAKE gen_a kernel module for tests: the kernels (they only return a tag) and the enums."""

from tests.connector.fakes.lmcache_shapes import EngineKVFormat, TransferDirection, define_kernels  # noqa: F401

define_kernels(globals(), "gen_a")
