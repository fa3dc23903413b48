"""The mocker's timing, measured from Dynamo's own replay, for the pool model.

The pool model does not invent engine speeds: it replays a few probe requests through Dynamo's
offline replay with the same engine arguments (block size, KV bytes, ``speedup_ratio``) and
reads back the mocker's times:

* prefill: a cold prompt of n tokens, alone on one worker, for n up to one scheduler step
  (``max_num_batched_tokens``, 8192 in Dynamo's mocker); longer prompts are chunked into steps
  of that size, as the mocker's vLLM scheduler does;
* decode: the inter-token latency of a step that only decodes, as a function of the KV tokens of
  the batch (8 requests decoding together, holding 2% .. 85% of the worker's GPU KV cache: the
  mocker's decode step grows with the share of the cache in use and barely with the batch
  size, so the probe runs at the spec's own ``gpu_blocks``). The
  latest request to start decoding in each probe is read, so its decode runs without prefill
  steps in between.

Both are interpolated linearly between the probe points (and extrapolated past the last).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import tempfile
from functools import lru_cache
from pathlib import Path

from maru_dynamo.components.whatif.spec import MOCKER_STEP_TOKENS, ClusterSpec

STEP_TOKENS = MOCKER_STEP_TOKENS  # the mocker's prefill chunk
_PREFILL_POINTS = (64, 256, 512, 1024, 2048, 4096, STEP_TOKENS)
_DECODE_BATCH = 8
_DECODE_SHARES = (0.02, 0.1, 0.25, 0.5, 0.85)  # of the GPU KV cache, held by the decoding batch
_GAP_MS = 1_000_000  # probes far apart: each runs on an idle engine


def _interp(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    if x <= xs[0]:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    if x >= xs[-1]:
        return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1])
    i = bisect.bisect_left(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclasses.dataclass(frozen=True)
class MockerTiming:
    prefill_points: tuple[tuple[int, float], ...]  # (tokens, ms) of one cold prefill step
    decode_points: tuple[tuple[int, float], ...]  # (KV tokens of the decoding batch, ms per step)

    def prefill_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        xs = tuple(float(t) for t, _ in self.prefill_points)
        ys = tuple(ms for _, ms in self.prefill_points)
        full, rest = divmod(tokens, STEP_TOKENS)
        return full * ys[-1] + (_interp(xs, ys, rest) if rest else 0.0)

    def itl_ms(self, context_tokens: int) -> float:
        """One decode-only step of a batch holding `context_tokens` KV tokens."""
        xs = tuple(float(b) for b, _ in self.decode_points)
        ys = tuple(ms for _, ms in self.decode_points)
        return _interp(xs, ys, context_tokens) if context_tokens > xs[0] else ys[0]

    @property
    def prefill_tokens_per_s(self) -> float:
        tokens, ms = self.prefill_points[-1]
        return tokens / ms * 1000.0


def _decode_contexts(gpu_blocks: int, block_size: int, probe_block: int) -> list[int]:
    capacity = gpu_blocks * block_size
    return [
        max(probe_block, int(share * capacity / _DECODE_BATCH) // probe_block * probe_block) for share in _DECODE_SHARES
    ]


def _probe_trace(path: Path, block: int, contexts: list[int]) -> None:
    lines = []
    next_id = 0
    t = 0
    for n in _PREFILL_POINTS:
        nb = -(-n // block)
        lines.append(
            {"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": list(range(next_id, next_id + nb))}
        )
        next_id += nb
        t += _GAP_MS
    for context in contexts:
        nb = -(-context // block)
        for i in range(_DECODE_BATCH):
            # The others outlive the last one to start decoding: the batch stays whole while it is read.
            lines.append(
                {
                    "timestamp": t + i,
                    "input_length": context,
                    "output_length": 400 if i == _DECODE_BATCH - 1 else 1000,
                    "hash_ids": list(range(next_id, next_id + nb)),
                }
            )
            next_id += nb
        t += _GAP_MS
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


@lru_cache(maxsize=16)
def _measure(block_size: int, kv_bytes_per_token: int, prefill_speedup: float, gpu_blocks: int) -> MockerTiming:
    from maru_dynamo.components.whatif.dynamo_backend import quiet_dynamo_logs

    quiet_dynamo_logs()
    from dynamo.replay import run_trace_replay

    probe_block = max(block_size, 64)
    contexts = _decode_contexts(gpu_blocks, block_size, probe_block)
    engine: dict = {
        "num_gpu_blocks": gpu_blocks,
        "block_size": block_size,
        "enable_prefix_caching": True,
        "kv_cache_bytes_per_token": kv_bytes_per_token,
        "max_num_seqs": 256,
    }
    if prefill_speedup != 1.0:
        engine["speedup_ratio"] = prefill_speedup
        engine["decode_speedup_ratio"] = 1.0 / prefill_speedup
    with tempfile.TemporaryDirectory(prefix="maru-whatif-probe-") as tmp:
        path = Path(tmp) / "probe.jsonl"
        _probe_trace(path, probe_block, contexts)
        report = run_trace_replay(
            str(path),
            extra_engine_args={"engine": engine},
            num_workers=1,
            router_mode="round_robin",
            trace_block_size=probe_block,
            capture_per_request=True,
        )
    records = sorted(report.per_request or [], key=lambda r: (r["arrival_time_ms"], r["input_length"]))
    if len(records) < len(_PREFILL_POINTS) + len(contexts) * _DECODE_BATCH or any(
        r.get("ttft_ms") is None or (i >= len(_PREFILL_POINTS) and r.get("itl_ms") is None)
        for i, r in enumerate(records)
    ):
        raise ValueError(
            f"the mocker's timing probe did not complete with {gpu_blocks} GPU blocks of {block_size} tokens "
            f"(its probe prompts need up to {_PREFILL_POINTS[-1]} tokens); give more --gpu-blocks, or a "
            "calibration with the engine's own prefill and decode times"
        )
    prefill = tuple((n, float(rec["ttft_ms"])) for n, rec in zip(_PREFILL_POINTS, records[: len(_PREFILL_POINTS)]))
    decode = []
    rest = records[len(_PREFILL_POINTS) :]
    for context in contexts:
        group, rest = rest[:_DECODE_BATCH], rest[_DECODE_BATCH:]
        last = max(group, key=lambda r: float(r["first_token_ms"]))
        decode.append((context * _DECODE_BATCH, float(last["itl_ms"])))
    return MockerTiming(prefill, tuple(decode))


def mocker_timing(spec: ClusterSpec) -> MockerTiming:
    """The engine times of `spec`: a measured engine's where the calibration carried them, else the
    mocker's prefill and decode times for its engine (measured once per process)."""
    mocker: MockerTiming | None = None
    if spec.engine_prefill_points is None or spec.engine_decode_points is None:
        mocker = _measure(spec.block_size, spec.kv_bytes_per_token, float(spec.prefill_speedup), spec.gpu_blocks)
    return MockerTiming(
        spec.engine_prefill_points or mocker.prefill_points,  # type: ignore[union-attr]
        spec.engine_decode_points or mocker.decode_points,  # type: ignore[union-attr]
    )


def mocker_prefill_tokens_per_s(spec: ClusterSpec) -> float:
    """The mocker's cold prefill throughput at speedup 1 (what `--calibration` scales)."""
    return _measure(spec.block_size, spec.kv_bytes_per_token, 1.0, spec.gpu_blocks).prefill_tokens_per_s
