"""Probes `real_traffic.py` sends to a fresh graph before its replay: what one request costs alone.

* `engine_timing_probe`: the engine's own times for the what-if's engines: a cold prompt alone at
  several lengths (ms to its first token; `prefill_tokens_per_s` reads the prefill speed off
  them) and a decode-only step alone and in a batch of 8.
* `recompute_to_load_probe`: the testbed's *recompute-to-load ratio*: how long a cold prefill of a
  prompt of the traffic's median length takes against a pool hit of the same prompt on the other
  worker, each as one 1-token completion through the frontend (min of `rounds`). On a GPU serving a
  32B model from CXL this ratio is ~8.6x; a testbed whose ratio is near 1 cannot show what the pool
  saves.

Both send fresh random prompts (never part of the traffic) and run before the replay's counters are
read, so they change none of its figures.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import random
import time
from collections.abc import Sequence
from typing import Any

from harness import alternated
from maru_dynamo.graphs import client

PROBE_LONG = 1536  # the prompt prefill_tokens_per_s reads against the shortest


def _complete(url: str, body: dict[str, Any], timeout: float = 300) -> tuple[float, dict[str, Any]]:
    """(seconds, response) of one non-streamed completion of `body` (its model, prompt and fields)."""
    rest = {k: v for k, v in body.items() if k not in ("model", "prompt", "max_tokens")}
    return client.timed_completion(url, body["model"], body["prompt"], body.get("max_tokens", 1), timeout, **rest)


def _letters(rng: random.Random, n: int) -> str:
    """`n` random letters: about one token each with the byte-level fixture tokenizers."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def _usage(out: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) as the server counted them."""
    return client.prompt_tokens(out), client.cached_tokens(out)


def prefill_tokens_per_s(points: Sequence[tuple[int, float]]) -> float:
    """Prefill tokens/s of a cold prompt alone, from `engine_timing_probe`'s prefill points: the
    difference in tokens of the shortest and the 1536-token prompt over the difference in their
    times, so the per-request costs both pay (HTTP, routing, one decode step) cancel.

    Summed per-request prefill times (vllm:request_prefill_time_seconds) are no substitute: requests
    that prefill together each count the shared time, which under load understates the speed."""
    by = dict(points)
    short, long = min(by), (PROBE_LONG if PROBE_LONG in by else max(by))
    dt = (by[long] - by[short]) / 1000
    return (long - short) / dt if dt > 0 and long > short else 0.0


TIMING_PREFILL_TOKENS = (16, 512, 1536, 3072, 4000)
DECODE_TOKENS = 33  # a decode probe's output: 32 steps after its first token
DECODE_BATCH = 8


def _stream(url: str, body: dict[str, Any], timeout: float = 300) -> list[float]:
    """Arrival times (seconds after sending) of a streamed completion's token events."""
    t0 = time.monotonic()
    return [at - t0 for at, event in client.stream_events(url, body, timeout) if event.get("choices")]


def _decode_step_ms(times: Sequence[float]) -> float:
    """The median gap between a stream's token events: one decode step each."""
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    return gaps[len(gaps) // 2] * 1000 if gaps else 0.0


def engine_timing_probe(url: str, model: str, max_tokens: int, rounds: int = 2) -> dict[str, list[tuple[int, float]]]:
    """The engine's times as the what-if's engines take them (`Calibration.prefill_points` and
    `decode_points`): ms to the first token of a fresh prompt of n tokens alone (min of `rounds`,
    n up to `max_tokens`), and ms per decode step of one request alone and of `DECODE_BATCH`
    requests decoding together, against the KV tokens the batch holds."""
    rng = random.Random(time.monotonic_ns())
    prefill: list[tuple[int, float]] = []
    for n in (t for t in TIMING_PREFILL_TOKENS if t <= max_tokens):
        best = min(
            _complete(url, {"model": model, "prompt": _letters(rng, n), "max_tokens": 1, "temperature": 0})[0]
            for _ in range(rounds)
        )
        prefill.append((n, round(best * 1000, 3)))
    decode: list[tuple[int, float]] = []
    body = {"max_tokens": DECODE_TOKENS, "temperature": 0, "ignore_eos": True, "model": model}
    alone = _decode_step_ms(_stream(url, {**body, "prompt": _letters(rng, 512)}))
    decode.append((512 + DECODE_TOKENS // 2, round(alone, 3)))
    with concurrent.futures.ThreadPoolExecutor(DECODE_BATCH) as ex:
        streams = list(ex.map(lambda _: _stream(url, {**body, "prompt": _letters(rng, 1024)}), range(DECODE_BATCH)))
    batch = sorted(_decode_step_ms(t) for t in streams)
    decode.append((DECODE_BATCH * (1024 + DECODE_TOKENS // 2), round(batch[len(batch) // 2], 3)))
    return {"prefill_points": prefill, "decode_points": decode}


@dataclasses.dataclass(frozen=True)
class RatioProbe:
    """A cold prefill and a pool hit of one prompt, each the min over the probe's rounds."""

    prompt_tokens: int
    cold_s: float
    pool_hit_s: float
    pool_hit_cached_tokens: int

    @property
    def recompute_to_load(self) -> float:
        return self.cold_s / self.pool_hit_s if self.pool_hit_s > 0 else 0.0

    def as_json(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cold_ms": round(self.cold_s * 1000, 2),
            "pool_hit_ms": round(self.pool_hit_s * 1000, 2),
            "pool_hit_cached_tokens": self.pool_hit_cached_tokens,
            "recompute_to_load": round(self.recompute_to_load, 2),
        }


def generate_instances(url: str) -> list[int]:
    """The instance ids of the workers serving `generate`, from the frontend's /health."""
    health = client.get_json(f"{url}/health", timeout=10)
    return sorted({int(i["instance_id"]) for i in health.get("instances", []) if i.get("endpoint") == "generate"})


def recompute_to_load_probe(
    url: str, model: str, tokens: int, *, chunk_tokens: int, rounds: int = 3, settle_s: float = 0.5
) -> RatioProbe | None:
    """Cold prefill of a fresh `tokens`-token prompt on one worker against the same prompt on another
    (which never saw it, so it loads the prompt's whole chunks from the pool), min of `rounds`.

    A round whose second request did not load every whole chunk (a store still behind, the pool
    full) is not a pool hit and is sent again with a fresh prompt, at most `rounds` extra times.
    None when the graph has fewer than two workers or no round hit."""
    ids = generate_instances(url)
    if len(ids) < 2 or tokens < chunk_tokens:
        return None
    rng = random.Random(time.monotonic_ns())
    want = (tokens - 1) // chunk_tokens * chunk_tokens  # the last token is always computed
    cold, hit, cached_seen = math.inf, math.inf, 0
    hits = tries = 0
    while hits < rounds and tries < 2 * rounds:
        tries += 1
        a, b = alternated(ids[:2], tries - 1)
        body: dict[str, Any] = {"model": model, "prompt": _letters(rng, tokens), "max_tokens": 1, "temperature": 0}
        t_cold, _ = _complete(url, {**body, "nvext": {"backend_instance_id": a}})
        time.sleep(settle_s)  # the store is write-behind: let it commit
        t_hit, out = _complete(url, {**body, "nvext": {"backend_instance_id": b}})
        cached = _usage(out)[1]
        cold = min(cold, t_cold)
        if cached >= want:
            hits += 1
            hit = min(hit, t_hit)
            cached_seen = cached
    if not hits:
        return None
    return RatioProbe(tokens, cold, hit, cached_seen)
