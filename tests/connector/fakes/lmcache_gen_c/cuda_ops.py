"""FAKE gen_c kernel module for tests; the functions only return a tag."""

from tests.connector.fakes.lmcache_shapes import KERNELS, define_kernels

define_kernels(globals(), "gen_c", KERNELS + ("multi_layer_block_kv_transfer",))
