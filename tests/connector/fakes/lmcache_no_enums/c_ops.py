"""FAKE no_enums kernel module for tests; the functions only return a tag."""

from tests.connector.fakes.lmcache_shapes import define_kernels

define_kernels(globals(), "no_enums")
