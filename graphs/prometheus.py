"""A real Prometheus beside a local graph, with the chart's alert rules.

`maru-dynamo graph run GRAPH --prometheus PORT` and the observability e2e start it the same way
(`start_prometheus`): Debian's `prometheus` binary (`make setup` installs it) on 127.0.0.1:PORT,
scraping every process of the graph that serves metrics, each as the chart's Kubernetes
deployment labels it:

| job | targets | series |
|---|---|---|
| `<graph name>-pool-metrics` (the chart's pool Service) | each pool's `--metrics-port` | `maru_pool_*` |
| `maru-worker` | each worker's `DYN_SYSTEM_PORT` | `vllm:*` (the connector's too), `maru_disagg_*` |
| `dynamo-frontend` | the frontend's HTTP port | `dynamo_frontend_*` |

Every target carries `namespace="local"` and `pod=<process name>` (`worker:worker-0`, `pool`,
...), so the chart's PrometheusRule - rendered by the real Helm engine for release `<graph
name>` in namespace `local` - is the rule file, unchanged: the alerts a local graph raises are
the ones a cluster raises. `token_sources_text` reads where a graph's prompt tokens came from
straight off the workers' `/metrics` (no Prometheus needed: `make demo` prints it).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from maru_dynamo.graphs.plan import Plan
from maru_vllm.launch import ManagedProcess, ProcessGroup, stack

PROCESS = "prometheus"  # its name in the graph's process group (and its log's)
NAMESPACE = "local"  # the `namespace` label of every local target (the chart's rules select on it)
WORKER_JOB = "maru-worker"
FRONTEND_JOB = "dynamo-frontend"
READY_TIMEOUT_S = 60.0

# Where each prompt token an engine served came from, as (what to call it, series, `source`):
# vLLM's own counters, and the connector's split of vLLM's `external_kv_transfer`. Their sum is
# `PROMPT_TOKENS`, per engine.
VLLM_SOURCES = "vllm:prompt_tokens_by_source_total"
MARU_SOURCES = "vllm:maru_connector_prompt_tokens_by_source_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
TOKEN_SOURCES: tuple[tuple[str, str, str], ...] = (
    ("computed", VLLM_SOURCES, "local_compute"),
    ("local prefix cache", VLLM_SOURCES, "local_cache_hit"),
    ("pool", MARU_SOURCES, "pool"),
    ("tier 2", MARU_SOURCES, "tier2"),
)
EXTERNAL_SOURCE = "external_kv_transfer"  # vLLM's: the pool's and tier 2's tokens together


class PrometheusUnavailable(RuntimeError):
    """No `prometheus` binary, or the chart's rules cannot be rendered."""


def pool_job(plan: Plan) -> str:
    """The pool's scrape job: the name of the chart's pool metrics Service for release `plan.spec.name`."""
    return f"{plan.spec.name}-pool-metrics"


def _flag_value(argv: Iterable[str], flag: str) -> str | None:
    args = list(argv)
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            return args[i + 1]
    return None


def scrape_targets(plan: Plan) -> dict[str, list[tuple[str, str]]]:
    """job -> [(host:port, pod)] for every process of `plan` that serves metrics."""
    jobs: dict[str, list[tuple[str, str]]] = {pool_job(plan): [], WORKER_JOB: [], FRONTEND_JOB: []}
    for p in plan.processes:
        if p.name == "pool" or p.name.startswith("pool:"):
            port = _flag_value(p.argv, "--metrics-port")
            if port is not None:
                jobs[pool_job(plan)].append((f"{stack.LOOPBACK}:{port}", p.name))
        elif p.metrics_url is not None:
            jobs[WORKER_JOB].append((urllib.parse.urlsplit(p.metrics_url).netloc, p.name))
    jobs[FRONTEND_JOB].append((urllib.parse.urlsplit(plan.url).netloc, "frontend"))
    return {job: targets for job, targets in jobs.items() if targets}


def alert_rules(plan: Plan, pool_down_for: str | None = None) -> dict[str, Any]:
    """The chart's PrometheusRule for this graph (release `plan.spec.name`, namespace `local`),
    as a Prometheus rule file: its `spec` (`groups`); `pool_down_for` sets the chart's
    `metrics.prometheusRule.poolDownFor` (default: the chart's)."""
    from maru_dynamo.graphs import helm

    values: dict[str, Any] = {
        "image": "local",
        "pool": {"name": plan.spec.pool_name_of(None)},
        "metrics": {"prometheusRule": {"enabled": True}, "serviceMonitor": {"enabled": True}},
    }
    if pool_down_for is not None:
        values["metrics"]["prometheusRule"]["poolDownFor"] = pool_down_for
    try:
        manifest = helm.template(values, release=plan.spec.name, namespace=NAMESPACE)
    except (helm.HelmUnavailable, helm.ChartError) as exc:
        raise PrometheusUnavailable(f"cannot render the chart's alert rules: {exc}") from exc
    for doc in yaml.safe_load_all(manifest):
        if isinstance(doc, dict) and doc.get("kind") == "PrometheusRule":
            return {"groups": doc["spec"]["groups"]}
    raise PrometheusUnavailable("the chart rendered no PrometheusRule")


def config(plan: Plan, rule_file: Path, interval_s: float) -> dict[str, Any]:
    """prometheus.yml for `plan`: every target, every `interval_s`, and the rule file."""
    every = f"{max(1, round(interval_s * 1000))}ms"
    return {
        "global": {"scrape_interval": every, "evaluation_interval": every, "scrape_timeout": every},
        "rule_files": [str(rule_file)],
        "scrape_configs": [
            {
                "job_name": job,
                "static_configs": [
                    {"targets": [address], "labels": {"namespace": NAMESPACE, "pod": pod}} for address, pod in targets
                ],
            }
            for job, targets in scrape_targets(plan).items()
        ],
    }


@dataclasses.dataclass
class Prometheus:
    """A Prometheus's HTTP API at `url` (and its process, where `start_prometheus` started it)."""

    url: str
    process: ManagedProcess | None = None

    def query(self, expr: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) `expr` evaluates to now."""
        data = self._get("/api/v1/query", {"query": expr}, timeout)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def value(self, expr: str) -> float | None:
        """`expr`'s single value, or None when it returns no series."""
        found = self.query(expr)
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(f"{expr!r} returned {len(found)} series, not one")
        return float(found[0]["value"][1])

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts pending or firing now (Prometheus' /api/v1/alerts)."""
        return list(self._get("/api/v1/alerts", {}, 10.0)["alerts"])

    def targets_up(self) -> dict[str, bool]:
        """pod -> whether its last scrape succeeded."""
        targets = self._get("/api/v1/targets", {}, 10.0)["activeTargets"]
        return {t["labels"]["pod"]: t["health"] == "up" for t in targets}

    def _get(self, path: str, params: Mapping[str, str], timeout: float) -> Any:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # a bad query: Prometheus says why in the body
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise ValueError(f"Prometheus refused {path} {dict(params)}: {body.get('error', body)}")
        return body["data"]


def start_prometheus(
    plan: Plan,
    group: ProcessGroup,
    port: int,
    *,
    interval_s: float = 5.0,
    work_dir: Path | None = None,
    pool_down_for: str | None = None,
) -> Prometheus:
    """Start Prometheus for `plan` on 127.0.0.1:`port` into `group` (its config, rules, data and
    log under `work_dir`, default the graph's) and wait until it is ready; `pool_down_for`: as
    in `alert_rules`."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise PrometheusUnavailable("no prometheus on PATH: install it (make setup, or apt-get install prometheus)")
    home = (work_dir or plan.work_dir) / "prometheus"
    home.mkdir(parents=True, exist_ok=True)
    rule_file = home / "rules.yml"
    rule_file.write_text(yaml.safe_dump(alert_rules(plan, pool_down_for), sort_keys=False))
    config_file = home / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config(plan, rule_file, interval_s), sort_keys=False))
    argv = [
        binary,
        f"--config.file={config_file}",
        f"--storage.tsdb.path={home / 'data'}",
        f"--web.listen-address={stack.LOOPBACK}:{port}",
        "--storage.tsdb.retention.time=1d",
    ]
    proc = group.start(ManagedProcess(PROCESS, argv, log_path=plan.work_dir / "logs" / f"{PROCESS}.log"))
    url = f"http://{stack.LOOPBACK}:{port}"
    proc.wait_for_http(f"{url}/-/ready", timeout=READY_TIMEOUT_S)
    return Prometheus(url, proc)


def token_sources_text(metrics_texts: Iterable[str]) -> dict[str, float]:
    """Where the prompt tokens came from, summed over engines, from their `/metrics` texts:
    {"prompt tokens": N, "computed": ..., "local prefix cache": ..., "pool": ..., "tier 2": ...}."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"prompt tokens": 0.0, **{name: 0.0 for name, _, _ in TOKEN_SOURCES}}
    wanted = {(series, source): name for name, series, source in TOKEN_SOURCES}
    for text in metrics_texts:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == PROMPT_TOKENS:
                    totals["prompt tokens"] += s.value
                elif (name := wanted.get((s.name, s.labels.get("source", "")))) is not None:
                    totals[name] += s.value
    return totals


def token_sources_line(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    """'N prompt tokens: a computed + b local prefix cache + c pool + d tier 2' between two readings."""
    delta = {k: round(after[k] - before.get(k, 0.0)) for k in after}
    parts = " + ".join(f"{delta[name]} {name}" for name, _, _ in TOKEN_SOURCES)
    return f"{delta['prompt tokens']} prompt tokens: {parts}"
