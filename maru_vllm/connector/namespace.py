"""The pool namespace of an engine: everything that makes KV bytes incompatible.

Two engines may load each other's chunks only when their KV pages hold the same content and
their block hashes mean the same tokens. The namespace is a digest over the model identity,
dtypes, block size, layer/head geometry (the model's KV heads, not a rank's), device type,
pipeline stages, vLLM's hash algorithm, the object format version and the user's
`maru_namespace` salt. The TP size is not in it: an object names the KV heads it holds in its
key and its trailer (chunks.py), so engines of every TP size share one namespace. The scheduler and the worker
compute it from the same `VllmConfig`, so both sides agree without talking to each other.
(`cache_salt` and LoRA already change vLLM's block hashes, so they need no place here.) The
page layout is not in it: each object states its own (object_format.py), and a load checks it.

With several KV cache groups (vLLM's hybrid KV cache manager) every group has a namespace of
its own: the digest then also covers the whole group layout and the group's index, so objects
of two groups, or of engines whose groups differ, can never be taken for each other. The pool's
events announce one group's objects (`kv_groups.announced_group`), whose namespace keeps the
`kv:<model>:` prefix the event relay selects by; the other groups' namespaces start with
`kvg<index>:<model>:`, which no relay announces.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from maru_vllm.connector.kv_groups import FULL, announced_group, kv_groups
from maru_vllm.pool.chunk_codec import model_namespace_prefix

NAMESPACE_VERSION = 2  # 2: the TP size left out, the model's KV heads in
# object_format.FORMAT_VERSION, without importing torch here (tests/connector/test_object_format.py
# checks that they agree).
OBJECT_FORMAT = 2


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
    pp_size: int
    hash_algo: str
    salt: str
    # The TP size, only where the model's KV head count is unknown: keys then name ranks, which
    # mean the same pages only at the same TP size (0 otherwise: every TP size shares).
    rank_named_tp: int = 0
    # The object format (object_format.py): objects of an older format are never found.
    object_format: int = OBJECT_FORMAT
    # Several KV cache groups, or a sliding-window one: every group's layout, this group's index,
    # and whether its objects are the announced ones ("" and -1 for one full-attention group,
    # leaving that digest as it always was).
    group_layout: str = ""
    group: int = -1
    announced: bool = True

    def digest(self) -> str:
        facts = dataclasses.asdict(self)
        if not self.group_layout:
            for name in ("group_layout", "group", "announced"):
                facts.pop(name)
        blob = json.dumps([NAMESPACE_VERSION, facts], sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=16).hexdigest()

    def namespace(self) -> str:
        """Pool namespace string: readable prefix (for `pool status`) + digest."""
        prefix = model_namespace_prefix(self.model)
        if not self.announced:
            prefix = f"kvg{self.group}:" + prefix[len("kv:") :]
        return prefix + self.digest()


def _kv_spec_facts(kv_cache_config: Any, group: int = 0) -> tuple[int, int, int, str, int]:
    """(num_layers, num_kv_heads, head_size, spec kind, block_size) of one group of vLLM's KVCacheConfig."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not 0 <= group < len(groups):
        raise ValueError(f"the KV cache config has {len(groups)} groups, not a group {group}")
    spec = groups[group].kv_cache_spec
    members = getattr(spec, "kv_cache_specs", None)
    if isinstance(members, dict) and members:
        spec = next(iter(members.values()))
    num_layers = len(groups[group].layer_names)
    heads = int(getattr(spec, "num_kv_heads", 1))
    head = int(getattr(spec, "head_size", 0))
    kind = type(spec).__name__ + (":mla" if getattr(spec, "use_mla", False) else "")
    return num_layers, heads, head, kind, int(spec.block_size)


def _total_kv_heads(model_config: Any) -> int:
    """The model's KV heads (a rank's pages hold a share of them, which differs by TP size); 0 if unknown."""
    try:
        return max(0, int(model_config.get_total_num_kv_heads()))
    except (AttributeError, TypeError, ValueError):
        return 0


def identity_from_vllm(vllm_config: Any, kv_cache_config: Any, salt: str, group: int = 0) -> KVIdentity:
    """Build the identity of one KV cache group from a vLLM `VllmConfig` and `KVCacheConfig`."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    num_layers, heads, head, kind, block_size = _kv_spec_facts(kv_cache_config, group)
    total_heads = _total_kv_heads(model_config)
    groups = kv_groups(kv_cache_config)
    plain = len(groups) == 1 and groups[0].kind == FULL  # one full-attention group: the digest as it always was
    layout = "" if plain else "; ".join(g.describe() for g in groups)
    return KVIdentity(
        model=str(model_config.model),
        revision=getattr(model_config, "revision", None),
        dtype=str(model_config.dtype),
        kv_cache_dtype=str(cache_config.cache_dtype),
        block_size=block_size,
        num_layers=num_layers,
        num_kv_heads=total_heads or heads,
        head_size=head,
        attention=f"{kind}@{current_platform.device_type}",
        pp_size=int(parallel.pipeline_parallel_size),
        rank_named_tp=0 if total_heads else int(parallel.tensor_parallel_size),
        hash_algo=str(getattr(cache_config, "prefix_caching_hash_algo", "sha256")),
        salt=salt,
        group_layout=layout,
        group=group if layout else -1,
        announced=not layout or group == announced_group(groups),
    )


def group_namespaces(vllm_config: Any, kv_cache_config: Any, salt: str) -> list[str]:
    """The pool namespace of every KV cache group, by group index."""
    return [
        identity_from_vllm(vllm_config, kv_cache_config, salt, g.index).namespace() for g in kv_groups(kv_cache_config)
    ]
