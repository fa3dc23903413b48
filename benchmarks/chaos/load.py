"""The soak's load: bounded, streaming completions whose complete length is known in advance.

Every request asks for exactly `max_tokens` tokens with ``ignore_eos`` (greedy), streams them
(SSE, with a final usage chunk) and is judged by what arrived:

* completed - HTTP 200, the stream ended with ``[DONE]``, finish_reason ``length`` and
  `max_tokens` completion tokens;
* truncated - HTTP 200 but fewer tokens, no ``[DONE]``, an error event, a cut connection or a
  read timeout in the middle of the stream (a response shorter than asked);
* failed - no 200: an error status, or no answer at all within the request timeout.

A request whose connection is refused (nothing listens: the frontend is restarting) reached
nothing; with `retry_refused_s` it is sent again after 0.1 s for up to that long, and
`LoadGenerator.refused` counts those retries.

Prompts come from a seeded working set: each request is one of `prefixes` shared prefixes
followed by a few tokens of its own, so prefixes repeat (pool and prefix-cache hits) while no
two requests are identical. The generator is closed-loop (`concurrency` requests in flight) and
bounded: it sends no new request once `max_requests` were sent, nor after `duration_s` - or,
while its `keep_going()` says so (faults still being injected or recovering), after
`max_duration_s` at the latest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from maru_dynamo.graphs import client as graph_client
from maru_dynamo.graphs.client import DONE, aiter_events

COMPLETED, TRUNCATED, FAILED = "completed", "truncated", "failed"
FIRST_TOKEN_ID, LAST_TOKEN_ID = 32, 126  # printable bytes: one token each in the fixture models


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    url: str
    model: str
    concurrency: int = 3
    duration_s: float = 150.0
    max_duration_s: float = 480.0
    max_requests: int = 100_000
    max_tokens: int = 32
    prefix_tokens: int = 768
    suffix_tokens: int = 8
    prefixes: int = 40
    request_timeout_s: float = 120.0
    seed: int = 0
    retry_refused_s: float = 0.0


@dataclasses.dataclass
class RequestResult:
    index: int
    start: float  # time.monotonic()
    end: float
    outcome: str
    status: int | None
    tokens: int
    finish_reason: str | None
    error: str | None = None
    first_token_s: float | None = None
    max_gap_s: float = 0.0  # the longest wait between two chunks of the stream (a stall)
    refused: bool = False  # the connection was refused: the request reached nothing
    last_token_s: float | None = None  # since start, like first_token_s

    @property
    def itl_s(self) -> float | None:
        """Mean time between tokens after the first (None for fewer than two)."""
        if self.first_token_s is None or self.last_token_s is None or self.tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.tokens - 1)


def token_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randint(FIRST_TOKEN_ID, LAST_TOKEN_ID) for _ in range(length)]


class Prompts:
    """The working set: `prefixes` shared prefixes; request i gets one of them plus its own tail."""

    def __init__(self, cfg: LoadConfig) -> None:
        rng = random.Random(cfg.seed)
        self.prefixes = [token_ids(rng, cfg.prefix_tokens) for _ in range(cfg.prefixes)]
        self.cfg = cfg

    def prompt(self, index: int) -> list[int]:
        rng = random.Random(f"{self.cfg.seed}:{index}")
        return self.prefixes[rng.randrange(len(self.prefixes))] + token_ids(rng, self.cfg.suffix_tokens)


def judge(status: int | None, tokens: int, finish: str | None, done: bool, error: str | None, want: int) -> str:
    """The outcome of one request (module docstring)."""
    if status != 200:
        return FAILED
    if error is None and done and finish == "length" and tokens == want:
        return COMPLETED
    return TRUNCATED


async def stream_completion(
    client: httpx.AsyncClient, cfg: LoadConfig, index: int, prompt: list[int], extra: dict[str, Any] | None = None
) -> RequestResult:
    """Send one streaming completion and judge it; never raises for what the server does."""
    body = {
        "model": cfg.model,
        "prompt": prompt,
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    start = time.monotonic()
    status: int | None = None
    chunks = 0
    usage_tokens: int | None = None
    finish: str | None = None
    done = False
    error: str | None = None
    first: float | None = None
    last: float | None = None
    max_gap = 0.0
    refused = False
    try:
        async with graph_client.stream_completion(client, cfg.url, body) as resp:
            status = resp.status_code
            if status != 200:
                error = (await resp.aread()).decode(errors="replace")[:200]
            else:
                async for event in aiter_events(resp):
                    if event is DONE:
                        done = True
                        continue
                    if "error" in event:
                        error = str(event["error"])[:200]
                        continue
                    for choice in event.get("choices") or []:
                        if choice.get("text"):
                            chunks += 1
                            now = time.monotonic()
                            first = first if first is not None else now - start
                            max_gap = max(max_gap, now - last) if last is not None else max_gap
                            last = now
                        if choice.get("finish_reason"):
                            finish = choice["finish_reason"]
                    if event.get("usage"):
                        usage_tokens = int(event["usage"].get("completion_tokens") or 0)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
        refused = isinstance(exc, httpx.ConnectError) and status is None
    tokens = usage_tokens if usage_tokens is not None else chunks
    return RequestResult(
        index,
        start,
        time.monotonic(),
        judge(status, tokens, finish, done, error, cfg.max_tokens),
        status,
        tokens,
        finish,
        error,
        first,
        max_gap,
        refused,
        None if last is None else last - start,
    )


class LoadGenerator:
    """Closed-loop load; `results` fills in as requests finish, `stop()` ends it early;
    `on_progress` gets a one-line summary every `progress_s` seconds."""

    def __init__(
        self,
        cfg: LoadConfig,
        on_progress: Callable[[str], None] | None = None,
        progress_s: float = 15.0,
        keep_going: Callable[[], bool] = lambda: False,
    ) -> None:
        self.cfg = cfg
        self._keep_going = keep_going
        self.progress_s = progress_s
        self._on_progress = on_progress
        self.prompts = Prompts(cfg)
        self.results: list[RequestResult] = []
        self.sent = 0
        self.refused = 0  # connections refused and sent again (retry_refused_s)
        self.started = 0.0
        self._stopping = False

    def stop(self) -> None:
        self._stopping = True

    async def run(self) -> list[RequestResult]:
        cfg = self.cfg
        self.started = time.monotonic()
        deadline = self.started + cfg.duration_s
        hard_deadline = self.started + max(cfg.duration_s, cfg.max_duration_s)

        def more() -> bool:
            now = time.monotonic()
            if self._stopping or self.sent >= cfg.max_requests or now >= hard_deadline:
                return False
            return now < deadline or self._keep_going()

        timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
        limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

            async def lane() -> None:
                while more():
                    index = self.sent
                    self.sent += 1
                    prompt = self.prompts.prompt(index)
                    retry_until = time.monotonic() + cfg.retry_refused_s
                    result = await stream_completion(client, cfg, index, prompt)
                    while result.refused and time.monotonic() < retry_until and not self._stopping:
                        self.refused += 1
                        await asyncio.sleep(0.1)
                        result = await stream_completion(client, cfg, index, prompt)
                    self.results.append(result)

            lanes = asyncio.gather(*(lane() for _ in range(cfg.concurrency)))
            # Cancelled when the soak is interrupted: its outcome is then retrieved here, not reported at exit.
            lanes.add_done_callback(lambda f: f.cancelled() or f.exception())
            while not lanes.done():
                await asyncio.wait([lanes], timeout=self.progress_s)
                if not lanes.done() and self._on_progress is not None:
                    self._on_progress(self.progress())
            await lanes
        return self.results

    def progress(self) -> str:
        counts = summarize(self.results, self.sent)
        return (
            f"{time.monotonic() - self.started:.0f}s: sent {counts['sent']}, completed {counts[COMPLETED]}, "
            f"failed {counts[FAILED]}, truncated {counts[TRUNCATED]}, in flight {counts['unfinished']}"
        )


def summarize(results: list[RequestResult], sent: int) -> dict[str, Any]:
    """Counts by outcome, plus the first few non-completed requests (what went wrong)."""
    counts = {k: sum(r.outcome == k for r in results) for k in (COMPLETED, TRUNCATED, FAILED)}
    bad = [r for r in results if r.outcome != COMPLETED]
    return {
        "sent": sent,
        **counts,
        "unfinished": sent - len(results),
        "tokens": sum(r.tokens for r in results),
        "examples": [
            {
                "index": r.index,
                "outcome": r.outcome,
                "status": r.status,
                "tokens": r.tokens,
                "finish_reason": r.finish_reason,
                "error": r.error,
            }
            for r in bad[:10]
        ],
    }
