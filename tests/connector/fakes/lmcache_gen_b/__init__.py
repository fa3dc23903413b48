"""FAKE lmcache package (lmcache_gen_b) for tests; not LMCache code."""

FAKE_NAME = "lmcache_gen_b"
