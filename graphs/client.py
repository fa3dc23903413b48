"""The OpenAI completions API of a graph's frontend (or of one vLLM server), from the stdlib.

One client for the benchmarks, the e2e tests and the demo, and the only code here that writes a
completions request: plain, timed and chat completions (`completion`, `timed_completion`,
`chat_completion`; `completions` posts a request body of the caller's own), a response's `usage`
(prompt and cached tokens), and streamed completions: `Stream` (one held open: its HTTP status,
then its events as they arrive, and `close()` to cancel it), `stream_events` (the events of
one), `sse_event` (one server-sent line, the one parser every streaming client here uses),
`stream_completion` (one opened with an `httpx` client, for the asynchronous load generators)
and `aiter_events` (its events). Errors are the stdlib's (`urllib.error.HTTPError` for a status
other than 2xx, `OSError` for a connection that fails or times out); callers that count failures
catch those.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

#: the event a streamed completion ends with ("data: [DONE]")
DONE: dict[str, Any] = {"done": True}
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


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
    return completions(base_url, payload, timeout)


def completions(base_url: str, payload: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """A non-streamed completion of `payload`, a request body of the caller's own."""
    return post_json(f"{base_url}{COMPLETIONS}", payload, timeout)


def chat_completion(
    base_url: str,
    model: str,
    messages: list[dict[str, Any]],
    max_tokens: int = 8,
    timeout: float = 300.0,
    **extra: Any,
) -> dict[str, Any]:
    """A greedy, non-streamed chat completion of `messages` (`extra`: more request fields)."""
    payload: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return post_json(f"{base_url}{CHAT_COMPLETIONS}", {**payload, **extra}, timeout)


def stream_completion(http: httpx.AsyncClient, base_url: str, payload: dict[str, Any]) -> Any:
    """A streamed completion of `payload` with an `httpx` client: the context manager of its
    response (``async with``); read its events with `aiter_events`."""
    return http.stream("POST", f"{base_url}{COMPLETIONS}", json={**payload, "stream": True})


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


def sse_event(line: str) -> dict[str, Any] | None:
    """One line of a streamed completion: the JSON object of a ``data:`` line, `DONE` for
    ``data: [DONE]``, None for a line that carries no data (blank, a comment, another field). A
    ``data:`` line that is not a JSON object is an error event (``{"error": ...}``), as a server's
    own error events are."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return DONE
    try:
        event = json.loads(data)
    except ValueError:
        return {"error": f"unparsable event {data[:80]!r}"}
    return event if isinstance(event, dict) else {"error": f"unexpected event {data[:80]!r}"}


class Stream:
    """A streamed completion of `payload` (``stream`` is set here), held open.

    Opening sends the request and reads the response's headers: `status` is the HTTP status
    (`body()` reads an error answer). `events()` yields (arrival time on `time.monotonic`, event)
    for each event as it arrives (`sse_event`; the final ``[DONE]`` as `DONE`); lines are split at
    b"\\n" only, since generated text may hold any other line break. `close()` (or leaving a
    ``with`` block) shuts the connection down, which cancels the request in Dynamo and vLLM if it
    is still running. Opening raises `OSError` when the connection fails (`ConnectionRefusedError`
    when nothing listens).
    """

    def __init__(self, base_url: str, payload: dict[str, Any], timeout: float = 600.0) -> None:
        url = urllib.parse.urlsplit(base_url)
        self._conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
        try:
            self._conn.request(
                "POST",
                f"{url.path.rstrip('/')}{COMPLETIONS}",
                body=json.dumps({**payload, "stream": True}),
                headers={"content-type": "application/json"},
            )
            self._resp = self._conn.getresponse()
        except BaseException:
            self._conn.close()
            raise
        self.status: int = self._resp.status
        self.headers = self._resp.headers

    def body(self, limit: int = 300) -> str:
        """The answer's body (for a status other than 200), at most `limit` characters."""
        return self._resp.read().decode(errors="replace")[:limit]

    def events(self) -> Iterator[tuple[float, dict[str, Any]]]:
        for raw in self._resp:
            event = sse_event(raw.rstrip(b"\r\n").decode(errors="replace"))
            if event is not None:
                yield time.monotonic(), event

    def close(self) -> None:
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._conn.close()
        self._resp.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def stream_events(
    base_url: str, payload: dict[str, Any], timeout: float = 600.0
) -> Iterator[tuple[float, dict[str, Any]]]:
    """(arrival time on `time.monotonic`, event) for every server-sent event of a streamed
    completion of `payload` (`Stream`); a status other than 200 raises `urllib.error.HTTPError`."""
    with Stream(base_url, payload, timeout) as stream:
        if stream.status != 200:
            raise urllib.error.HTTPError(f"{base_url}{COMPLETIONS}", stream.status, stream.body(), stream.headers, None)
        yield from stream.events()


async def aiter_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The events of a streamed completion read with `httpx` (`sse_event`), split at b"\\n" only:
    generated text may hold any other line break (\\x1c, \\x85, U+2028 ...), at which
    str.splitlines - and so httpx's own ``aiter_lines`` - would cut."""
    buffer = b""
    async for data in resp.aiter_bytes():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            event = sse_event(line.rstrip(b"\r").decode(errors="replace"))
            if event is not None:
                yield event
    if buffer:
        event = sse_event(buffer.decode(errors="replace"))
        if event is not None:
            yield event
