"""The tier's Prometheus metrics (`maru_pool_tier2_*`, label `pool`), from the pool's stats."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

GAUGES = {
    "tier2_up": "1 while the second tier answers and is used, else 0 (down, or not yet reached)",
    "tier2_queue": "Objects waiting to be written through to the second tier",
    "tier2_fetching": "Objects being fetched from the second tier",
    "tier2_held": "Fetched objects the tier keeps pinned for the load that asked for them",
    "tier2_keys": "Keys this pool knows the second tier holds (its own puts and other pools' announcements)",
    "tier2_hints": "Keys lookups see as held by the second tier only (presence-table hints)",
}
COUNTERS = {
    "tier2_puts": "Objects written through to the second tier",
    "tier2_put_bytes": "Bytes written through to the second tier",
    "tier2_put_failures": "Write-throughs the second tier refused or could not take",
    "tier2_put_skipped": "Objects not written through (queue full, tier down, or evicted before their turn)",
    "tier2_gets": "Fetches from the second tier tried",
    "tier2_get_bytes": "Bytes fetched from the second tier into the pool",
    "tier2_hits": "Fetches committed into the pool",
    "tier2_misses": "Fetches of objects the second tier no longer had",
    "tier2_corrupt": "Objects from (or for) the second tier that failed verification",
    "tier2_late": "Fetches past their deadline",
    "tier2_get_failures": "Fetches the second tier could not serve",
    "tier2_refused": "Fetches asked for but not started (tier down, no room, too many in flight)",
    "tier2_trips": "Times the second tier was marked down",
    "tier2_dropped_keys": "Known keys found gone from the second tier after an outage (a restarted master)",
}


def families(pool: str, st: dict[str, Any]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The tier's metrics, none when the pool has no tier."""
    if "tier2" not in st:
        return
    for name, doc in GAUGES.items():
        g = GaugeMetricFamily(f"maru_pool_{name}", doc, labels=["pool"])
        g.add_metric([pool], float(st.get(name, 0)))
        yield g
    for name, doc in COUNTERS.items():
        c = CounterMetricFamily(f"maru_pool_{name}", doc, labels=["pool"])
        c.add_metric([pool], float(st.get(name, 0)))
        yield c
