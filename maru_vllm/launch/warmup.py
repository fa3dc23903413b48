"""Ready means warm: a `dynamo.vllm` worker serves a few requests itself before it registers.

A vLLM engine reports itself up before every code path a request takes has run once. On vLLM
CPU the costly one is the sampler: `compiled_random_sample` (`vllm/v1/sample/ops/
topk_topp_sampler.py`) is `torch.compile`d lazily, on the first step that samples a request with
temperature > 0 and no seed (4-5 s on one core), and compiled again the first time such a step
holds more than one request (torch specialises a dimension of size 1), a few hundred ms more.
Greedy requests (Dynamo's own health-check payload is one) never reach it. Without a warm-up,
the first user of each worker pays that.

`warm_up_before_registration` is what the Maru worker runs on its engine right before Dynamo's
`register_vllm_model` (its hook into `dynamo.vllm`, on the Dynamo side), which is what
publishes the model card and endpoint in Dynamo's discovery: the frontend lists a worker (and
so `maru-dynamo graph run` reports ready) and Dynamo's system status server reports its
endpoint healthy only after the warm-up. The warm-up is rounds of the same short requests,
straight into the engine (never through the pool, the router or the frontend):

  one request with temperature 1          (the sampler compiled for a batch of one)
  N requests at once, temperature 1       (compiled again for a batch of several)
  N at once: greedy, top-k/top-p, logprobs (the other sampler paths, first use of each)

repeated until a round takes no longer than `settle_ratio` times the round before (at least two
rounds, at most `max_rounds`): the last round was served at warm speed. The prompts are random
token ids shorter than one pool chunk, so nothing is stored in the pool; their few blocks stay in
the engine's prefix cache as ordinary evictable blocks (matching no real prompt). The prefix
cache is deliberately not reset: that would send the KV router an all-blocks-cleared event for
the worker, which also drops the pool blocks the event relay has just announced for it. A
warm-up that fails is logged and the worker registers anyway (serving cold beats not serving).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from typing import Any

from maru_vllm.pool.chunk_codec import DEFAULT_CHUNK_TOKENS

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WarmupRequest:
    prompt_tokens: int
    max_tokens: int
    sampling: dict[str, Any]  # SamplingParams keywords besides max_tokens


@dataclasses.dataclass(frozen=True)
class WarmupPhase:
    name: str
    requests: tuple[WarmupRequest, ...]  # sent at once


@dataclasses.dataclass(frozen=True)
class WarmupOptions:
    max_prompt_tokens: int = DEFAULT_CHUNK_TOKENS - 1  # below one pool chunk: nothing is stored
    concurrency: int = 4
    max_rounds: int = 4
    settle_ratio: float = 1.5
    timeout_s: float = 300.0


@dataclasses.dataclass
class WarmupReport:
    rounds: list[dict[str, float]] = dataclasses.field(default_factory=list)  # phase -> seconds, per round
    total_s: float = 0.0
    settled: bool = False

    def summary(self) -> str:
        def fmt(r: dict[str, float]) -> str:
            return ", ".join(f"{name} {1000 * s:.0f} ms" for name, s in r.items())

        first = fmt(self.rounds[0]) if self.rounds else "-"
        last = fmt(self.rounds[-1]) if self.rounds else "-"
        state = "warm" if self.settled else f"not settled after {len(self.rounds)} rounds"
        return f"{len(self.rounds)} rounds in {self.total_s:.1f} s ({state}); first round: {first}; last round: {last}"


def warmup_phases(opts: WarmupOptions, max_model_len: int) -> tuple[WarmupPhase, ...]:
    """The requests of one round (see the module docstring); prompts fit `max_model_len`."""
    n = max(2, opts.concurrency)
    top = max(4, min(opts.max_prompt_tokens, max_model_len - 8))
    lengths = [max(4, min(top, round(top * (i + 1) / n))) for i in range(n)]
    random_sampling = {"temperature": 1.0}
    others: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.9},
        {"temperature": 0.0, "logprobs": 1},
        {"temperature": 0.7, "top_p": 0.95, "logprobs": 1},
    ]
    return (
        WarmupPhase("sample x1", (WarmupRequest(lengths[0], 2, random_sampling),)),
        WarmupPhase(f"sample x{n}", tuple(WarmupRequest(length, 4, random_sampling) for length in lengths)),
        WarmupPhase(
            f"mixed x{n}",
            tuple(WarmupRequest(length, 4, others[i % len(others)]) for i, length in enumerate(reversed(lengths))),
        ),
    )


async def _generate(engine_client: Any, request: WarmupRequest, vocab_size: int, rng: random.Random) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True, **request.sampling)
    prompt = {"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(request.prompt_tokens)]}
    async for _ in engine_client.generate(prompt, params, f"maru-warmup-{uuid.uuid4().hex}"):
        pass


async def warm_up_engine(
    engine_client: Any, vocab_size: int, max_model_len: int, opts: WarmupOptions | None = None
) -> WarmupReport:
    """Run warm-up rounds on `engine_client` (a vLLM AsyncLLM) until one is served at warm speed.

    Raises what the engine raises (and TimeoutError past `opts.timeout_s`); the caller decides.
    """
    opts = opts or WarmupOptions()
    phases = warmup_phases(opts, max_model_len)
    rng = random.Random(0x6D617275)
    report = WarmupReport()
    t0 = time.perf_counter()

    async def rounds() -> None:
        previous: float | None = None
        for _ in range(opts.max_rounds):
            times: dict[str, float] = {}
            for phase in phases:
                ts = time.perf_counter()
                await asyncio.gather(*(_generate(engine_client, r, vocab_size, rng) for r in phase.requests))
                times[phase.name] = time.perf_counter() - ts
            report.rounds.append(times)
            took = sum(times.values())
            if previous is not None and took <= opts.settle_ratio * previous:
                report.settled = True
                return
            previous = took

    await asyncio.wait_for(rounds(), opts.timeout_s)
    report.total_s = time.perf_counter() - t0
    return report


async def warm_up_before_registration(engine_client: Any, vllm_config: Any, opts: WarmupOptions) -> None:
    """The warm-up a worker runs right before it registers: logged, and never raising (a warm-up
    that fails leaves the worker to register cold)."""
    runner = getattr(vllm_config.model_config, "runner_type", "generate")
    if runner != "generate":  # embedding / classification engines never sample
        logger.info("maru_worker: no warm-up for a %s engine", runner)
        return
    logger.info("maru_worker: warming up the engine before registering (ready means warm)")
    try:
        model_config = vllm_config.model_config
        report = await warm_up_engine(
            engine_client, int(model_config.get_vocab_size()), int(model_config.max_model_len), opts
        )
    except Exception as exc:  # the worker must still serve: cold is better than not at all
        logger.warning("maru_worker: warm-up failed (%s: %s); registering cold", type(exc).__name__, exc)
        return
    logger.info("maru_worker: warm-up done: %s", report.summary())
