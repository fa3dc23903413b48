"""What MaruKVConnector may do on an engine, decided once from vLLM's own configuration.

A pool load hands vLLM KV blocks that this engine did not compute in this request, and the
forward then computes the rest of the prompt over them. That is only as exact as a local
prefix-cache hit when vLLM itself would serve such a hit. Three outcomes:

* **Serve** (load and store as the role allows): the KV cache is one group of attention layers
  whose blocks live as long as the request (full attention, MLA), and vLLM computes over cached
  prefixes on this engine.
* **Stand aside** (neither load nor store; one warning at start-up, the engine serves plainly):
  - vLLM runs the engine with both prefix caching and chunked prefill off. It forces that where
    the attention backend cannot compute a prompt over KV already in the cache (MLA on CPU,
    `vllm/platforms/cpu.py`); a pool load would be exactly that computation, so loading could
    change the output. Nothing is stored either: no engine of this namespace would load it, and
    the router must not be told of prefixes nobody can use.
  - the layers of the one KV group drop blocks while a request runs (sliding-window or chunked
    local attention in every layer, so vLLM keeps them as such even without its hybrid manager):
    blocks outside the window are freed mid-request and replaced by the null block, so a
    write-behind store could read a recycled block and a load would write into the null block.
* **Refuse** (`UnsupportedModel`, raised while the connector is built: the engine does not
  start, with one line naming the model's state and what is supported): per-request state that
  is not paged attention KV (Mamba / linear-attention state), or several KV cache groups. Such a
  model cannot run with this connector at all: vLLM turns its hybrid KV cache manager off for a
  connector that does not declare `SupportsHMA`, which hybrid SSM models need.

The decision reads vLLM's effective configuration (after the platform adjusted it), never a
model name, so it covers every model and platform that ends up in the same state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# KV cache spec classes whose manager keeps every block of a running request (vLLM's
# FullAttentionManager without subclass tweaks). Matched by exact class name: a subclass may
# free blocks early (RSWASpec frees a middle gap), so anything new is unsupported until checked.
BLOCKS_LIVE_FOR_THE_REQUEST = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
# State that is not paged attention KV: the pool's objects cannot hold it.
RECURRENT_STATE = frozenset({"MambaSpec"})


class UnsupportedModel(ValueError):
    """The model's KV cache cannot be served by the connector; the message is one line for the user."""


@dataclasses.dataclass(frozen=True)
class EngineSupport:
    """What the connector does on this engine; `reason` says why it stands aside (None: it serves)."""

    reason: str | None = None

    @property
    def serves(self) -> bool:
        return self.reason is None


def _spec_names(spec: Any) -> list[str]:
    """Class names of a group's spec, or of each member spec of a UniformTypeKVCacheSpecs."""
    members = getattr(spec, "kv_cache_specs", None)
    if isinstance(members, dict) and members:
        return sorted({type(s).__name__ for s in members.values()})
    return [type(spec).__name__]


def engine_support(vllm_config: Any, kv_cache_config: Any) -> EngineSupport:
    """Decide from the effective `VllmConfig` and `KVCacheConfig`; raises `UnsupportedModel`.

    `kv_cache_config` may be None (vLLM builds some connectors before the KV cache exists): the
    group checks are then left to the side that has it.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    kinds = [_spec_names(g.kv_cache_spec) for g in groups]
    recurrent = sorted({k for names in kinds for k in names if k in RECURRENT_STATE})
    if recurrent:
        raise UnsupportedModel(
            f"MaruKVConnector does not support models with Mamba/linear-attention state ({', '.join(recurrent)}): "
            "the pool holds paged attention KV only; serve this model without --kv-transfer-config"
        )
    if len(groups) > 1:
        described = "; ".join(f"{len(g.layer_names)} layers {'/'.join(k)}" for g, k in zip(groups, kinds))
        raise UnsupportedModel(
            f"MaruKVConnector does not support {len(groups)} KV cache groups ({described}): it serves one group "
            "of full-attention or MLA layers; run with --disable-hybrid-kv-cache-manager"
        )
    cache = vllm_config.cache_config
    scheduler = vllm_config.scheduler_config
    if not cache.enable_prefix_caching and not getattr(scheduler, "enable_chunked_prefill", True):
        return EngineSupport(
            "vLLM runs this engine with prefix caching and chunked prefill off (it does so where the "
            "attention backend cannot compute over a cached prefix, e.g. MLA on CPU), so a pool load could "
            "change its output: the Maru connector neither loads nor stores here"
        )
    for names in kinds:
        dropping = [n for n in names if n not in BLOCKS_LIVE_FOR_THE_REQUEST]
        if dropping:
            return EngineSupport(
                f"this model's KV cache layers are {'/'.join(dropping)} (sliding-window or local attention in "
                "every layer): vLLM frees their blocks outside the window while a request runs, which the Maru "
                "connector does not support, so it neither loads nor stores here"
            )
    return EngineSupport()
