"""Offline random-weight models for tests, benchmarks and the demo.

Nothing may come from a model hub here, so we build checkpoints with a byte-level tokenizer and
a chat template ourselves, deterministically from a seed: Llama (`tiny`, `bench`, and dtype
variants) plus one tiny fixture per attention shape the connector is checked on (`SHAPES`:
qk-norm, grouped-query, sliding window, interleaved sliding/full, sinks + MoE, MLA, hybrid
Mamba), each from the transformers config class of its architecture. The same
(size, seed) always gives the same files, so greedy outputs are comparable across processes and
runs. Built models are cached (``MARU_MODEL_CACHE``, default ``~/.cache/maru-dynamo/models``)
and built at most once even when several processes ask at the same time.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Geometry of one fixture model.

    `architecture` names a transformers config/model class pair (`ARCHITECTURES`); `extra` holds
    the config arguments particular to it (sliding window, MLA ranks, experts, ...).
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    initializer_range: float = 0.2
    dtype: str = "bfloat16"
    architecture: str = "llama"
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def head_dim(self) -> int:
        return int(dict(self.extra).get("head_dim", self.hidden_size // self.num_heads))


# architecture -> (transformers config class, model class). Every one of them is served by vLLM.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "jamba": ("JambaConfig", "JambaForCausalLM"),
}


# `tiny`: starts and prefills in seconds (tests). `medium`: ~24M parameters, 8 KiB of KV per token;
# on one CPU core a 2k-token prompt prefills in ~0.35 s (a few per second) while a pool hit of it
# costs 1/5-1/20 of that - a GPU serving a 32B model from CXL has the same ratio - so replayed traffic
# shows what a deployment would (real_traffic.py, the demo). `bench`: ~100M parameters, so that prefill
# clearly dominates a KV load from the pool (data-path benchmarks; too slow to replay traffic).
SPECS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        "tiny",
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=256,
        max_position_embeddings=8192,
    ),
    "medium": ModelSpec(
        "medium",
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1408,
        max_position_embeddings=8192,
    ),
    "bench": ModelSpec(
        "bench",
        hidden_size=768,
        num_layers=16,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        max_position_embeddings=8192,
    ),
}


def _tiny(name: str, architecture: str, **extra: Any) -> ModelSpec:
    """A 2-layer fixture of `architecture`; `extra` may also override the common geometry."""
    common: dict[str, Any] = dict(
        hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=256, max_position_embeddings=8192
    )
    for field in list(common):
        if field in extra:
            common[field] = extra.pop(field)
    dtype = extra.pop("dtype", "bfloat16")
    return ModelSpec(name, **common, dtype=dtype, architecture=architecture, extra=tuple(sorted(extra.items())))


# One tiny fixture per attention shape (README "Supported models"): the connector's behaviour
# on each is what tests/e2e/test_model_matrix.py checks.
SHAPES: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _tiny("tiny-fp16", "llama", dtype="float16"),
        _tiny("tiny-fp32", "llama", dtype="float32"),
        _tiny("qwen3", "qwen3", head_dim=64),  # per-head RMSNorm of q and k
        _tiny("qwen2-gqa", "qwen2", num_heads=4, num_kv_heads=1),  # 4 query heads share 1 KV head
        # Every layer sliding-window, window shorter than a prompt of a few chunks.
        _tiny("mistral-sw", "mistral", sliding_window=256, head_dim=64),
        # Sliding and full layers interleaved (window shorter than the test prompts).
        _tiny(
            "gemma3",
            "gemma3",
            num_layers=4,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=256,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        ),
        # Attention sinks, sliding + full layers, mixture of experts.
        _tiny(
            "gpt-oss",
            "gpt_oss",
            head_dim=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=131072,  # 32 x its YaRN base of 4096, as the real model
        ),
        # Multi-head latent attention in DeepSeek-V2's shape (dense MLPs keep it tiny).
        _tiny(
            "deepseek-v2-mla",
            "deepseek_v2",
            num_heads=4,
            num_kv_heads=4,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            head_dim=64,
            first_k_dense_replace=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
        ),
        # Hybrid: a Mamba layer and an attention layer.
        _tiny(
            "jamba",
            "jamba",
            num_experts=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
        ),
    )
}
SPECS.update(SHAPES)

# Byte-level tokenizer: 256 byte tokens + specials; every byte of text is one token, which makes
# prompt lengths in tokens easy to control in tests ("x" * 1000 is 1000 tokens).
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB_SIZE = 512  # 256 bytes + specials, padded for friendly matmul shapes

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def default_cache_dir() -> Path:
    env = os.environ.get("MARU_MODEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "maru-dynamo" / "models"


def _fingerprint_fields(spec: ModelSpec) -> dict[str, Any]:
    """The spec as hashed into its directory name; fields at their defaults that older specs
    did not have are left out, so a Llama fixture keeps its directory (and cache) across them."""
    fields = dataclasses.asdict(spec)
    if fields["architecture"] == "llama":
        del fields["architecture"]
    if not fields["extra"]:
        del fields["extra"]
    return fields


def model_dir_name(spec: ModelSpec, seed: int) -> str:
    fingerprint = hashlib.sha256(
        json.dumps([FORMAT_VERSION, _fingerprint_fields(spec), seed], sort_keys=True).encode()
    ).hexdigest()[:12]
    return f"maru-{spec.name}-s{seed}-{fingerprint}"


def ensure_model(size: str = "tiny", seed: int = 0, cache_dir: Path | str | None = None) -> Path:
    """Return the directory of the fixture model `size`, building it on first use."""
    if size not in SPECS:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SPECS)}")
    spec = SPECS[size]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    target = root / model_dir_name(spec, seed)
    if (target / "config.json").is_file():
        return target
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():  # built by another process while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            _build(spec, seed, tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("built fixture model %s at %s", size, target)
    return target


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())  # the 256 printable stand-ins for raw bytes
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for special in SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    # Fill the rest of the model's vocabulary with plain added tokens so that every id a
    # random-weight model can emit decodes to visible text.
    tok.add_tokens([f"<r{i}>" for i in range(len(vocab), VOCAB_SIZE)])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "model_max_length": 8192,
        # Dynamo's frontend lists a model only when the template sits in tokenizer_config.json.
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2)
    )


def _build(spec: ModelSpec, seed: int, out: Path) -> None:
    import torch
    import transformers

    _build_tokenizer(out)
    bos, eos, pad = (256 + SPECIAL_TOKENS.index(t) for t in ("<s>", "</s>", "<pad>"))
    config_name, model_name = ARCHITECTURES[spec.architecture]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
        **{"head_dim": spec.head_dim, **dict(spec.extra)},
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = getattr(transformers, model_name)(config).to(getattr(torch, spec.dtype))
    finally:
        torch.random.set_rng_state(generator_state)
    model.config.dtype = spec.dtype
    model.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    (out / "maru_fixture.json").write_text(
        json.dumps({"format": FORMAT_VERSION, "seed": seed, **dataclasses.asdict(spec)}, indent=2)
    )
    logger.debug("fixture model %s: %d parameters", spec.name, sum(p.numel() for p in model.parameters()))
