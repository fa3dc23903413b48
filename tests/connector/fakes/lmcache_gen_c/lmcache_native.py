"""FAKE lmcache_native (gen c): enums only."""

from tests.connector.fakes.lmcache_shapes import EngineKVFormat, TransferDirection  # noqa: F401
