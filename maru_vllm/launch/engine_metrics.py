"""A vLLM engine's own counters, read from its Prometheus /metrics (tests and benchmarks).

Where a request's prompt tokens came from is what the routing comparison and the e2e tests
measure; vLLM counts it per engine in ``vllm:prompt_tokens_by_source_total`` (computed, local
prefix-cache hit, loaded through the KV connector), and the Maru connector adds its chunk
counters. Reading the counters before and after a request attributes the change to it.
"""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families

_COUNTERS = {
    "vllm:request_success_total": "requests",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:maru_connector_chunks_loaded_total": "chunks_loaded",
    "vllm:maru_connector_chunks_stored_total": "chunks_stored",
}
_PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclasses.dataclass(frozen=True)
class EngineCounters:
    """Totals since the engine started (summed over label sets other than `source`)."""

    requests: int = 0  # finished successfully (aborted requests are not counted)
    prompt_tokens: int = 0
    local_compute: int = 0  # prompt tokens the engine computed
    local_cache_hit: int = 0  # ... found in its own prefix cache
    external_kv_transfer: int = 0  # ... loaded through the KV connector (the pool)
    chunks_loaded: int = 0
    chunks_stored: int = 0

    def __sub__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)}
        )


def _parse(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of every sample, read with prometheus_client's own parser."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def scrape(url: str, timeout: float = 30.0) -> str:
    """The Prometheus exposition text at `url` (an engine's, the frontend's or the pool's
    /metrics); URLError / OSError when it does not answer."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode(errors="replace")


def _samples(url: str, timeout: float) -> list[tuple[str, dict[str, str], float]]:
    return list(_parse(scrape(url, timeout)))


def metric_total(text: str, name: str) -> float:
    """The sum of metric `name`'s samples, over all label sets, in a Prometheus exposition `text`."""
    return sum(value for sample, _labels, value in _parse(text) if sample == name)


def read_counters(url: str, timeout: float = 60.0) -> EngineCounters:
    """The counters on one engine's /metrics page at `url`."""
    totals: dict[str, float] = {}
    for name, labels, value in _samples(url, timeout):
        key = _COUNTERS.get(name)
        if key is None and name == "vllm:prompt_tokens_by_source_total":
            source = labels.get("source")
            key = source if source in _PROMPT_SOURCES else None
        if key is not None:
            totals[key] = totals.get(key, 0.0) + value
    return EngineCounters(**{k: int(v) for k, v in totals.items()})


def running_requests(url: str, timeout: float = 60.0) -> int:
    """Requests the engine is running now (vLLM refreshes the gauge when its engine steps)."""
    return int(sum(value for name, _, value in _samples(url, timeout) if name == "vllm:num_requests_running"))
