"""The Grafana dashboard: shipped by the chart for Grafana's sidecar, every query valid PromQL.

That each query returns data against a real graph is the observability e2e's
(tests/e2e/test_observability_e2e.py::test_every_dashboard_expression_returns_data).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from maru_dynamo.graphs import helm
from tests.graphs.k8s_schemas import validate_manifest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "k8s" / "dashboards" / "maru-dynamo.json"
PROMTOOL = shutil.which("promtool")


def dashboard_configmaps(values: dict) -> list[dict]:
    manifest = helm.template({"image": "img", **values}, release="r", namespace="llm")
    return [
        d
        for d in yaml.safe_load_all(manifest)
        if d and d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard") is not None
    ]


def test_the_chart_ships_the_dashboard_for_grafanas_sidecar() -> None:
    assert dashboard_configmaps({}) == []  # off by default
    (cm,) = dashboard_configmaps({"metrics": {"grafanaDashboard": {"enabled": True, "labels": {"team": "llm"}}}})
    validate_manifest(cm)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["labels"]["team"] == "llm"
    assert cm["metadata"]["namespace"] == "llm"
    assert json.loads(cm["data"]["maru-dynamo.json"]) == json.loads(DASHBOARD.read_text())


def test_the_dashboard_has_the_panels_operators_look_for() -> None:
    dash = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Where prompt tokens come from", "Pool", "Loads and stores", "Health", "Router", "Second tier"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert all(p["description"] and p["targets"] for p in panels)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    (sources,) = [p for p in panels if p["title"] == "Prompt tokens by source"]
    assert [t["legendFormat"] for t in sources["targets"]] == ["computed", "local prefix cache", "pool", "tier 2"]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed: run make setup")
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """Each query, its variables filled in, as a recording rule under `promtool check rules`
    (Prometheus' own parser)."""
    fill = {"$namespace": "llm", "$__rate_interval": "2m", "$__range": "1h"}
    rules = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in fill.items():
                expr = expr.replace(var, value)
            rules.append({"record": f"dashboard:panel{panel['id']}:{target['refId']}", "expr": expr})
    assert len(rules) >= 20
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules)} rules found" in res.stdout
