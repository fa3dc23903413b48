"""FAKE lmcache package (lmcache_gen_c) for tests; not LMCache code."""

FAKE_NAME = "lmcache_gen_c"
