"""The OpenAI completions API of a graph's frontend (or of one vLLM server), from the stdlib.

One client for the benchmarks, the e2e tests and the demo: plain and timed completions, a
response's `usage` (prompt and cached tokens), and the events of a streamed completion as they
arrive. Errors are the stdlib's (`urllib.error.HTTPError` for a status other than 2xx, `OSError`
for a connection that fails or times out); callers that count failures catch those.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

#: the event a streamed completion ends with ("data: [DONE]")
DONE: dict[str, Any] = {"done": True}


def post_json(url: str, payload: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """POST `payload` as JSON; the decoded JSON reply."""
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get_json(url: str, timeout: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def completion(
    base_url: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int = 8,
    logprobs: int | None = None,
    timeout: float = 300.0,
    **extra: Any,
) -> dict[str, Any]:
    """A greedy, non-streamed completion (`extra`: more request fields, e.g. ``ignore_eos``)."""
    payload: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    if logprobs is not None:
        payload["logprobs"] = logprobs
    return post_json(f"{base_url}/v1/completions", payload, timeout)


def timed_completion(
    base_url: str, model: str, prompt: str | list[int], max_tokens: int = 1, timeout: float = 900.0, **extra: Any
) -> tuple[float, dict[str, Any]]:
    """(seconds from sending to the whole reply, the reply) of `completion`; with one output
    token that is the time to first token."""
    t0 = time.perf_counter()
    out = completion(base_url, model, prompt, max_tokens, timeout=timeout, **extra)
    return time.perf_counter() - t0, out


def prompt_tokens(response: dict[str, Any]) -> int:
    return int((response.get("usage") or {}).get("prompt_tokens") or 0)


def cached_tokens(response: dict[str, Any]) -> int:
    """The prompt tokens the server did not compute (`usage.prompt_tokens_details.cached_tokens`)."""
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def stream_events(
    base_url: str, payload: dict[str, Any], timeout: float = 600.0
) -> Iterator[tuple[float, dict[str, Any]]]:
    """(arrival time on `time.monotonic`, event) for every server-sent event of a streamed
    completion of `payload` (``stream`` is set here); the final ``[DONE]`` arrives as `DONE`."""
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps({**payload, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            yield time.monotonic(), (DONE if data == "[DONE]" else json.loads(data))
