"""The chart's alert rules, checked and unit-tested by Prometheus' own `promtool`.

`promtool check rules` parses every expression with Prometheus' parser; `promtool test rules`
evaluates every alert on synthetic series, twice: once with the series of its failure (the alert
fires, with its labels and its annotations rendered) and once with the series of a healthy pool
or worker (it stays silent). promtool comes from Debian's `prometheus` package (`make setup`).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from maru_dynamo.graphs import helm

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed: run make setup")

NS = "llm"
POOL = {"namespace": NS, "pool": "kv", "pod": "pool-a"}
WORKER = {"namespace": NS, "pod": "worker-0", "engine": "0", "model_name": "m"}


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


@dataclasses.dataclass(frozen=True)
class Scenario:
    """An alert's failure and healthy inputs: series -> (failing values, healthy values)."""

    alert: str
    series: dict[str, tuple[str, str]]
    eval_time: str
    labels: dict[str, str]  # the alert's labels besides alertname and severity
    value: str = ""  # how the alert's $value renders, where its annotations use it


def _bucket(le: str) -> str:
    return _series("maru_pool_op_latency_seconds_bucket", {**POOL, "op": "lookup", "le": le})


SCENARIOS = [
    Scenario(
        "MaruPoolDown",
        {_series("up", {"namespace": NS, "job": "maru-pool-metrics", "pod": "pool-a"}): ("0x10", "1x10")},
        "5m",
        {"namespace": NS, "job": "maru-pool-metrics", "pod": "pool-a"},
    ),
    Scenario(
        "MaruPoolSlow",
        # Failing: every request slower than the last finite bucket (p99 reads as 0.1 s).
        {
            _bucket("0.01"): ("0x30", "0+10x30"),
            _bucket("0.1"): ("0x30", "0+10x30"),
            _bucket("+Inf"): ("0+10x30", "0+10x30"),
        },
        "25m",
        {"namespace": NS, "pod": "pool-a"},
        value="0.1",
    ),
    Scenario(
        "MaruPoolStoresRefused",
        {
            _series("maru_pool_reserve_failures_total", POOL): ("0+1x30", "0x30"),
            _series("maru_pool_metadata_budget_refusals_total", POOL): ("0x30", "0x30"),
        },
        "25m",
        {"namespace": NS, "pod": "pool-a"},
    ),
    Scenario(
        "MaruPoolCorruptObjects",
        {_series("maru_pool_corrupt_reads_total", POOL): ("0 0 0 1 1 1 1 1 1 1", "0x10")},
        "5m",
        POOL,
    ),
    Scenario(
        "MaruPoolEventsDropped",
        {_series("maru_pool_events_dropped_total", POOL): ("0 0 0 5 5 5 5 5 5 5", "0x10")},
        "5m",
        POOL,
    ),
    Scenario(
        "MaruPoolEventBacklog",
        {_series("maru_pool_event_queue", POOL): ("20000x10", "10x10")},
        "8m",
        POOL,
        value="20000",
    ),
    Scenario(
        "MaruPoolAuthFailures",
        {_series("maru_pool_auth_failures_total", POOL): ("0 0 0 1 1 1 1 1 1 1", "0x10")},
        "5m",
        POOL,
    ),
    Scenario(
        "MaruPoolIndexNearItsLimits",
        {
            _series("maru_pool_live_objects", POOL): ("950x40", "500x40"),
            _series("maru_pool_max_objects", POOL): ("1000x40", "1000x40"),
            _series("maru_pool_metadata_bytes", POOL): ("10x40", "10x40"),
            _series("maru_pool_metadata_budget_bytes", POOL): ("1000x40", "1000x40"),
        },
        "35m",
        {"namespace": NS, "pod": "pool-a"},
    ),
    Scenario(
        "MaruConnectorLoadFailures",
        {_series("vllm:maru_connector_load_failures_total", WORKER): ("0+1x30", "0x30")},
        "25m",
        {"namespace": NS, "pod": "worker-0"},
    ),
    Scenario(
        "MaruConnectorStoreFailures",
        {_series("vllm:maru_connector_store_failures_total", WORKER): ("0+1x30", "0x30")},
        "25m",
        {"namespace": NS, "pod": "worker-0"},
    ),
    Scenario(
        "MaruWorkersMigratingRequests",
        {
            _series("dynamo_frontend_model_migration_total", {"namespace": NS, "pod": "frontend-0", "model": "m"}): (
                "0+1x20",
                "0x20",
            )
        },
        "15m",
        {"namespace": NS},
        value="10",
    ),
    Scenario(
        "MaruDisaggregationDegraded",
        {
            _series("maru_disagg_standing_in", {"namespace": NS, "pod": "worker-0", "standby_role": "decode"}): (
                "1x10",
                "0x10",
            )
        },
        "8m",
        {"namespace": NS, "standby_role": "decode"},
    ),
]


def chart_rules() -> dict[str, Any]:
    """The chart's rule groups as a Prometheus rule file (release `maru`, namespace `llm`, pool `kv`)."""
    values = {"image": "img:1", "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}
    docs = [d for d in yaml.safe_load_all(helm.template(values, release="maru", namespace=NS)) if d]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return {"groups": rule["spec"]["groups"]}


def _rendered(text: str, labels: dict[str, str], value: str) -> str:
    """The annotation as Prometheus renders it for this alert: the placeholders the chart uses, filled."""
    out = text.replace("{{ $value }}", value)
    for name, label in labels.items():
        out = out.replace("{{ $labels." + name + " }}", label)
    assert "{{" not in out, f"a placeholder the scenario does not fill: {out}"
    return out


def unit_tests(rules: dict[str, Any], scenarios: list[Scenario]) -> dict[str, Any]:
    by_name = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    tests = []
    for sc in scenarios:
        rule = by_name[sc.alert]
        labels = {**sc.labels, "severity": rule["labels"]["severity"]}
        annotations = {k: _rendered(v, sc.labels, sc.value) for k, v in rule["annotations"].items()}
        for failing in (True, False):
            tests.append(
                {
                    "interval": "1m",
                    "input_series": [
                        {"series": s, "values": fail if failing else healthy}
                        for s, (fail, healthy) in sc.series.items()
                    ],
                    "alert_rule_test": [
                        {
                            "eval_time": sc.eval_time,
                            "alertname": sc.alert,
                            "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}] if failing else [],
                        }
                    ],
                }
            )
    return {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_every_rule_of_the_chart(tmp_path: Path) -> None:
    rules = chart_rules()
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    res = promtool("check", "rules", "rules.yml", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    count = sum(len(g["rules"]) for g in rules["groups"])
    assert f"SUCCESS: {count} rules found" in res.stdout


def test_every_alert_fires_on_its_failure_and_stays_silent_in_health(tmp_path: Path) -> None:
    rules = chart_rules()
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert {sc.alert for sc in SCENARIOS} == alerts  # a unit test per alert, none for an alert that is gone
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(unit_tests(rules, SCENARIOS)))
    res = promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_negative_promtool_fails_an_alert_that_does_not_fire_as_expected(tmp_path: Path) -> None:
    """The unit tests can fail: a healthy pool's series swapped in for MaruPoolDown's failure."""
    rules = chart_rules()
    down = next(sc for sc in SCENARIOS if sc.alert == "MaruPoolDown")
    healthy = dataclasses.replace(down, series={s: (h, h) for s, (_, h) in down.series.items()})
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(unit_tests(rules, [healthy])))
    res = promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert res.returncode != 0
    assert "alertname: MaruPoolDown" in res.stdout + res.stderr
