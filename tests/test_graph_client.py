"""The completions client against a stdlib HTTP server that answers as an OpenAI frontend does."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
import urllib.error
from collections.abc import Iterator

import httpx
import pytest

from maru_dynamo.graphs import client

HELD_CLOSED = threading.Event()


class _Frontend(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body.get("model") != "m":
            self.send_error(404, "no such model")
            return
        if body.get("prompt") == "hold":  # stream until the client goes away
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            try:
                for _ in range(2000):
                    self.wfile.write(f"data: {json.dumps({'choices': [{'text': 'x'}]})}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.005)
            except OSError:
                HELD_CLOSED.set()
            return
        if body.get("prompt") == "odd":  # text with line breaks other than \n, then a line that is not JSON
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            for tok in ("a\x1cb", "c\u2028d\x85e"):
                self.wfile.write(f"data: {json.dumps({'choices': [{'text': tok}]}, ensure_ascii=False)}\n\n".encode())
            self.wfile.write(b"data: {not json\n\ndata: [DONE]\n\n")
            return
        if body.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            for tok in ("a", "b"):
                self.wfile.write(f"data: {json.dumps({'choices': [{'text': tok}]})}\n\n".encode())
            self.wfile.write(b": keep-alive\n\ndata: [DONE]\n\n")
            return
        usage = {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}
        out = json.dumps({"choices": [{"text": "x" * body["max_tokens"]}], "usage": usage, "echo": body}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def frontend() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Frontend)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_completion_is_greedy_and_reports_usage(frontend: str) -> None:
    out = client.completion(frontend, "m", [1, 2, 3], max_tokens=2, logprobs=1, ignore_eos=True)
    assert out["echo"] == {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
    }
    assert (client.prompt_tokens(out), client.cached_tokens(out)) == (5, 4)
    assert client.cached_tokens({"usage": {"prompt_tokens": 3}}) == 0  # a server without details
    seconds, timed = client.timed_completion(frontend, "m", "hi")
    assert seconds > 0 and timed["choices"][0]["text"] == "x"


def test_stream_events_arrive_in_order_and_end_with_done(frontend: str) -> None:
    events = list(client.stream_events(frontend, {"model": "m", "prompt": "p", "max_tokens": 2}))
    assert [e for _, e in events] == [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, client.DONE]
    assert [t for t, _ in events] == sorted(t for t, _ in events)


def test_an_error_status_raises(frontend: str) -> None:
    with pytest.raises(urllib.error.HTTPError, match="404"):
        client.completion(frontend, "other", "p")


def test_a_stream_gives_its_status_then_its_events_and_an_error_status_its_body(frontend: str) -> None:
    with client.Stream(frontend, {"model": "m", "prompt": "p", "max_tokens": 2}) as stream:
        assert stream.status == 200
        assert [e for _, e in stream.events()] == [
            {"choices": [{"text": "a"}]},
            {"choices": [{"text": "b"}]},
            client.DONE,
        ]
    with client.Stream(frontend, {"model": "other", "prompt": "p"}) as stream:
        assert stream.status == 404 and "no such model" in stream.body()
    with pytest.raises(urllib.error.HTTPError, match="404"):
        list(client.stream_events(frontend, {"model": "other", "prompt": "p"}))


def test_a_refused_connection_raises_connection_refused() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        client.Stream(f"http://127.0.0.1:{port}", {"model": "m", "prompt": "p"})


def test_closing_a_held_stream_ends_the_request_on_the_server(frontend: str) -> None:
    HELD_CLOSED.clear()
    stream = client.Stream(frontend, {"model": "m", "prompt": "hold"})
    assert stream.status == 200
    next(stream.events())
    stream.close()
    assert HELD_CLOSED.wait(10), "the server kept streaming to a closed client"


def test_events_split_at_newlines_only_and_a_line_that_is_not_json_is_an_error_event(frontend: str) -> None:
    want = [
        {"choices": [{"text": "a\x1cb"}]},
        {"choices": [{"text": "c\u2028d\x85e"}]},
        {"error": "unparsable event '{not json'"},
        client.DONE,
    ]
    assert [e for _, e in client.stream_events(frontend, {"model": "m", "prompt": "odd"})] == want

    async def read() -> list[dict]:
        async with httpx.AsyncClient() as http:
            body = {"model": "m", "prompt": "odd", "stream": True}
            async with client.stream_completion(http, frontend, body) as resp:
                return [e async for e in client.aiter_events(resp)]

    assert asyncio.run(read()) == want


def test_sse_event_reads_one_line() -> None:
    assert client.sse_event('data: {"a": 1}') == {"a": 1}
    assert client.sse_event("data: [DONE]") is client.DONE
    assert client.sse_event(": keep-alive") is None and client.sse_event("") is None
    assert client.sse_event("data: [1]") == {"error": "unexpected event '[1]'"}
