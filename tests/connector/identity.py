"""A KV identity for tests (a small CPU engine's facts); tests change one field with `dataclasses.replace`."""

from __future__ import annotations

from maru_vllm.connector.namespace import KVIdentity

IDENTITY = KVIdentity(
    model="/models/llama",
    revision=None,
    dtype="torch.bfloat16",
    kv_cache_dtype="auto",
    block_size=128,
    num_layers=2,
    num_kv_heads=2,
    head_size=64,
    attention="FullAttentionSpec@cpu",
    pp_size=1,
    hash_algo="sha256",
    salt="",
)
