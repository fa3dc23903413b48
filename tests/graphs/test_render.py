"""`maru-dynamo graph render` and the Helm chart in deploy/k8s, checked by the real tools.

The chart is the one source of the Kubernetes objects; `graph render` turns a graph file into
chart values and has the real Helm engine (helm-python-sdk: Helm v4's SDK) render it. Every
rendered object is checked against its real schema (tests/graphs/k8s_schemas.py: the upstream
DynamoGraphDeployment CRD, closed; Kubernetes' strict OpenAPI schemas), and the chart is linted
by Helm. Each validator also gets a negative test, so none of them can pass vacuously.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from maru_dynamo.graphs import helm
from maru_dynamo.graphs.render import RenderOptions, chart_values, render_yaml
from maru_dynamo.graphs.spec import load_graph, parse_graph
from maru_vllm.launch.hash_seed import GRAPH_HASH_SEED
from tests.graphs.k8s_schemas import ManifestError, validate_core, validate_dgd, validate_manifest
from tests.graphs.prom_rules import exported_metric_names, metric_names, validate_prometheus_rule

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "k8s"
CXL_EXAMPLE = CHART / "examples" / "gpu-cxl-values.yaml"
IMAGE = "registry.example/maru-dynamo:0.1.0"


def cli_render(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maru_dynamo.components.main", "graph", "render", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        input=stdin,
    )


def docs_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs}


def components(dgd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in dgd["spec"]["components"]}


def main_container(component: dict[str, Any]) -> dict[str, Any]:
    (main,) = [c for c in component["podTemplate"]["spec"]["containers"] if c["name"] == "main"]
    return main


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def render_values(values: dict[str, Any], release: str = "r", namespace: str = "ns") -> list[dict[str, Any]]:
    return docs_of(helm.template(values, release=release, namespace=namespace))


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, dict[str, Any]]]:
    out = {}
    for graph in ("agg", "disagg"):
        res = cli_render(f"graphs/{graph}.yaml", "--image", IMAGE, "--namespace", "llm")
        assert res.returncode == 0, res.stderr
        docs = docs_of(res.stdout)
        # Helm's install order: the ConfigMap before the pods that read it, the custom resource last.
        assert [d["kind"] for d in docs] == ["ConfigMap", "DaemonSet", "DynamoGraphDeployment"]
        assert all(d["metadata"]["namespace"] == "llm" for d in docs)
        out[graph] = by_kind(docs)
    return out


# -- the objects ----------------------------------------------------------------------------------
def test_every_rendered_object_passes_its_real_schema(rendered: dict[str, Any]) -> None:
    variants = [list(rendered["agg"].values()), list(rendered["disagg"].values())]
    variants.append(
        render_values(
            {
                "image": IMAGE,
                "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
                "nodeSelector": {"maru.io/pool": "true"},
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
            }
        )
    )
    variants.append(
        render_values(
            {
                "image": IMAGE,
                "pool": {
                    "backend": "dax",
                    "path": "/dev/dax0.0",
                    "daxAccess": "devicePlugin",
                    "deviceResource": "example.com/cxl-dax",
                },
            }
        )
    )
    variants.append(render_values({**yaml.safe_load(CXL_EXAMPLE.read_text()), "image": IMAGE}))
    kinds = set()
    for docs in variants:
        for doc in docs:
            validate_manifest(doc)
            kinds.add(doc["kind"])
    assert kinds == {"ConfigMap", "DaemonSet", "DynamoGraphDeployment", "Service", "ServiceMonitor", "PrometheusRule"}


def test_dgd_is_v1beta1_with_typed_components(rendered: dict[str, Any]) -> None:
    agg = rendered["agg"]["DynamoGraphDeployment"]
    assert agg["apiVersion"] == "nvidia.com/v1beta1" and agg["metadata"]["name"] == "maru-agg"
    assert agg["spec"]["backendFramework"] == "vllm"

    def shape(dgd: dict[str, Any]) -> dict[str, tuple[str, int]]:
        return {n: (c["type"], c["replicas"]) for n, c in components(dgd).items()}

    assert shape(agg) == {"Frontend": ("frontend", 1), "worker": ("worker", 2)}
    assert shape(rendered["disagg"]["DynamoGraphDeployment"]) == {
        "Frontend": ("frontend", 1),
        "prefill": ("prefill", 1),
        "decode": ("decode", 1),
    }
    for graph in ("agg", "disagg"):
        for name, comp in components(rendered[graph]["DynamoGraphDeployment"]).items():
            # Our image's tag is maru-dynamo's version: the operator is told the Dynamo runtime's.
            assert comp["runtimeVersionOverride"] == "1.6.1", name
            assert main_container(comp)["image"] == IMAGE


def test_frontend_runs_the_maru_frontend_with_the_kv_router(rendered: dict[str, Any]) -> None:
    main = main_container(components(rendered["agg"]["DynamoGraphDeployment"])["Frontend"])
    assert main["command"] == ["python3", "-m", "maru_dynamo.components.frontend"]
    assert flag(main["args"], "--router-mode") == "kv" and flag(main["args"], "--http-port") == "8000"
    # The pool-tier weight comes from the image (or MARU_POOL_TIER_WEIGHT), not a hard-coded arg.
    assert "--router-host-cache-hit-weight" not in main["args"]
    # So is the request migration limit (the frontend component's default), unless set.
    assert "--migration-limit" not in main["args"]


@pytest.mark.parametrize("limit", [0, 5])
def test_frontend_migration_limit_is_passed_when_set(limit: int) -> None:
    docs = by_kind(render_values({"image": IMAGE, "frontend": {"migrationLimit": limit}}))
    main = main_container(components(docs["DynamoGraphDeployment"])["Frontend"])
    assert flag(main["args"], "--migration-limit") == str(limit)
    with pytest.raises(helm.ChartError, match="migrationLimit"):
        helm.template({"image": IMAGE, "frontend": {"migrationLimit": -1}}, release="r", namespace="ns")


def test_pool_daemonset_and_workers_share_the_region_socket_and_user(rendered: dict[str, Any]) -> None:
    for graph in ("agg", "disagg"):
        ds = rendered[graph]["DaemonSet"]
        pod = ds["spec"]["template"]["spec"]
        assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
        (pool,) = pod["containers"]
        assert pool["command"] == ["python3", "-m", "maru_dynamo.components.pool"]
        assert flag(pool["args"], "--size") == "32G" and flag(pool["args"], "--backend") == "shm"
        assert flag(pool["args"], "--path") == "/dev/shm/maru-kv"
        address = flag(pool["args"], "--listen")
        assert address == "unix:///run/maru/kv.sock"
        assert {v["name"]: v["hostPath"] for v in pod["volumes"]} == {
            "maru-region": {"path": "/dev/shm", "type": "Directory"},
            "maru-socket": {"path": "/run/maru", "type": "DirectoryOrCreate"},
        }
        # The socket directory is handed to the pool's user before the pool starts.
        (init,) = pod["initContainers"]
        assert init["command"][-1] == "/run/maru" and init["securityContext"] == {"runAsUser": 0}
        annotations = ds["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9400"
        for name, comp in components(rendered[graph]["DynamoGraphDeployment"]).items():
            if comp["type"] == "frontend":
                continue
            spec, main = comp["podTemplate"]["spec"], main_container(comp)
            assert spec["volumes"] == pod["volumes"], name
            assert main["volumeMounts"] == pool["volumeMounts"], name
            assert main["securityContext"] == pool["securityContext"] == {"runAsUser": 1000, "runAsGroup": 0}
            assert comp["sharedMemorySize"] == "0", name  # the node's /dev/shm, not a private tmpfs
            assert flag(main["args"], "--maru-pool-address") == address
        config = rendered[graph]["ConfigMap"]["data"]
        assert config["MARU_POOL_ADDRESS"] == address and config["PYTHONHASHSEED"] == GRAPH_HASH_SEED
        assert config["DYN_EVENT_PLANE"] == "nats" and config["NATS_SERVER"] == flag(pool["args"], "--nats")
        assert config["NATS_SERVER"] == "nats://dynamo-platform-nats:4222"  # the Dynamo platform chart's


def test_worker_pods_have_time_to_drain_and_a_restart_id_restarts_in_sequence(rendered: dict[str, Any]) -> None:
    for graph in ("agg", "disagg"):
        dgd = rendered[graph]["DynamoGraphDeployment"]
        assert "restart" not in dgd["spec"]
        for comp in components(dgd).values():
            grace = comp["podTemplate"]["spec"].get("terminationGracePeriodSeconds")
            assert grace == (None if comp["type"] == "frontend" else 60), comp["name"]
        # Dynamo's own variable, read by every worker's signal handler (envFrom the ConfigMap)
        assert rendered[graph]["ConfigMap"]["data"]["DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS"] == "20"
    docs = by_kind(render_values({"image": IMAGE, "restartId": "2026-12-03", "workerShutdown": {"drainSeconds": 5.5}}))
    validate_dgd(docs["DynamoGraphDeployment"])
    assert docs["DynamoGraphDeployment"]["spec"]["restart"] == {"id": "2026-12-03", "strategy": {"type": "Sequential"}}
    assert docs["ConfigMap"]["data"]["DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS"] == "5.5"
    short = {"image": IMAGE, "workerShutdown": {"drainSeconds": 20, "terminationGracePeriodSeconds": 40}}
    with pytest.raises(helm.ChartError) as err:
        helm.template(short, release="r", namespace="ns")
    assert "workerShutdown.terminationGracePeriodSeconds: 40 is too short for drainSeconds 20" in str(err.value)
    with pytest.raises(helm.ChartError, match="drainSeconds"):
        helm.template({"image": IMAGE, "workerShutdown": {"drainSeconds": 31}}, release="r", namespace="ns")


def test_workers_are_scheduled_next_to_a_pool_pod(rendered: dict[str, Any]) -> None:
    pool_labels = rendered["agg"]["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    worker = components(rendered["agg"]["DynamoGraphDeployment"])["worker"]["podTemplate"]["spec"]
    (term,) = worker["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == pool_labels
    # A node selector puts the pool and the workers on the same nodes.
    docs = by_kind(render_values({"image": IMAGE, "nodeSelector": {"maru.io/cxl-dax": "true"}}))
    assert docs["DaemonSet"]["spec"]["template"]["spec"]["nodeSelector"] == {"maru.io/cxl-dax": "true"}
    for comp in components(docs["DynamoGraphDeployment"]).values():
        if comp["type"] != "frontend":
            assert comp["podTemplate"]["spec"]["nodeSelector"] == {"maru.io/cxl-dax": "true"}
    off = by_kind(render_values({"image": IMAGE, "workersNextToPool": False}))
    assert "affinity" not in components(off["DynamoGraphDeployment"])["worker"]["podTemplate"]["spec"]


def test_workers_kv_transfer_args_and_gpus(rendered: dict[str, Any]) -> None:
    expected = {
        "worker": ("agg", "kv_both"),
        "prefill": ("prefill", "kv_both"),
        "decode": ("decode", "kv_both"),
    }
    maru_worker = None
    if importlib.util.find_spec("maru_dynamo.components.maru_worker") is not None:
        from maru_dynamo.components import maru_worker
    for graph in ("agg", "disagg"):
        for name, comp in components(rendered[graph]["DynamoGraphDeployment"]).items():
            if name == "Frontend":
                continue
            main = main_container(comp)
            assert main["command"] == ["python3", "-m", "maru_dynamo.components.maru_worker"]
            args = main["args"]
            mode, role = expected[name]
            assert flag(args, "--model") == "Qwen/Qwen3-0.6B"
            assert flag(args, "--disaggregation-mode") == mode
            assert flag(args, "--maru-pool-name") == "kv" and flag(args, "--maru-chunk-tokens") == "256"
            assert main["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
            assert main["envFrom"] == [{"configMapRef": {"name": f"maru-{graph}-config"}}]
            if maru_worker is not None and hasattr(maru_worker, "build"):
                # What the worker component makes of these args: the connector config vLLM gets.
                _, full = maru_worker.build(list(args))
                kv = json.loads(flag(full, "--kv-transfer-config"))
                assert kv["kv_connector"] == "MaruKVConnector" and kv["kv_role"] == role
                assert kv["kv_connector_extra_config"]["maru_pool_address"] == flag(args, "--maru-pool-address")


def test_render_options_and_errors(tmp_path: Path) -> None:
    res = cli_render("agg", "--image", IMAGE, "--model", "/models/llama", "--nats-url", "nats://nats.llm:4222")
    assert res.returncode == 0, res.stderr
    docs = by_kind(docs_of(res.stdout))
    assert docs["DaemonSet"]["metadata"]["namespace"] == "default"  # as `helm template` without -n
    worker = main_container(components(docs["DynamoGraphDeployment"])["worker"])
    assert flag(worker["args"], "--model") == "/models/llama"
    assert docs["ConfigMap"]["data"]["NATS_SERVER"] == "nats://nats.llm:4222"

    res = cli_render("agg")
    assert res.returncode != 0 and "--image" in res.stderr

    local_only = tmp_path / "local.yaml"
    local_only.write_text("name: local\nmodel: tiny\nworkers: [{name: w}]\n")
    res = cli_render(str(local_only), "--image", IMAGE)
    assert res.returncode != 0
    assert "model 'tiny' is an offline test fixture" in res.stderr and "--model" in res.stderr


def test_values_files_layer_over_the_graph() -> None:
    res = cli_render(
        "disagg",
        "--image",
        IMAGE,
        "-f",
        "/dev/stdin",
        stdin="metrics: {serviceMonitor: {enabled: true}}\nnodeSelector: {pool: 'yes'}\n",
    )
    assert res.returncode == 0, res.stderr
    docs = by_kind(docs_of(res.stdout))
    assert docs["ServiceMonitor"]["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    assert (
        docs["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items()
        <= docs["Service"]["metadata"]["labels"].items()
    )
    assert docs["Service"]["spec"]["selector"] == docs["DaemonSet"]["spec"]["selector"]["matchLabels"]
    # The graph's own settings stay: its worker list, its name.
    assert set(components(docs["DynamoGraphDeployment"])) == {"Frontend", "prefill", "decode"}


def test_numbers_become_whole_command_line_words() -> None:
    """Helm reads values' numbers as floats; 10000000 must still reach vLLM as '10000000', not '1e+07'."""
    spec = parse_graph(
        {
            "name": "g",
            "model": "m",
            "pool": {"size": "1536M", "chunk_tokens": 1000000},
            "workers": [
                {
                    "name": "w",
                    "args": ["--max-model-len", 10000000, "--gpu-memory-utilization", 0.9],
                    "env": {"BIG": 12345678},
                }
            ],
        }
    )
    docs = by_kind(docs_of(render_yaml(spec, RenderOptions(image=IMAGE, values=({"pool": {"size": 1 << 30}},)))))
    assert flag(docs["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]["args"], "--size") == "1073741824"
    main = main_container(components(docs["DynamoGraphDeployment"])["w"])
    assert flag(main["args"], "--max-model-len") == "10000000"
    assert flag(main["args"], "--gpu-memory-utilization") == "0.9"
    assert flag(main["args"], "--maru-chunk-tokens") == "1000000"
    assert main["env"] == [{"name": "BIG", "value": "12345678"}]


def test_dax_pool_mounts_the_device_privileged_or_by_device_plugin() -> None:
    spec = parse_graph(
        {
            "name": "g",
            "model": "m",
            "pool": {"backend": "dax", "path": "/dev/dax0.0", "size": "64G"},
            "frontend": {"pool_tier_weight": 0.6},
            "workers": [{"name": "w", "env": {"A": "1"}}],
        }
    )
    docs = by_kind(docs_of(render_yaml(spec, RenderOptions(image=IMAGE))))
    pool = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert pool["volumes"][0] == {"name": "maru-region", "hostPath": {"path": "/dev/dax0.0", "type": "CharDevice"}}
    assert pool["containers"][0]["securityContext"]["privileged"] is True
    worker = components(docs["DynamoGraphDeployment"])["w"]
    assert main_container(worker)["securityContext"]["privileged"] is True
    assert main_container(worker)["env"] == [{"name": "A", "value": "1"}]
    assert "sharedMemorySize" not in worker  # the operator's tmpfs: the region is not in /dev/shm
    assert docs["ConfigMap"]["data"]["MARU_POOL_TIER_WEIGHT"] == "0.6"

    plugin = by_kind(
        docs_of(
            render_yaml(
                spec,
                RenderOptions(
                    image=IMAGE,
                    values=(
                        {
                            "pool": {"daxAccess": "devicePlugin", "deviceResource": "example.com/cxl-dax"},
                            "sharedMemorySize": "16Gi",
                        },
                    ),
                ),
            )
        )
    )
    pool = plugin["DaemonSet"]["spec"]["template"]["spec"]
    assert [v["name"] for v in pool["volumes"]] == ["maru-socket"]
    assert pool["containers"][0]["resources"] == {"limits": {"example.com/cxl-dax": "1"}}
    assert "privileged" not in pool["containers"][0]["securityContext"]
    worker = components(plugin["DynamoGraphDeployment"])["w"]
    assert main_container(worker)["resources"]["limits"] == {"example.com/cxl-dax": "1", "nvidia.com/gpu": "1"}
    assert worker["sharedMemorySize"] == "16Gi"

    with pytest.raises(helm.ChartError, match=r"pool.path: missing; backend \"dax\""):
        render_yaml(
            parse_graph({"name": "g", "model": "m", "kubernetes": {"pool_backend": "dax"}, "workers": [{"name": "w"}]}),
            RenderOptions(image=IMAGE),
        )


# -- the optional PrometheusRule: the runbook's alerts -------------------------------------------
def alert_rules(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def test_prometheus_rule_is_off_by_default_and_its_alerts_use_only_exported_metrics() -> None:
    assert "PrometheusRule" not in by_kind(render_values({"image": IMAGE}))
    values = {
        "image": IMAGE,
        "pool": {"name": "kv2"},
        "metrics": {
            "serviceMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True, "labels": {"release": "kp"}},
        },
    }
    docs = render_values(values, release="maru", namespace="llm")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    validate_prometheus_rule(rule)
    assert rule["metadata"]["labels"]["release"] == "kp" and rule["metadata"]["namespace"] == "llm"
    exported = exported_metric_names()
    for name, r in alert_rules(docs).items():
        used = metric_names(r["expr"])
        assert used and used <= exported, f"{name}: {sorted(used - exported)} is exported by nothing"
        # Each alert looks at this release's namespace only, and at this release's pool.
        assert 'namespace="llm"' in r["expr"], name
        if any(m.startswith("maru_pool_") for m in used):
            assert all(sel.count('pool="kv2"') for sel in re.findall(r"maru_pool_\w+\{[^}]*\}", r["expr"])), name
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert r["annotations"]["summary"] and "docs/operations.md" in r["annotations"]["description"], name
    assert alert_rules(docs)["MaruPoolDown"]["expr"].startswith('up{namespace="llm", job="maru-pool-metrics"}')
    # The ServiceMonitor's Service names the job; without it that alert would never match anything.
    values["metrics"]["serviceMonitor"]["enabled"] = False
    assert "MaruPoolDown" not in alert_rules(render_values(values, release="maru", namespace="llm"))


def test_the_runbook_documents_exactly_the_charts_alerts() -> None:
    docs = render_values(
        {"image": IMAGE, "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}
    )
    runbook = (ROOT / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"^\| `(Maru[A-Za-z]+)` \|", runbook, re.M))
    assert documented == set(alert_rules(docs))


def test_negative_the_rule_checks_refuse_unknown_metrics_keys_and_durations() -> None:
    with pytest.raises(AssertionError):
        assert metric_names("rate(maru_pool_hit_total[5m]) > 0") <= exported_metric_names()
    with pytest.raises(ValueError, match="unbalanced"):
        metric_names("sum(rate(maru_pool_hits_total[5m]) > 0")
    docs = render_values({"image": IMAGE, "metrics": {"prometheusRule": {"enabled": True}}})
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    validate_prometheus_rule(rule)
    misspelt = json.loads(json.dumps(rule))
    first = misspelt["spec"]["groups"][0]["rules"][0]
    first["exp"] = first.pop("expr")
    with pytest.raises(ManifestError, match="'exp' was unexpected"):
        validate_prometheus_rule(misspelt)
    bad_for = json.loads(json.dumps(rule))
    bad_for["spec"]["groups"][0]["rules"][0]["for"] = "10 minutes"
    with pytest.raises(ManifestError, match="does not match"):
        validate_prometheus_rule(bad_for)


# -- the chart itself: one source, linted by Helm ------------------------------------------------
@pytest.mark.parametrize("graph", ["agg", "disagg"])
def test_chart_defaults_are_the_bundled_graphs(graph: str) -> None:
    """`helm template maru-<graph> deploy/k8s --set image=IMG [--set graph=disagg]` == `graph render`."""
    plain = helm.template({"image": IMAGE, "graph": graph}, release=f"maru-{graph}", namespace="llm")
    ours = render_yaml(load_graph(ROOT / "graphs" / f"{graph}.yaml"), RenderOptions(image=IMAGE, namespace="llm"))
    assert docs_of(plain) == docs_of(ours)
    assert ours.split("\n", 1)[1] == plain.lstrip("\n")  # byte for byte, after graph render's header line


def test_helm_lint_is_clean_for_the_chart_and_the_example() -> None:
    assert helm.lint({"image": IMAGE}) == []
    assert helm.lint({"image": IMAGE, "graph": "disagg"}) == []
    assert helm.lint({**yaml.safe_load(CXL_EXAMPLE.read_text()), "image": IMAGE}) == []
    values = chart_values(load_graph(ROOT / "graphs" / "disagg.yaml"), RenderOptions(image=IMAGE))
    assert helm.lint(values) == []
    alerts = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True, "labels": {"release": "kp"}}}
    assert helm.lint({"image": IMAGE, "metrics": alerts}) == []


def test_negative_broken_template_is_refused_by_helm(tmp_path: Path) -> None:
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    template = chart / "templates" / "configmap.yaml"
    template.write_text(template.read_text() + "  BROKEN: {{ .Values.pool.name | no_such_function }}\n")
    findings = helm.lint({"image": IMAGE}, chart=chart)
    assert any(f.startswith("ERROR") and "no_such_function" in f for f in findings), findings
    with pytest.raises(helm.ChartError, match="no_such_function"):
        helm.template({"image": IMAGE}, release="r", namespace="ns", chart=chart)
    template.write_text("{{ if .Values.image }}\nunclosed: true\n")
    findings = helm.lint({"image": IMAGE}, chart=chart)
    assert any(f.startswith("ERROR") and "configmap.yaml" in f for f in findings), findings


def test_negative_values_outside_the_chart_schema_are_refused() -> None:
    res = cli_render("agg", "--image", IMAGE, "-f", "/dev/stdin", stdin="pool: {sise: 1G}\n")
    assert res.returncode != 0 and "sise" in res.stderr, res.stderr
    with pytest.raises(helm.ChartError, match="graph"):
        helm.template({"image": IMAGE, "graph": "both"}, release="r", namespace="ns")
    with pytest.raises(helm.ChartError, match="image is required"):
        helm.template({}, release="r", namespace="ns")
    bad_mix = {
        "image": IMAGE,
        "graph": "disagg",
        "workers": {"disagg": [{"name": "p", "type": "prefill", "replicas": 1}]},
    }
    with pytest.raises(helm.ChartError, match="at least one prefill and one decode"):
        helm.template(bad_mix, release="r", namespace="ns")
    taken = {"image": IMAGE, "workers": {"agg": [{"name": "frontend", "type": "worker", "replicas": 1}]}}
    with pytest.raises(helm.ChartError, match="taken by the Frontend component"):
        helm.template(taken, release="r", namespace="ns")
    with pytest.raises(helm.ChartError, match=r"pool\.deviceResource: missing"):
        helm.template(
            {"image": IMAGE, "pool": {"backend": "dax", "path": "/dev/dax0.0", "daxAccess": "devicePlugin"}},
            release="r",
            namespace="ns",
        )


# -- the validators refuse what they must --------------------------------------------------------
def test_negative_misspelled_dgd_keys_fail_the_crd_schema(rendered: dict[str, Any]) -> None:
    dgd = rendered["disagg"]["DynamoGraphDeployment"]
    validate_dgd(dgd)

    def misspelt(edit: Any) -> dict[str, Any]:
        doc = json.loads(json.dumps(dgd))
        edit(doc)
        return doc

    cases = {
        "podTemplat": lambda d: d["spec"]["components"][1].__setitem__(
            "podTemplat", d["spec"]["components"][1].pop("podTemplate")
        ),
        "componets": lambda d: d["spec"].__setitem__("componets", d["spec"].pop("components")),
        "volumeMount": lambda d: main_container(d["spec"]["components"][2]).__setitem__(
            "volumeMount", main_container(d["spec"]["components"][2]).pop("volumeMounts")
        ),
        "hostPth": lambda d: d["spec"]["components"][2]["podTemplate"]["spec"]["volumes"][0].__setitem__(
            "hostPth", d["spec"]["components"][2]["podTemplate"]["spec"]["volumes"][0].pop("hostPath")
        ),
    }
    for key, edit in cases.items():
        with pytest.raises(ManifestError, match=f"'{key}' was unexpected"):
            validate_dgd(misspelt(edit))
    with pytest.raises(ManifestError, match="'router' is not one of"):
        validate_dgd(misspelt(lambda d: d["spec"]["components"][0].__setitem__("type", "router")))
    with pytest.raises(ManifestError, match="does not match"):
        validate_dgd(misspelt(lambda d: d["spec"]["components"][1].__setitem__("runtimeVersionOverride", "latest")))


def test_negative_invalid_daemonset_fails_the_kubernetes_schema(rendered: dict[str, Any]) -> None:
    ds = rendered["agg"]["DaemonSet"]
    validate_core(ds)
    bad_port = json.loads(json.dumps(ds))
    bad_port["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "metrics"
    with pytest.raises(ManifestError, match="containerPort: 'metrics' is not of type 'integer'"):
        validate_core(bad_port)
    misspelt = json.loads(json.dumps(ds))
    pod = misspelt["spec"]["template"]["spec"]
    pod["volume"] = pod.pop("volumes")
    with pytest.raises(ManifestError, match="'volume' was unexpected"):
        validate_core(misspelt)
    no_containers = json.loads(json.dumps(ds))
    del no_containers["spec"]["template"]["spec"]["containers"]
    with pytest.raises(ManifestError, match="'containers' is a required property"):
        validate_core(no_containers)


def test_the_chart_ships_in_the_wheel_built_from_the_dockerfiles_inputs(tmp_path: Path) -> None:
    """The wheel built from exactly what deploy/Dockerfile copies holds the whole chart."""
    src = tmp_path / "src"
    copies = re.findall(
        r"^COPY --chown=1000:0 (.+) /tmp/maru-src/(\S*)$", (ROOT / "deploy" / "Dockerfile").read_text(), re.M
    )
    assert copies
    for sources, dest in copies:
        for source in sources.split():
            target = src / dest / Path(source).name if dest.endswith("/") or not dest else src / dest
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / source, target)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    (wheel,) = (tmp_path / "dist").glob("maru_dynamo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    on_disk = {f"maru_dynamo/chart/{p.relative_to(CHART)}" for p in CHART.rglob("*") if p.is_file()}
    assert on_disk <= names, sorted(on_disk - names)
    assert {"maru_dynamo/graphs/render.py", "maru_dynamo/components/pool.py", "maru_dynamo/components/main.py"} <= names
