"""The offline fixture model: deterministic, loadable, chat-ready."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from maru_vllm.fixtures.models import SHAPES, SPECS, ensure_model


def digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path) -> None:
    a = ensure_model("tiny", seed=7, cache_dir=tmp_path / "a")
    b = ensure_model("tiny", seed=7, cache_dir=tmp_path / "b")
    c = ensure_model("tiny", seed=8, cache_dir=tmp_path / "a")
    assert digest(a) == digest(b)
    assert digest(a) != digest(c)
    # Cached: a second call returns the same directory without rebuilding.
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("tiny", seed=7, cache_dir=tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime


def test_tokenizer_is_byte_level_with_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tok("x" * 100)["input_ids"]) == 100
    text = "héllo, wörld"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert "chat_template" in json.loads((tiny_model / "tokenizer_config.json").read_text())
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<s><|user|>hi<|end|><|assistant|>"
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == len(tok)


def test_bench_spec_is_about_100m_parameters() -> None:
    s = SPECS["bench"]
    per_layer = 2 * s.hidden_size * s.hidden_size + 2 * s.hidden_size * s.num_kv_heads * s.head_dim
    per_layer += 3 * s.hidden_size * s.intermediate_size
    assert 80e6 < per_layer * s.num_layers < 130e6


def test_unknown_size_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown model size 'huge'; choose one of \['bench', 'deepseek-v2-mla', "):
        ensure_model("huge")


# What makes each shape fixture the shape it stands for, as vLLM reads it from config.json.
SHAPE_FACTS = {
    "tiny-fp16": ("LlamaForCausalLM", {"dtype": "float16"}),
    "tiny-fp32": ("LlamaForCausalLM", {"dtype": "float32"}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 64}),
    "qwen2-gqa": ("Qwen2ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 1}),
    "mistral-sw": ("MistralForCausalLM", {"sliding_window": 256}),
    "gemma3": (
        "Gemma3ForCausalLM",
        {"sliding_window": 256, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
    ),
    "gpt-oss": ("GptOssForCausalLM", {"num_local_experts": 4, "layer_types": ["sliding_attention", "full_attention"]}),
    "deepseek-v2-mla": (
        "DeepseekV2ForCausalLM",
        {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64},
    ),
    "jamba": ("JambaForCausalLM", {"attn_layer_period": 2, "attn_layer_offset": 1}),
}


def test_every_shape_fixture_builds_offline_as_its_architecture(tmp_path: Path) -> None:
    assert set(SHAPE_FACTS) == set(SHAPES)
    for name, (architecture, facts) in SHAPE_FACTS.items():
        config = json.loads((ensure_model(name, cache_dir=tmp_path) / "config.json").read_text())
        assert config["architectures"] == [architecture], name
        for key, value in facts.items():
            assert config[key] == value, (name, key)
        assert config["vocab_size"] == 512
