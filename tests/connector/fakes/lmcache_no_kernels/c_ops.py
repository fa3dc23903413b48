"""FAKE no_kernels kernel module for tests; the functions only return a tag (two are missing)."""

from tests.connector.fakes.lmcache_shapes import define_kernels

define_kernels(globals(), "no_kernels", ("multi_layer_kv_transfer", "single_layer_kv_transfer"))
