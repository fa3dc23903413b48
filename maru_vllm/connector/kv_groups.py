"""The KV cache groups of an engine, as the connector sees them.

vLLM's hybrid KV cache manager splits a model's attention layers into groups, each with its
own block table, and allocates every group's blocks from one block pool (a block id names one
page in each layer of the group that holds it). Without the hybrid manager there is one group.
The connector serves two kinds of group:

* **full attention** (`FullAttentionSpec` and its MLA / sink variants): a running request keeps
  every block until it finishes, and a prefix hit of H tokens needs every block below H.
* **sliding window** (`SlidingWindowSpec`): vLLM frees the blocks that fall out of the window
  while the request runs (the null block, id 0, takes their place in the block table). When a
  request starts with H computed tokens, vLLM skips the first `max(0, H - window + 1)` tokens
  (`SlidingWindowManager.get_num_skipped_tokens`) and allocates only the blocks from there to H:
  a prefix hit needs only those, about `cdiv(window - 1, block_size)` blocks
  (vLLM's `_contiguous_blocks_for_hit` rule for its own sliding-window prefix hits).

Every other group kind (Mamba state, chunked local attention, ...) is not served; see
`engine_support`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FULL = "full"
SLIDING = "sliding"

# Spec classes whose blocks live as long as the request (vLLM's FullAttentionManager without
# subclass tweaks). Matched by exact class name: a subclass may free blocks early (RSWASpec
# frees a middle gap), so anything new is unsupported until checked.
FULL_ATTENTION_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec", "SinkFullAttentionSpec"})
SLIDING_WINDOW_SPECS = frozenset({"SlidingWindowSpec"})
# State that is not paged attention KV: the pool's objects cannot hold it.
RECURRENT_STATE_SPECS = frozenset({"MambaSpec"})

NULL_BLOCK_ID = 0  # vLLM's BlockPool.null_block: the placeholder for a freed sliding-window block


@dataclasses.dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its layers and how long its blocks live."""

    index: int
    layer_names: tuple[str, ...]
    spec_names: tuple[str, ...]  # class names of its spec (of each member, for uniform-type groups)
    block_size: int
    kind: str | None  # FULL, SLIDING, or None: a kind the connector does not serve
    window: int = 0  # tokens (sliding-window groups)
    extra_retained_tokens: int = 0

    @property
    def sliding(self) -> bool:
        return self.kind == SLIDING

    def skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks vLLM leaves as null blocks for a request with `num_computed_tokens`."""
        if not self.sliding:
            return 0
        skipped_tokens = max(0, num_computed_tokens - self.window + 1 - self.extra_retained_tokens)
        return skipped_tokens // self.block_size

    def describe(self) -> str:
        """What makes the group's pages what they are (part of its pool namespace)."""
        window = f" window {self.window}+{self.extra_retained_tokens}" if self.sliding else ""
        return f"{len(self.layer_names)}x{'/'.join(self.spec_names)}{window} bs{self.block_size}"


def _spec_names(spec: Any) -> tuple[str, ...]:
    members = getattr(spec, "kv_cache_specs", None)
    if isinstance(members, dict) and members:
        return tuple(sorted({type(s).__name__ for s in members.values()}))
    return (type(spec).__name__,)


def _member(spec: Any) -> Any:
    members = getattr(spec, "kv_cache_specs", None)
    if isinstance(members, dict) and members:
        return next(iter(members.values()))
    return spec


def kv_groups(kv_cache_config: Any) -> list[KVGroup]:
    """The groups of vLLM's `KVCacheConfig` (empty when it is None)."""
    groups = []
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        spec = group.kv_cache_spec
        names = _spec_names(spec)
        if all(n in FULL_ATTENTION_SPECS for n in names):
            kind: str | None = FULL
        elif len(names) == 1 and names[0] in SLIDING_WINDOW_SPECS:
            kind = SLIDING
        else:
            kind = None
        member = _member(spec)
        groups.append(
            KVGroup(
                index=index,
                layer_names=tuple(group.layer_names),
                spec_names=names,
                block_size=int(spec.block_size),
                kind=kind,
                window=int(getattr(member, "sliding_window", 0) or 0) if kind == SLIDING else 0,
                extra_retained_tokens=int(getattr(member, "extra_retained_tokens", 0) or 0) if kind == SLIDING else 0,
            )
        )
    return groups


def announced_group(groups: list[KVGroup]) -> int:
    """The group whose objects the pool's events announce (the first full-attention group)."""
    for g in groups:
        if g.kind == FULL:
            return g.index
    return 0
