"""FAKE lmcache package (lmcache_cuda_ops_broken) for tests; not LMCache code."""

FAKE_NAME = "lmcache_cuda_ops_broken"
