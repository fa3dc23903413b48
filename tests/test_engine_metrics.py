"""Reading a vLLM engine's counters from a /metrics page (the page here is canned text in vLLM's format)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from maru_vllm.launch.engine_metrics import EngineCounters, read_counters, running_requests

PAGE = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1280.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 256.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 512.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 512.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="something_new"} 7.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
vllm:maru_connector_chunks_loaded_total{engine="0"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:prompt_tokens_created{engine="0"} 1.7e9
"""


@pytest.fixture
def metrics_url() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server names its handlers so
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_counters_are_summed_over_label_sets_and_split_by_source(metrics_url: str) -> None:
    c = read_counters(metrics_url)
    assert c == EngineCounters(
        requests=3,
        prompt_tokens=1280,
        local_compute=256,
        local_cache_hit=512,
        external_kv_transfer=512,
        chunks_loaded=2,
        chunks_stored=0,
    )
    assert running_requests(metrics_url) == 3


def test_difference_of_two_readings_is_what_happened_in_between() -> None:
    before = EngineCounters(prompt_tokens=100, local_compute=100)
    after = EngineCounters(requests=1, prompt_tokens=900, local_compute=388, external_kv_transfer=512, chunks_loaded=2)
    assert after - before == EngineCounters(
        requests=1, prompt_tokens=800, local_compute=288, external_kv_transfer=512, chunks_loaded=2
    )
