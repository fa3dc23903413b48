"""Which engines the connector serves, and how, or stands aside on (engine_support.py).

The MLA cases use vLLM's real configuration: a `VllmConfig` of the DeepSeek-V2-shaped fixture
built on this (CPU) platform is the one vLLM adjusts for its CPU MLA backend, and the GPU case
is the configuration shape vLLM leaves a GPU MLA engine with (prefix caching and chunked prefill
on, one MLAAttentionSpec group).
"""

from __future__ import annotations

import types

import pytest
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from maru_vllm.connector.engine_support import engine_support
from maru_vllm.connector.namespace import identity_from_vllm
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch.stack import PoolProcess
from tests.connector.sched_harness import make_request, make_scheduler, tokens

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def kv_config(*group_specs: object) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"{name}.g{i}" for name in LAYERS], spec) for i, spec in enumerate(group_specs)]
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=groups)


def engine(prefix_caching: bool = True, chunked_prefill: bool = True) -> types.SimpleNamespace:
    """The two VllmConfig facts the decision reads about the engine."""
    return types.SimpleNamespace(
        cache_config=types.SimpleNamespace(enable_prefix_caching=prefix_caching),
        scheduler_config=types.SimpleNamespace(enable_chunked_prefill=chunked_prefill),
    )


FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
# DeepSeek-V2's latent cache: one "head" of kv_lora_rank + qk_rope_head_dim = 576.
MLA = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
SLIDING = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=256)
MAMBA = MambaSpec(block_size=16, shapes=((4, 256), (4, 64, 16)), dtypes=(torch.bfloat16, torch.float32))


def test_gpu_mla_configuration_is_served_and_keeps_its_namespace_kind() -> None:
    assert engine_support(engine(), kv_config(MLA)).serves
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model="deepseek-v2", revision=None, dtype="bfloat16"),
        cache_config=types.SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    identity = identity_from_vllm(cfg, kv_config(MLA), "")
    assert identity.attention.startswith("MLAAttentionSpec")  # its own namespace family
    assert (identity.num_kv_heads, identity.head_size) == (1, 576)


def mla_engine_config(pool_address: str, backend: str | None) -> VllmConfig:
    """The VllmConfig vLLM builds for the DeepSeek-V2-shaped fixture on this (CPU) platform."""
    from vllm.config import AttentionConfig, CacheConfig, KVTransferConfig, ModelConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model = ModelConfig(model=str(ensure_model("deepseek-v2-mla")), max_model_len=2048, dtype="bfloat16", seed=0)
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(enable_prefix_caching=True),
        attention_config=AttentionConfig(backend=AttentionBackendEnum[backend] if backend else None),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MaruKVConnector",
            kv_connector_module_path="maru_vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"maru_pool_address": pool_address, "maru_pool_timeout_s": 2.0},
        ),
    )


def test_cpu_mla_reference_backend_as_vllm_configures_it_stands_aside(pool: PoolProcess) -> None:
    """vLLM's CPU platform turns prefix caching and chunked prefill off for its reference MLA
    backend (every CPU without AMX); the connector then neither loads nor stores."""
    from maru_vllm.connector import MaruKVConnector

    vllm_config = mla_engine_config(pool.address, "CPU_MLA")
    assert vllm_config.model_config.use_mla
    assert not vllm_config.cache_config.enable_prefix_caching  # what vLLM's CPU platform decided
    assert not vllm_config.scheduler_config.enable_chunked_prefill
    support = engine_support(vllm_config, kv_config(MLA))
    assert not support.serves and "prefix caching and chunked prefill off" in (support.reason or "")
    connector = MaruKVConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_config(MLA))
    try:
        assert not connector.can_load and not connector.can_store
        request = make_request("r", tokens(1, 3 * 256 + 1))
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    finally:
        connector.shutdown()


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM's AMX MLA backend needs AMX tiles")
def test_cpu_mla_amx_backend_keeps_prefix_caching_and_is_served(pool: PoolProcess) -> None:
    vllm_config = mla_engine_config(pool.address, None)
    assert vllm_config.cache_config.enable_prefix_caching
    assert engine_support(vllm_config, kv_config(MLA)).serves


def test_llama_on_this_platform_is_served(pool: PoolProcess) -> None:
    sched = make_scheduler(ensure_model("tiny"), pool.address)
    assert engine_support(sched.vllm_config, kv_config(FULL)).serves
    assert sched.connector is not None and sched.connector.can_load and sched.connector.can_store


def test_prefix_caching_off_alone_still_loads() -> None:
    """Chunked prefill on: the backend computes over KV of earlier steps, as over a pool load."""
    assert engine_support(engine(prefix_caching=False), kv_config(FULL)).serves
    assert not engine_support(engine(prefix_caching=False, chunked_prefill=False), kv_config(FULL)).serves


def test_sliding_window_layers_are_served_group_by_group() -> None:
    """vLLM frees their blocks outside the window mid-request: served with per-group objects,
    window-only loads and flushes (scheduler_groups.py), alone or beside full attention."""
    for specs in ((SLIDING,), (SLIDING, FULL), (FULL, SLIDING, SLIDING)):
        support = engine_support(engine(), kv_config(*specs))
        assert support.serves and support.grouped, specs
    assert not engine_support(engine(), kv_config(FULL)).grouped  # one full group: chunk by chunk


def test_uniform_type_group_is_judged_by_its_members() -> None:
    full_128 = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": FULL, "b": full_128})
    support = engine_support(engine(), kv_config(uniform))
    assert support.serves and not support.grouped
    mixed = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": SLIDING, "b": FULL})
    assert not engine_support(engine(), kv_config(mixed)).serves


FULL_32 = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("specs", "says"),
    [
        ((FULL, MAMBA), "keeps Mamba/linear-attention state (MambaSpec)"),
        ((FULL, FULL_32), "different block sizes (16, 32)"),
    ],
)
def test_state_the_pool_cannot_hold_stands_aside_in_one_line(specs: tuple, says: str) -> None:
    support = engine_support(engine(), kv_config(*specs))
    assert not support.serves
    assert says in (support.reason or "") and "\n" not in (support.reason or "")


def speculative_engine_config(speculative: dict) -> VllmConfig:
    """The VllmConfig vLLM builds for the `tiny` fixture decoding with `speculative`."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig

    target = ModelConfig(model=str(ensure_model("tiny")), max_model_len=2048, dtype="bfloat16", seed=0)
    spec = SpeculativeConfig(target_model_config=target, target_parallel_config=ParallelConfig(), **speculative)
    return VllmConfig(
        model_config=target, cache_config=CacheConfig(enable_prefix_caching=True), speculative_config=spec
    )


TARGET_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def one_group(layers: list[str]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, FULL)])


@pytest.mark.parametrize(
    ("method", "drafter_layers"),
    [
        # vLLM's draft model runs under the `draft_model.` prefix
        ("draft_model", [f"draft_model.{name}" for name in TARGET_LAYERS]),
        # an EAGLE head's layers are numbered on from the target's
        ("eagle", [f"model.layers.{i}.self_attn.attn" for i in (2, 3)]),
    ],
)
def test_drafter_layers_in_the_kv_cache_stand_aside(method: str, drafter_layers: list[str]) -> None:
    """A drafter's layers of the target's geometry join its KV cache group: the connector stands
    aside and says how many (the `tiny` fixture of another seed is the drafter)."""
    drafted = speculative_engine_config(
        {"method": method, "model": str(ensure_model("tiny", seed=1)), "num_speculative_tokens": 3}
    )
    support = engine_support(drafted, one_group(TARGET_LAYERS + drafter_layers))
    assert not support.serves
    assert f"speculative decoding ({method}) keeps 2 drafter layer(s)" in (support.reason or "")


def test_ngram_proposer_keeps_no_kv_and_is_served_as_without_it() -> None:
    ngram = speculative_engine_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert engine_support(ngram, one_group(TARGET_LAYERS)) == engine_support(engine(), one_group(TARGET_LAYERS))
    assert engine_support(ngram, one_group(TARGET_LAYERS)).serves
