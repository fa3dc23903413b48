"""Streaming completions of a known length, sent back to back from a few threads (`graphs.client`).

Each request asks for exactly `max_tokens` tokens (``ignore_eos``, greedy, one logprob each) and
is judged by what the client received: complete means HTTP 200, `max_tokens` tokens in the
stream's chunks (counted by their logprobs: one chunk may carry several tokens), finish_reason
``length`` and the final ``[DONE]``; anything else (a cut stream that still ended with 200, an
error event, an error status) is kept with what arrived. A request the server refused to connect
to (nothing listens: a frontend restarting) reached nothing; `Load` can send it again
(`retry_refused_s`) and counts those refusals apart.
"""

from __future__ import annotations

import dataclasses
import http.client
import threading
import time
from collections.abc import Callable

from maru_dynamo.graphs import client


@dataclasses.dataclass(frozen=True)
class StreamResult:
    status: int | None
    tokens: int  # tokens that arrived (their logprobs)
    chunks: int  # choices that carried text
    usage_tokens: int | None
    finish_reason: str | None
    done: bool
    error: str | None
    start: float
    end: float
    refused: bool = False  # the connection was refused: the request reached nothing

    def complete(self, want: int) -> bool:
        return (
            self.status == 200
            and self.error is None
            and self.done
            and self.finish_reason == "length"
            and self.tokens == want
        )


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float = 300) -> StreamResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "logprobs": 1,
    }
    start = time.monotonic()
    status: int | None = None
    tokens, chunks, usage, finish, done, error = 0, 0, None, None, False, None
    refused = False
    try:
        with client.Stream(url, body, timeout) as stream:
            status = stream.status
            if status != 200:
                error = stream.body()
            else:
                for _, event in stream.events():
                    if event is client.DONE:
                        done = True
                        continue
                    if "error" in event:
                        error = str(event["error"])[:300]
                    for choice in event.get("choices") or []:
                        if choice.get("text") is not None:
                            chunks += 1
                            tokens += len((choice.get("logprobs") or {}).get("tokens") or [])
                        finish = choice.get("finish_reason") or finish
                    if event.get("usage"):
                        usage = int(event["usage"].get("completion_tokens") or 0)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
        refused = isinstance(exc, ConnectionRefusedError)
    return StreamResult(status, tokens, chunks, usage, finish, done, error, start, time.monotonic(), refused)


class Load:
    """`threads` clients, each sending `prompt_for(i)` requests back to back until `stop()` (or, with
    `requests`, until that many were sent).

    `retry_refused_s` > 0: a request whose connection is refused is sent again after 0.1 s, for
    up to that long (a client retrying while its frontend restarts); `refused` counts the retries.
    """

    def __init__(
        self,
        url: str,
        model: str,
        prompt_for: Callable[[int], list[int]],
        max_tokens: int,
        threads: int = 3,
        retry_refused_s: float = 0.0,
        requests: int | None = None,
    ) -> None:
        self.url, self.model, self.prompt_for, self.max_tokens = url, model, prompt_for, max_tokens
        self.retry_refused_s = retry_refused_s
        self.refused = 0
        self.requests = requests
        self.results: list[StreamResult] = []
        self._lock = threading.Lock()
        self._next = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(threads)]

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self.requests is not None and self._next >= self.requests:
                    return
                index, self._next = self._next, self._next + 1
            prompt = self.prompt_for(index)
            deadline = time.monotonic() + self.retry_refused_s
            result = stream_completion(self.url, self.model, prompt, self.max_tokens)
            while result.refused and time.monotonic() < deadline:
                with self._lock:
                    self.refused += 1
                time.sleep(0.1)
                result = stream_completion(self.url, self.model, prompt, self.max_tokens)
            with self._lock:
                self.results.append(result)

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def done(self) -> int:
        """How many requests have ended so far."""
        with self._lock:
            return len(self.results)

    def wait(self, timeout: float = 600) -> list[StreamResult]:
        """Until every thread is done (with `requests`: all of them sent and ended); every result."""
        for t in self._threads:
            t.join(timeout)
        with self._lock:
            return list(self.results)

    def stop(self, timeout: float = 300) -> list[StreamResult]:
        """Send no new request, wait for those in flight, return every result."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        with self._lock:
            return list(self.results)
