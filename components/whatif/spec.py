"""What a what-if replays: the cluster, the pool, the model's KV size and the four configurations.

One home for each fact the two simulators share (`dynamo_backend` and `pool_model`): the
configuration names, how a pool size in bytes becomes blocks, and the engine parameters.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

ROUND_ROBIN = "round-robin"
KV_GPU = "kv-gpu"
KV_HOST = "kv-host"
KV_POOL = "kv-pool"
CONFIGS: tuple[str, ...] = (ROUND_ROBIN, KV_GPU, KV_HOST, KV_POOL)
CONFIG_HELP = {
    ROUND_ROBIN: "round-robin routing, device prefix cache only",
    KV_GPU: "KV routing, device prefix cache only",
    KV_HOST: "KV routing plus a per-worker host tier; all of them together as large as the pool",
    KV_POOL: "KV routing plus one pool shared by every worker, credited at the host tier",
}

# Qwen2.5-32B: 64 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes.
DEFAULT_KV_BYTES_PER_TOKEN = 262_144
DEFAULT_BLOCK_SIZE = 64
DEFAULT_GPU_BLOCKS = 2_500
DEFAULT_POOL_BYTES = 10**12
# Per-worker link to the pool and the pool's aggregate bandwidth (GB/s): a CXL x16 link and a
# switch in front of the pool's memory.
DEFAULT_POOL_GBPS = 64.0
DEFAULT_POOL_AGGREGATE_GBPS = 256.0

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str) -> int:
    """Bytes from `1T`, `100G`, `512Gi`, `1e12`-free plain numbers; decimal units, `i` for binary."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(
            f"invalid size {text!r}: use bytes or a number with K, M, G, T, P (1024-based with Ki, Mi, ...)"
        )
    number, unit, binary = m.groups()
    base = 1024 if binary else 1000
    value = float(number) * base ** _POW[unit.lower()]
    if value < 1:
        raise ValueError(f"invalid size {text!r}: must be at least one byte")
    return int(value)


def parse_configs(text: str) -> tuple[str, ...]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise ValueError(f"--configs {text!r}: name at least one of {', '.join(CONFIGS)}")
    for name in names:
        if name not in CONFIGS:
            raise ValueError(f"unknown config {name!r}: use {', '.join(CONFIGS)}")
    return tuple(dict.fromkeys(names))


def parse_workers(text: str) -> tuple[int, ...]:
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1 or int(part) > 4096:
            raise ValueError(f"--workers {text!r}: {part!r} is not a worker count from 1 to 4096")
        out.append(int(part))
    if not out:
        raise ValueError(f"--workers {text!r}: give worker counts like 4,8,16")
    return tuple(dict.fromkeys(out))


def kv_bytes_per_token_of_model(model: str) -> int:
    """KV bytes per token of a Hugging Face model directory (or its config.json), bf16/fp16 unless stated."""
    p = Path(model)
    cfg_path = p / "config.json" if p.is_dir() else p
    try:
        cfg = json.loads(cfg_path.read_text())
    except OSError as exc:
        raise ValueError(
            f"--model {model}: cannot read {cfg_path} ({exc.strerror or exc}); "
            "give a local model directory or its config.json"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {model}: {cfg_path} is not JSON ({exc.msg})") from None
    cfg = cfg.get("text_config", cfg)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"--model {model}: {cfg_path} lacks {exc} (need num_hidden_layers, num_attention_heads, hidden_size)"
        ) from None
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    nbytes = 4 if "32" in dtype else 1 if "8" in dtype else 2
    return 2 * layers * kv_heads * head_dim * nbytes


MOCKER_STEP_TOKENS = 8192  # Dynamo mocker's default max_num_batched_tokens


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Everything about the simulated cluster except the worker count and the configuration."""

    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    block_size: int = DEFAULT_BLOCK_SIZE
    gpu_blocks: int = DEFAULT_GPU_BLOCKS
    pool_bytes: int = DEFAULT_POOL_BYTES
    pool_gbps: float = DEFAULT_POOL_GBPS
    pool_aggregate_gbps: float = DEFAULT_POOL_AGGREGATE_GBPS
    host_weight: float = 0.97
    trace_block_size: int = 512
    arrival_speedup: float = 1.0
    # Mocker time scale (Dynamo's `speedup_ratio`); decode keeps the mocker's own speed.
    prefill_speedup: float = 1.0
    # A measured engine's timing (`maru_vllm.fixtures.calibration.Calibration.prefill_points` /
    # `decode_points`), used by the pool model instead of the mocker's where given.
    engine_prefill_points: tuple[tuple[int, float], ...] | None = None
    engine_decode_points: tuple[tuple[int, float], ...] | None = None
    # Prompt tokens one engine step computes at most (vLLM's max_num_batched_tokens; Dynamo's
    # mocker's default 8192): the pool model's engines pack prefill chunks into steps of it.
    step_tokens: int = MOCKER_STEP_TOKENS

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "block_size", "gpu_blocks", "pool_bytes", "trace_block_size", "step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("pool_gbps", "pool_aggregate_gbps", "arrival_speedup", "prefill_speedup"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if self.trace_block_size % self.block_size:
            raise ValueError(
                f"--trace-block-size {self.trace_block_size} must be a multiple of --block-size {self.block_size}"
            )

    @property
    def pool_blocks(self) -> int:
        """Engine blocks the pool holds: its bytes over one block's KV bytes."""
        return max(1, self.pool_bytes // (self.kv_bytes_per_token * self.block_size))

    def host_blocks_per_worker(self, workers: int) -> int:
        """kv-host: the pool's capacity split evenly, one host tier per worker."""
        return max(1, self.pool_blocks // workers)

    def with_weight(self, weight: float) -> ClusterSpec:
        return dataclasses.replace(self, host_weight=weight)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One replay of one configuration at one worker count."""

    ttft_p50_ms: float
    ttft_p90_ms: float
    prefill_tokens: int  # prompt tokens the engines computed (not cached, not loaded)
    input_tokens: int
    output_tokens_per_s: float
