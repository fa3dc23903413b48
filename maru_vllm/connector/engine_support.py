"""What MaruKVConnector may do on an engine, decided once from vLLM's own configuration.

A pool load hands vLLM KV blocks that this engine did not compute in this request, and the
forward then computes the rest of the prompt over them. That is only as exact as a local
prefix-cache hit when vLLM itself would serve such a hit. Two outcomes:

* **Serve** (load and store as the role allows) when every KV cache group is full attention
  (MLA included) or sliding-window attention with one block size (`kv_groups.py`), and vLLM
  computes over cached prefixes on this engine. One full-attention group is served chunk by
  chunk with synchronous loads; several groups, or a sliding-window group, are served group by
  group (`grouped`: each group's objects in a namespace of their own, sliding-window groups only
  the blocks a prefix hit needs, loads asynchronous so that a failed one is recomputed whole).
* **Stand aside** (neither load nor store; one warning at start-up, the engine serves plainly):
  - vLLM runs the engine with both prefix caching and chunked prefill off. It forces that where
    the attention backend cannot compute a prompt over KV already in the cache (MLA on CPU,
    `vllm/platforms/cpu.py`); a pool load would be exactly that computation, so loading could
    change the output. Nothing is stored either: no engine of this namespace would load it, and
    the router must not be told of prefixes nobody can use.
  - a group holds per-request state that is not paged attention KV (Mamba / linear-attention
    state of hybrid SSM models), or attention whose blocks the connector does not know how long
    vLLM keeps (chunked local attention, and any spec class not checked here);
  - the groups' block sizes differ (vLLM aligns prefix hits to all of them; the pool's chunks
    are one block size);
  - the KV cache holds a speculative drafter's layers beside the target model's (draft-model,
    EAGLE, MTP and other methods that run a drafter with a KV cache of its own: the layers in
    the `KVCacheConfig` beyond the target's attention layers). Loading them would mean objects
    holding the drafter's KV beside the target's, and an EAGLE-family drafter's KV at a block's
    last token depends on the token after it (vLLM drops the last block of such a prefix hit),
    which a chunk's key does not cover. Methods without draft layers (n-gram, suffix
    decoding) leave the KV cache the target's alone and are served as without them.

The decision reads vLLM's effective configuration (after the platform adjusted it), never a
model name, so it covers every model and platform that ends up in the same state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maru_vllm.connector.kv_groups import FULL, RECURRENT_STATE_SPECS, kv_groups


@dataclasses.dataclass(frozen=True)
class EngineSupport:
    """What the connector does on this engine; `reason` says why it stands aside (None: it serves)."""

    reason: str | None = None
    # Served group by group (several KV cache groups, or a sliding-window one).
    grouped: bool = False

    @property
    def serves(self) -> bool:
        return self.reason is None


def engine_support(vllm_config: Any, kv_cache_config: Any) -> EngineSupport:
    """Decide from the effective `VllmConfig` and `KVCacheConfig`.

    `kv_cache_config` may be None (vLLM builds some connectors before the KV cache exists): the
    group checks are then left to the side that has it.
    """
    groups = kv_groups(kv_cache_config)
    recurrent = sorted({n for g in groups for n in g.spec_names if n in RECURRENT_STATE_SPECS})
    if recurrent:
        return EngineSupport(
            f"this model keeps Mamba/linear-attention state ({', '.join(recurrent)}), which the pool does not "
            "hold (it holds paged attention KV only), so the Maru connector neither loads nor stores here"
        )
    cache = vllm_config.cache_config
    scheduler = vllm_config.scheduler_config
    if not cache.enable_prefix_caching and not getattr(scheduler, "enable_chunked_prefill", True):
        return EngineSupport(
            "vLLM runs this engine with prefix caching and chunked prefill off (it does so where the "
            "attention backend cannot compute over a cached prefix, e.g. MLA on CPU), so a pool load could "
            "change its output: the Maru connector neither loads nor stores here"
        )
    unknown = sorted({n for g in groups if g.kind is None for n in g.spec_names})
    if unknown:
        return EngineSupport(
            f"this model's KV cache has {'/'.join(unknown)} layers, whose blocks the Maru connector does not "
            "know how long vLLM keeps (it serves full-attention, MLA and sliding-window layers), so it "
            "neither loads nor stores here"
        )
    drafter = _draft_layers(vllm_config, groups)
    if drafter:
        method = vllm_config.speculative_config.method
        return EngineSupport(
            f"speculative decoding ({method}) keeps {drafter} drafter layer(s) in the KV cache beside the "
            "target model's, whose KV the pool's chunks do not hold, so the Maru connector neither loads "
            "nor stores here"
        )
    sizes = sorted({g.block_size for g in groups})
    if len(sizes) > 1:
        return EngineSupport(
            f"this model's KV cache groups have different block sizes ({', '.join(map(str, sizes))}); the "
            "Maru connector serves one block size, so it neither loads nor stores here"
        )
    return EngineSupport(grouped=not (len(groups) == 1 and groups[0].kind == FULL))


def _draft_layers(vllm_config: Any, groups: list[Any]) -> int:
    """How many of the KV cache's layers are a speculative drafter's (0 without one).

    vLLM says whether the method's drafter keeps KV (`uses_draft_kv_cache`); its layers are then
    the KV cache layers beyond the target model's attention layers on this pipeline stage.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not groups or not spec.uses_draft_kv_cache():
        return 0
    layers = {name for g in groups for name in g.layer_names}
    target = vllm_config.model_config.get_num_layers_by_block_type(vllm_config.parallel_config, "attention")
    return max(0, len(layers) - target)
