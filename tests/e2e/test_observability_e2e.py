"""What an operator sees: the aggregated graph under a real Prometheus, through its HTTP API.

One graph for the module (nats-server, the pool, two Maru workers, the frontend) and the
Prometheus `graph run --prometheus` starts (graphs/prometheus.py: every process scraped each
second, the chart's own alert rules). Traffic that takes every path a prompt token can take -
computed, loaded from the pool by a worker that never saw the prompt, served from a worker's
own prefix cache - and then:

* the token sources add up, per worker, to the prompt tokens served, and their growth to the
  prompt tokens the test sent (0 unaccounted);
* every expression of the Grafana dashboard (deploy/k8s/dashboards/) returns data;
* a stopped pool raises `MaruPoolDown` once its `for:` window has passed, not before, while the
  graph keeps serving.

About 4 minutes, 2 of them the alert's window.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path

import pytest
import yaml

from maru_dynamo.graphs import prometheus as prom
from maru_dynamo.graphs.client import completion, prompt_tokens
from maru_dynamo.graphs.run import frontend_instances
from maru_vllm.launch import ProcessGroup, free_port
from tests.e2e import planned_graph
from tests.e2e.conftest import CHUNK, stored_chunks, token_prompt
from tests.graphs.prom_rules import metric_names
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "k8s" / "dashboards" / "maru-dynamo.json"
NS = f'namespace="{prom.NAMESPACE}"'

pytestmark = pytest.mark.e2e


def source_totals(p: prom.Prometheus, by: str = "") -> dict[str, dict[str, float]]:
    """{pod or "": {"prompt tokens", each token source, "external"}} as Prometheus has them now."""
    grouping = f"by ({by}) " if by else ""

    def read(expr: str) -> dict[str, float]:
        return {s["metric"].get(by, ""): float(s["value"][1]) for s in p.query(f"sum {grouping}({expr})")}

    series = {"prompt tokens": read(f"{prom.PROMPT_TOKENS}{{{NS}}}")}
    for name, metric, source in prom.TOKEN_SOURCES:
        series[name] = read(f'{metric}{{{NS}, source="{source}"}}')
    series["external"] = read(f'{prom.VLLM_SOURCES}{{{NS}, source="{prom.EXTERNAL_SOURCE}"}}')
    keys = set(series["prompt tokens"])
    return {k: {name: values.get(k, math.nan) for name, values in series.items()} for k in keys}


def sources_sum(t: dict[str, float]) -> float:
    return sum(t[name] for name, _, _ in prom.TOKEN_SOURCES)


@dataclasses.dataclass
class Observed:
    graph: planned_graph.StartedGraph
    prometheus: prom.Prometheus
    before: dict[str, float]  # source_totals()[""] before the test's traffic
    sent: int  # prompt tokens of the test's requests


@pytest.fixture(scope="module")
def observed(tiny_model: Path, module_procs: ProcessGroup, tmp_path_factory: pytest.TempPathFactory) -> Observed:
    work = tmp_path_factory.mktemp("graph")
    plan = planned_graph.plan(ROOT / "graphs" / "agg.yaml", tiny_model, work)
    graph = planned_graph.start(plan, module_procs)
    # The chart's rules, MaruPoolDown's window shortened as an operator may (poolDownFor; 2m by default).
    p = prom.start_prometheus(plan, module_procs, free_port(), interval_s=1.0, pool_down_for="20s")
    want = {name for targets in prom.scrape_targets(plan).values() for _, name in targets}
    wait_until(lambda: set(p.targets_up()) == want and all(p.targets_up().values()), 30, "every target scraped")
    wait_until(lambda: source_totals(p).get(""), 30, "the workers' prompt token counters in Prometheus")
    before = source_totals(p)[""]

    model = str(tiny_model)
    a, b = sorted(frontend_instances(graph.url))
    shared = token_prompt(41, 3 * CHUNK + 40)
    sent = 0
    # Computed on worker a, which stores its three chunks in the pool ...
    sent += prompt_tokens(completion(graph.url, model, shared, nvext={"backend_instance_id": a}))
    stored_chunks(graph.pool_address(), shared, range(3))
    # ... loaded from the pool by worker b, which never saw it, then served from b's own prefix cache.
    for _ in range(2):
        sent += prompt_tokens(completion(graph.url, model, shared, nvext={"backend_instance_id": b}))
    # Through the router: a prompt sharing two chunks with it, and two that share nothing.
    sent += prompt_tokens(completion(graph.url, model, shared[: 2 * CHUNK] + token_prompt(42, 100)))
    for seed in (43, 44):
        sent += prompt_tokens(completion(graph.url, model, token_prompt(seed, 300)))
    return Observed(graph, p, before, sent)


def test_token_sources_add_up_to_the_prompt_tokens_sent(observed: Observed) -> None:
    p, before = observed.prometheus, observed.before

    def settled() -> dict[str, float] | None:
        now = source_totals(p)[""]
        grown = now["prompt tokens"] - before["prompt tokens"]
        return now if grown == observed.sent and sources_sum(now) == now["prompt tokens"] else None

    now = wait_until(settled, 30, f"{observed.sent} more prompt tokens, all accounted for, in Prometheus", 0.5)
    grown = {k: now[k] - before[k] for k in now}
    print(f"\nprompt tokens sent {observed.sent}: " + ", ".join(f"{k} {v:.0f}" for k, v in grown.items()))
    assert sources_sum(grown) == observed.sent  # 0 unaccounted
    assert grown["pool"] >= 3 * CHUNK  # worker b's first request: three chunks from the pool
    assert grown["local prefix cache"] >= 3 * CHUNK  # its second one: its own prefix cache
    assert grown["computed"] >= len(token_prompt(41, 3 * CHUNK + 40))  # worker a's prefill
    assert grown["tier 2"] == 0  # this graph's pool has no second tier
    assert grown["pool"] + grown["tier 2"] == grown["external"]  # the connector's split of vLLM's count
    # Per worker, since its start (warm-up included), every prompt token has one source.
    per_pod = source_totals(p, "pod")
    assert len(per_pod) == 2, per_pod
    for pod, t in per_pod.items():
        assert sources_sum(t) == t["prompt tokens"], (pod, t)
        assert t["pool"] + t["tier 2"] == t["external"], (pod, t)


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the dashboard, its variables filled in as
    Grafana would for this graph's namespace and the last 10 minutes."""
    fill = {"$namespace": prom.NAMESPACE, "$__rate_interval": "2m", "$__range": "10m"}
    found = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in fill.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{panel['title']}: unfilled variable in {expr}"
            found.append((panel["title"], expr))
    return found


def test_every_dashboard_expression_returns_data(observed: Observed) -> None:
    p = observed.prometheus
    exprs = dashboard_exprs()
    assert len(exprs) >= 20

    def without_data() -> list[tuple[str, str, list]]:
        empty = []
        for title, expr in exprs:
            result = p.query(expr)
            if all(math.isnan(float(s["value"][1])) for s in result):  # no series, or none with a number
                empty.append((title, expr, result))
        return empty

    # A series the last requests created has one sample until the next scrape: rates need two.
    deadline = time.monotonic() + 15
    while (empty := without_data()) and time.monotonic() < deadline:
        time.sleep(1)
    report = [
        f"{title}: {expr} -> {result} (scraped: {[n for n in metric_names(expr) if p.query(f'count({n})')]})"
        for title, expr, result in empty
    ]
    assert not report, "dashboard expressions without data:\n" + "\n".join(report)


def pool_down_alert(p: prom.Prometheus) -> dict | None:
    return next((a for a in p.alerts() if a["labels"].get("alertname") == "MaruPoolDown"), None)


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h)", duration))


def test_a_stopped_pool_raises_its_alert_within_its_window(observed: Observed) -> None:
    p, graph = observed.prometheus, observed.graph
    rules = yaml.safe_load((graph.plan.work_dir / "prometheus" / "rules.yml").read_text())
    rule = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "MaruPoolDown")
    window = seconds(rule["for"])
    assert pool_down_alert(p) is None  # silent while the pool serves

    graph["pool"].stop()
    stopped = time.monotonic()
    wait_until(lambda: not p.targets_up()["pool"], 10, "Prometheus seeing the pool down")
    # The graph serves without its pool meanwhile; the tokens are computed.
    reply = completion(graph.url, graph.model, token_prompt(45, 300))
    assert prompt_tokens(reply) == 300

    pending = wait_until(lambda: pool_down_alert(p), 10, "MaruPoolDown pending")
    assert pending["state"] == "pending", pending
    firing = wait_until(
        lambda: (a := pool_down_alert(p)) is not None and a["state"] == "firing" and a,
        window + 20,
        "MaruPoolDown firing",
        1.0,
    )
    after = time.monotonic() - stopped
    print(f"\nMaruPoolDown fired {after:.1f} s after the pool stopped (for: {rule['for']})")
    assert window <= after <= window + 15
    assert firing["labels"]["severity"] == "critical" and firing["labels"]["pod"] == "pool"
    assert firing["labels"]["job"] == prom.pool_job(graph.plan)
    # Still, every prompt token served has one source.
    t = source_totals(p)[""]
    assert sources_sum(t) == t["prompt tokens"], t
