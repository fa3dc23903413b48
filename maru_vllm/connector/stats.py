"""Connector transfer statistics: vLLM's KV connector stats hook and Prometheus.

The worker side counts chunks/bytes loaded and stored, time spent, failures; the scheduler side
counts where the external prompt tokens came from (`token_sources.py`). vLLM ships those counters
from the worker and the scheduler to the front-end process (`get_kv_connector_stats`),
aggregates them, logs them, and hands them to `MaruPromMetrics.observe`, which exports
`maru_connector_*` counters on vLLM's own `/metrics` endpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from maru_vllm.connector.token_sources import POOL, TIER2


@dataclasses.dataclass
class TransferCounters:
    chunks_loaded: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    load_failures: int = 0
    # Where load time goes (parts of load_seconds): the acquire round trip (pins, headers), the
    # copy into the paged cache with the payload checksum verified piece by piece, the release.
    load_acquire_seconds: float = 0.0
    load_copy_seconds: float = 0.0
    load_release_seconds: float = 0.0
    chunks_stored: int = 0
    bytes_stored: int = 0
    store_seconds: float = 0.0
    store_hold_seconds: float = 0.0
    store_failures: int = 0
    stores_skipped: int = 0
    # Scheduler side: the external prompt tokens vLLM granted, by where they came from.
    prompt_tokens_pool: int = 0
    prompt_tokens_tier2: int = 0

    # Called every engine step (take_counters): field by field, without astuple's deep copy.
    def is_empty(self) -> bool:
        return not any(getattr(self, name) for name in _COUNTER_NAMES)

    def add(self, other: TransferCounters) -> None:
        for name in _COUNTER_NAMES:
            value = getattr(other, name)
            if value:
                setattr(self, name, getattr(self, name) + value)


_COUNTER_NAMES = tuple(f.name for f in dataclasses.fields(TransferCounters))


class MaruConnectorStats(KVConnectorStats):
    """Serializable container of `TransferCounters` fields (vLLM sends `data` across processes)."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=dict(data or {}))

    @classmethod
    def from_counters(cls, counters: TransferCounters) -> MaruConnectorStats:
        return cls(dataclasses.asdict(counters))

    def counters(self) -> TransferCounters:
        known = {f.name for f in dataclasses.fields(TransferCounters)}
        return TransferCounters(**{k: v for k, v in self.data.items() if k in known})

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine = self.counters()
        mine.add(MaruConnectorStats(other.data).counters())
        self.data = dataclasses.asdict(mine)
        return self

    def reduce(self) -> dict[str, int | float]:
        c = self.counters()
        out: dict[str, int | float] = dataclasses.asdict(c)
        if c.load_seconds > 0:
            out["load_GBps"] = round(c.bytes_loaded / c.load_seconds / 1e9, 3)
        if c.store_seconds > 0:
            out["store_GBps"] = round(c.bytes_stored / c.store_seconds / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return self.counters().is_empty()


# TransferCounters field -> the `source` of vllm:maru_connector_prompt_tokens_by_source_total.
_SOURCE_FIELDS = {"prompt_tokens_pool": POOL, "prompt_tokens_tier2": TIER2}


class MaruPromMetrics(KVConnectorPromMetrics):
    """`maru_connector_*` counters on vLLM's /metrics, one series per engine (and per source for
    `prompt_tokens_by_source`, each there from the start: a source that never served is a 0)."""

    _COUNTERS: ClassVar[dict[str, str]] = {
        "chunks_loaded": "KV chunks loaded from the Maru pool",
        "blocks_loaded": "KV blocks loaded from the Maru pool (a chunk shared in part adds its leading blocks)",
        "bytes_loaded": "bytes of KV loaded from the Maru pool",
        "load_seconds": "seconds spent loading KV from the Maru pool",
        "load_failures": "chunk loads that failed and were recomputed",
        "load_acquire_seconds": "part of load_seconds spent pinning chunks (acquire round trip)",
        "load_copy_seconds": "part of load_seconds spent verifying and copying chunks into the KV cache",
        "load_release_seconds": "part of load_seconds spent unpinning chunks (release round trip)",
        "chunks_stored": "KV chunks stored into the Maru pool",
        "bytes_stored": "bytes of KV stored into the Maru pool",
        "store_seconds": "seconds spent storing KV into the Maru pool (by the write-behind thread)",
        "store_hold_seconds": "seconds engine steps waited for stores (hand-over, preemptions, idle steps)",
        "store_failures": "chunk stores that failed and were skipped",
        "stores_skipped": "chunk stores skipped (already in the pool or no space)",
    }

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for field, doc in self._COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:maru_connector_{field}", documentation=doc, labelnames=labelnames)
            self._counters[field] = {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}
        by_source = self._counter_cls(
            name="vllm:maru_connector_prompt_tokens_by_source",
            documentation="prompt tokens the connector supplied (vLLM's external_kv_transfer), by where they came "
            "from: the pool, or its second tier",
            labelnames=[*labelnames, "source"],
        )
        for field, source in _SOURCE_FIELDS.items():
            self._counters[field] = {
                idx: by_source.labels(*values, source) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for field, per_engine in self._counters.items():
            value = transfer_stats_data.get(field)
            if value:
                per_engine[engine_idx].inc(value)
