"""Offline random-weight Llama models for tests, benchmarks and the demo.

Nothing may come from a model hub here, so we build a Llama-architecture checkpoint with a
byte-level tokenizer and a chat template ourselves, deterministically from a seed. The same
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

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Geometry of one fixture model (Llama architecture)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    initializer_range: float = 0.2
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# `tiny`: starts and prefills in seconds (tests). `bench`: ~100M parameters, so that prefill
# clearly dominates a KV load from the pool (benchmarks).
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


def model_dir_name(spec: ModelSpec, seed: int) -> str:
    fingerprint = hashlib.sha256(
        json.dumps([FORMAT_VERSION, dataclasses.asdict(spec), seed], sort_keys=True).encode()
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
    from transformers import LlamaConfig, LlamaForCausalLM

    _build_tokenizer(out)
    bos, eos, pad = (256 + SPECIAL_TOKENS.index(t) for t in ("<s>", "</s>", "<pad>"))
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
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
