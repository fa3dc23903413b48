"""Checks for the chart's PrometheusRule: its shape, and that its alerts use only real metrics.

* Shape: prometheus-operator's CRD is not available here (as for the ServiceMonitor), so
  PROMETHEUS_RULE is the `monitoring.coreos.com/v1` PrometheusRule spec written down from the
  operator's API reference (groups of rules: `alert`/`record`, `expr`, `for`, `labels`,
  `annotations`; durations in its `Duration` pattern), closed like the DGD schema, so a
  misspelt key or a malformed duration fails.
* Metric names: `exported_metric_names()` collects what the product's exporters really register
  (the pool service's collector, the connector's vLLM metric class, the stand-ins' series,
  instantiated and fed once each) plus the names Dynamo's own `dynamo.prometheus_names` declares for the frontend and
  Prometheus' per-target `up`; `metric_names(expr)` reads the names an expression selects.
"""

from __future__ import annotations

import functools
import re
import types
from typing import Any

import jsonschema
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tests.graphs.k8s_schemas import ManifestError

DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
PROMETHEUS_RULE: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "namespace"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STR_MAP},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string", "pattern": DURATION},
                            "query_offset": {"type": "string", "pattern": DURATION},
                            "limit": {"type": "integer"},
                            "labels": _STR_MAP,
                            "rules": {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["expr"],
                                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                    "properties": {
                                        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
                                        "record": {"type": "string"},
                                        "expr": {"type": "string", "minLength": 1},
                                        "for": {"type": "string", "pattern": DURATION},
                                        "keep_firing_for": {"type": "string", "pattern": DURATION},
                                        "labels": _STR_MAP,
                                        "annotations": _STR_MAP,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}


def validate_prometheus_rule(doc: dict[str, Any]) -> None:
    """Raise ManifestError when PROMETHEUS_RULE refuses `doc`."""
    errors = list(jsonschema.Draft7Validator(PROMETHEUS_RULE).iter_errors(doc))
    if errors:
        where = ["/".join(str(p) for p in e.absolute_path) or "<root>" for e in errors]
        raise ManifestError(
            f"PrometheusRule {doc.get('metadata', {}).get('name')}: "
            + "; ".join(f"{w}: {e.message}" for w, e in zip(where, errors[:5]))
        )


# PromQL words that are not metric names (functions, aggregations, modifiers, keywords).
_PROMQL_WORDS = (
    "sum min max avg count stddev stdvar topk bottomk quantile count_values group by without on "
    "ignoring group_left group_right and or unless offset bool rate irate increase delta idelta "
    "deriv histogram_quantile absent absent_over_time abs clamp_min clamp_max ceil floor round time "
    "vector scalar avg_over_time max_over_time min_over_time sum_over_time count_over_time "
    "last_over_time changes resets label_replace label_join sort sort_desc predict_linear"
)
PROMQL_WORDS = frozenset(_PROMQL_WORDS.split())


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects; ValueError when its brackets do not balance."""
    body = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings hold label values, not names
    depth = 0
    for ch in body:
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth:
        raise ValueError(f"unbalanced brackets in {expr!r}")
    body = re.sub(r"\{[^{}]*\}", "{}", body)  # label matchers
    body = re.sub(r"\[[^\[\]]*\]", "[]", body)  # ranges
    body = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", r"\1()", body)  # label lists
    return {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", body) if w not in PROMQL_WORDS}


@functools.cache
def exported_metric_names() -> frozenset[str]:
    """Every series name the pool service, the connector and the stand-ins export, plus Dynamo's frontend and `up`."""
    from dynamo.prometheus_names import frontend_service, name_prefix

    from maru_vllm.connector.stats import MaruPromMetrics
    from maru_vllm.pool.metrics import PoolMetrics

    pool = PoolMetrics("p", dict)
    pool.observe("lookup", 0.001)
    names = {s.name for family in pool.registry.collect() for s in family.samples}

    registry = CollectorRegistry()
    bind = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    connector = MaruPromMetrics(types.SimpleNamespace(kv_transfer_config=None), bind, ["engine"], {0: ["0"]})
    connector.observe(dict.fromkeys(MaruPromMetrics._COUNTERS, 1))
    names |= {s.name for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}

    from maru_dynamo.components.disagg.standby import StandbyMetrics

    standby = StandbyMetrics("prefill")
    standby.requests.inc()
    names |= {
        s.name for family in standby.registry.collect() for s in family.samples if not s.name.endswith("_created")
    }

    for attr, value in vars(frontend_service).items():
        if attr.isupper() and isinstance(value, str) and attr != "METRICS_PREFIX_ENV":
            names |= {f"{name_prefix.FRONTEND}_{value}"} | {
                f"{name_prefix.FRONTEND}_{value}_{s}" for s in ("bucket", "sum", "count")
            }
    names.add("up")
    return frozenset(names)
