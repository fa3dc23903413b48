"""The pool namespace of an engine: everything that makes KV bytes incompatible.

Two engines may load each other's chunks only when their KV pages are byte-compatible and
their block hashes mean the same tokens. The namespace is a digest over the model identity,
dtypes, block size, layer/head geometry, device type, parallel layout, vLLM's hash algorithm
and the user's `maru_namespace` salt. The scheduler and the worker compute it from the same
`VllmConfig`, so both sides agree without talking to each other. (`cache_salt` and LoRA
already change vLLM's block hashes, so they need no place here.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from maru_vllm.events.pool_view import model_namespace_prefix

NAMESPACE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class KVIdentity:
    """The facts that decide whether two engines' KV chunks are interchangeable."""

    model: str
    revision: str | None
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    attention: str  # layout family: the KV spec class, MLA or not, and the device type
    tp_size: int
    pp_size: int
    hash_algo: str
    salt: str

    def digest(self) -> str:
        blob = json.dumps([NAMESPACE_VERSION, dataclasses.asdict(self)], sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=16).hexdigest()

    def namespace(self) -> str:
        """Pool namespace string: readable prefix (for `pool status`) + digest."""
        return model_namespace_prefix(self.model) + self.digest()


def _kv_spec_facts(kv_cache_config: Any) -> tuple[int, int, int, str, int]:
    """(num_layers, num_kv_heads, head_size, spec kind, block_size) from vLLM's KVCacheConfig."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if len(groups) != 1:
        raise ValueError(
            f"MaruKVConnector supports models with one KV cache group (full attention); this model has "
            f"{len(groups)} groups"
        )
    spec = groups[0].kv_cache_spec
    num_layers = len(groups[0].layer_names)
    heads = int(getattr(spec, "num_kv_heads", 1))
    head = int(getattr(spec, "head_size", 0))
    kind = type(spec).__name__ + (":mla" if getattr(spec, "use_mla", False) else "")
    return num_layers, heads, head, kind, int(spec.block_size)


def identity_from_vllm(vllm_config: Any, kv_cache_config: Any, salt: str) -> KVIdentity:
    """Build the identity from a vLLM `VllmConfig` and `KVCacheConfig`."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    num_layers, heads, head, kind, block_size = _kv_spec_facts(kv_cache_config)
    return KVIdentity(
        model=str(model_config.model),
        revision=getattr(model_config, "revision", None),
        dtype=str(model_config.dtype),
        kv_cache_dtype=str(cache_config.cache_dtype),
        block_size=block_size,
        num_layers=num_layers,
        num_kv_heads=heads,
        head_size=head,
        attention=f"{kind}@{current_platform.device_type}",
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        hash_algo=str(getattr(cache_config, "prefix_caching_hash_algo", "sha256")),
        salt=salt,
    )
