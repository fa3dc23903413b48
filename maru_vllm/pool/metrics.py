"""Prometheus metrics for the pool service.

Gauges and counters are read from the index at scrape time (a custom collector), so the op
path only pays for the latency histogram observation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from maru_vllm.pool.tier2 import metrics as tier2_metrics

logger = logging.getLogger(__name__)

_GAUGES = {
    "capacity_bytes": "Bytes of the data area objects can use",
    "allocated_bytes": "Bytes allocated to reserved, committed and still-pinned removed objects",
    "object_bytes": "Payload bytes of visible (committed) objects",
    "objects": "Visible (committed) objects",
    "live_objects": "Objects the index holds (visible, reserved, and removed but still pinned)",
    "max_objects": "Most objects the index holds (--max-objects)",
    "metadata_bytes": "Bytes of object metadata (keys + meta JSON) held by the service",
    "metadata_budget_bytes": "Metadata bytes the service may hold (--metadata-budget)",
    "reserved": "Reservations not yet committed or aborted",
    "pinned": "Objects pinned by at least one reader",
    "sessions": "Connected client sessions",
    "event_queue": "Events waiting to be published to NATS",
    "connections": "Open client connections (including those still waiting for hello)",
    "catalog_slots": "Catalog slots: visible objects a restarted service can recover, at most",
    "recovered_objects": "Objects this service recovered from the region at its start (a warm restart)",
    "recovery_dropped": "Objects in the region at its start that did not verify and were freed",
    "recovery_seconds": "Seconds this service took to rebuild its index from the region at its start",
}
EVICTION_REASONS = ("space", "object_cap", "metadata_budget")  # the index's evictions_<reason> counters
_COUNTERS = {
    "hits": "Lookups/acquires that found the key",
    "misses": "Lookups/acquires that did not find the key (or found it corrupt)",
    "stores": "Objects committed",
    "duplicate_commits": "Commits that lost the write-once race",
    "evictions": "Objects evicted (LRU)",
    "corrupt_reads": "Objects a reader found corrupt",
    "reserve_failures": "Reservations that found no space (or hit the object cap)",
    "object_cap_refusals": "Reservations refused because --max-objects pinned or reserved objects fill the index",
    "metadata_budget_refusals": "Commits refused because pinned objects' metadata fills --metadata-budget",
    "sessions_expired": "Sessions closed by lease expiry",
    "events_dropped": "Events dropped because the NATS queue overflowed",
    "quota_refusals": "Reservations and pins refused by a per-session quota or the pin cap per object",
    "auth_failures": "Connections that presented a wrong token",
    "snapshot_pages_encoded": "Snapshot pages the service built and encoded",
    "snapshot_pages_shared": "Snapshot pages answered with the bytes encoded for an earlier reader (pool unchanged)",
    "catalog_full": "Objects committed while the catalog was full (not recoverable after a restart)",
}


class _StatsCollector:
    def __init__(self, pool: str, stats: Callable[[], dict[str, Any]]) -> None:
        self.pool = pool
        self.stats = stats

    def collect(self):  # the prometheus_client collector protocol
        st = self.stats()
        for name, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"maru_pool_{name}", doc, labels=["pool"])
            g.add_metric([self.pool], float(st.get(name, 0)))
            yield g
        for name, doc in _COUNTERS.items():
            c = CounterMetricFamily(f"maru_pool_{name}", doc, labels=["pool"])
            c.add_metric([self.pool], float(st.get(name, 0)))
            yield c
        by_reason = CounterMetricFamily(
            "maru_pool_evictions_by_reason",
            "Objects evicted (LRU), by what needed the room: region space, the object cap, the metadata budget",
            labels=["pool", "reason"],
        )
        for reason in EVICTION_REASONS:
            by_reason.add_metric([self.pool, reason], float(st.get(f"evictions_{reason}", 0)))
        yield by_reason
        yield from tier2_metrics.families(self.pool, st)


class PoolMetrics:
    def __init__(self, pool: str, stats: Callable[[], dict[str, Any]]) -> None:
        self.pool = pool
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(pool, stats))
        self.op_latency = Histogram(
            "maru_pool_op_latency_seconds",
            "Service-side time to handle one request, by op",
            ["pool", "op"],
            registry=self.registry,
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.25, 1.0),
        )
        self._children: dict[str, Any] = {}

    def observe(self, op: str, seconds: float) -> None:
        child = self._children.get(op)
        if child is None:
            child = self._children[op] = self.op_latency.labels(self.pool, op)
        child.observe(seconds)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        result = start_http_server(port, addr=host, registry=self.registry)
        if isinstance(result, tuple):  # prometheus-client >= 0.20 returns (server, thread)
            port = result[0].server_address[1]
        logger.info("metrics on http://%s:%d/metrics", host, port)
        return port
