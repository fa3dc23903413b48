"""Reading a server's Prometheus /metrics page in tests, with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metric_total(text: str, name: str) -> float:
    """Sum of the samples called `name` (every label set) in an exposition text; 0 if none."""
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name)
