"""FAKE lmcache package (lmcache_no_enums) for tests; not LMCache code."""

FAKE_NAME = "lmcache_no_enums"
