"""FAKE gen_b kernel module for tests; the functions only return a tag."""

from tests.connector.fakes.lmcache_shapes import define_kernels

define_kernels(globals(), "gen_b")
