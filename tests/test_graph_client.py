"""The completions client against a stdlib HTTP server that answers as an OpenAI frontend does."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
from collections.abc import Iterator

import pytest

from maru_dynamo.graphs import client


class _Frontend(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body.get("model") != "m":
            self.send_error(404, "no such model")
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
