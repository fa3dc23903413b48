"""`maru-dynamo graph render` and the Helm chart in deploy/k8s: the Kubernetes objects of a graph."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from maru_dynamo.graphs.render import RenderOptions, render
from maru_dynamo.graphs.spec import GraphSpecError, load_graph, parse_graph
from tests.graphs.gotemplate import TemplateError, render_chart

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "k8s"
IMAGE = "registry.example/maru-dynamo:0.1.0"


def cli_render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "maru_vllm.cli", "graph", "render", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, dict[str, Any]]]:
    out = {}
    for graph in ("agg", "disagg"):
        res = cli_render(f"graphs/{graph}.yaml", "--image", IMAGE, "--namespace", "llm")
        assert res.returncode == 0, res.stderr
        docs = list(yaml.safe_load_all(res.stdout))
        assert [d["kind"] for d in docs] == ["ConfigMap", "DaemonSet", "DynamoGraphDeployment"]
        assert all(d["metadata"]["namespace"] == "llm" for d in docs)
        out[graph] = by_kind(docs)
    return out


def test_dgd_kind_services_and_replicas(rendered: dict[str, Any]) -> None:
    agg = rendered["agg"]["DynamoGraphDeployment"]
    assert agg["apiVersion"] == "nvidia.com/v1alpha1" and agg["metadata"]["name"] == "maru-agg"
    services = agg["spec"]["services"]
    assert {n: (s["componentType"], s.get("subComponentType"), s["replicas"]) for n, s in services.items()} == {
        "Frontend": ("frontend", None, 1), "MaruWorker": ("worker", None, 2)}
    disagg = rendered["disagg"]["DynamoGraphDeployment"]["spec"]["services"]
    assert {n: (s["componentType"], s.get("subComponentType"), s["replicas"]) for n, s in disagg.items()} == {
        "Frontend": ("frontend", None, 1), "MaruPrefillWorker": ("worker", "prefill", 1),
        "MaruDecodeWorker": ("worker", "decode", 1)}


def test_frontend_runs_the_maru_frontend_with_the_kv_router(rendered: dict[str, Any]) -> None:
    main = rendered["agg"]["DynamoGraphDeployment"]["spec"]["services"]["Frontend"]["extraPodSpec"]["mainContainer"]
    assert main["image"] == IMAGE
    assert main["command"] == ["python3", "-m", "maru_dynamo.components.frontend"]
    assert flag(main["args"], "--router-mode") == "kv"
    # The pool-tier weight comes from the image (or MARU_POOL_TIER_WEIGHT), not a hard-coded arg.
    assert "--router-host-cache-hit-weight" not in main["args"]


def test_pool_daemonset_and_workers_share_the_region_and_socket(rendered: dict[str, Any]) -> None:
    for graph in ("agg", "disagg"):
        ds = rendered[graph]["DaemonSet"]
        pod = ds["spec"]["template"]["spec"]
        assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
        pool = pod["containers"][0]
        assert pool["command"] == ["python3", "-m", "maru_dynamo.components.pool"]
        assert flag(pool["args"], "--size") == "32G" and flag(pool["args"], "--backend") == "shm"
        assert flag(pool["args"], "--path") == "/dev/shm/maru-kv"
        address = flag(pool["args"], "--listen")
        assert address == "unix:///run/maru/kv.sock"
        host_paths = {v["name"]: v["hostPath"] for v in pod["volumes"]}
        assert host_paths == {"maru-region": {"path": "/dev/shm", "type": "Directory"},
                              "maru-socket": {"path": "/run/maru", "type": "DirectoryOrCreate"}}
        for name, svc in rendered[graph]["DynamoGraphDeployment"]["spec"]["services"].items():
            if svc["componentType"] != "worker":
                continue
            assert svc["extraPodSpec"]["volumes"] == pod["volumes"], name
            main = svc["extraPodSpec"]["mainContainer"]
            assert main["volumeMounts"] == pool["volumeMounts"], name
            assert svc["sharedMemory"] == {"disabled": True}, name  # host /dev/shm, not a private tmpfs
            assert flag(main["args"], "--maru-pool-address") == address
            socket_dir = Path(address.removeprefix("unix://")).parent
            assert {"name": "maru-socket", "mountPath": str(socket_dir)} in main["volumeMounts"]
        config = rendered[graph]["ConfigMap"]["data"]
        assert config["MARU_POOL_ADDRESS"] == address and config["PYTHONHASHSEED"] == "0"
        assert config["DYN_EVENT_PLANE"] == "nats" and config["NATS_SERVER"] == flag(pool["args"], "--nats")


def test_workers_kv_transfer_args(rendered: dict[str, Any]) -> None:
    expected = {"MaruWorker": ("agg", "kv_both"), "MaruPrefillWorker": ("prefill", "kv_producer"),
                "MaruDecodeWorker": ("decode", "kv_consumer")}
    maru_worker = None
    if importlib.util.find_spec("maru_dynamo.components.maru_worker") is not None:
        from maru_dynamo.components import maru_worker
    for graph in ("agg", "disagg"):
        for name, svc in rendered[graph]["DynamoGraphDeployment"]["spec"]["services"].items():
            if name == "Frontend":
                continue
            main = svc["extraPodSpec"]["mainContainer"]
            assert main["command"] == ["python3", "-m", "maru_dynamo.components.maru_worker"]
            args = main["args"]
            mode, role = expected[name]
            assert flag(args, "--model") == "Qwen/Qwen3-0.6B"
            assert flag(args, "--disaggregation-mode") == mode
            assert flag(args, "--maru-pool-name") == "kv" and flag(args, "--maru-chunk-tokens") == "256"
            assert svc["resources"] == {"limits": {"gpu": "1"}}
            if maru_worker is not None and hasattr(maru_worker, "build"):
                # What the worker component makes of these args: the connector config vLLM gets.
                _, full = maru_worker.build(list(args))
                kv = json.loads(flag(full, "--kv-transfer-config"))
                assert kv["kv_connector"] == "MaruKVConnector" and kv["kv_role"] == role
                assert kv["kv_connector_extra_config"]["maru_pool_address"] == flag(args, "--maru-pool-address")


def test_render_options_and_errors(tmp_path: Path) -> None:
    res = cli_render("agg", "--image", IMAGE, "--model", "/models/llama", "--nats-url", "nats://nats.llm:4222")
    assert res.returncode == 0, res.stderr
    docs = by_kind(list(yaml.safe_load_all(res.stdout)))
    assert "namespace" not in docs["DaemonSet"]["metadata"]
    worker = docs["DynamoGraphDeployment"]["spec"]["services"]["MaruWorker"]["extraPodSpec"]["mainContainer"]
    assert flag(worker["args"], "--model") == "/models/llama"
    assert docs["ConfigMap"]["data"]["NATS_SERVER"] == "nats://nats.llm:4222"

    res = cli_render("agg")
    assert res.returncode != 0 and "--image" in res.stderr

    local_only = tmp_path / "local.yaml"
    local_only.write_text("name: local\nmodel: tiny\nworkers: [{name: w}]\n")
    res = cli_render(str(local_only), "--image", IMAGE)
    assert res.returncode != 0
    assert "model 'tiny' is an offline test fixture" in res.stderr and "--model" in res.stderr


def test_dax_pool_mounts_the_device_privileged() -> None:
    spec = parse_graph({"name": "g", "model": "m", "pool": {"backend": "dax", "path": "/dev/dax0.0", "size": "64G"},
                        "frontend": {"pool_tier_weight": 0.6}, "workers": [{"name": "w", "env": {"A": "1"}}]})
    cm, ds, dgd = render(spec, RenderOptions(image=IMAGE))
    pool = ds["spec"]["template"]["spec"]
    assert pool["volumes"][0] == {"name": "maru-region", "hostPath": {"path": "/dev/dax0.0", "type": "CharDevice"}}
    assert pool["containers"][0]["securityContext"] == {"privileged": True}
    worker = dgd["spec"]["services"]["MaruWWorker"]
    assert worker["extraPodSpec"]["mainContainer"]["securityContext"] == {"privileged": True}
    assert "sharedMemory" not in worker and worker["envs"] == [{"name": "A", "value": "1"}]
    assert cm["data"]["MARU_POOL_TIER_WEIGHT"] == "0.6"
    with pytest.raises(GraphSpecError, match=r"kubernetes.pool_path: missing; backend 'dax'"):
        render(parse_graph({"name": "g", "model": "m", "kubernetes": {"pool_backend": "dax"},
                            "workers": [{"name": "w"}]}), RenderOptions(image=IMAGE))


# -- the Helm chart ---------------------------------------------------------------------------------
HELM_ONLY_LABELS = ("app.kubernetes.io/managed-by", "helm.sh/chart")


def chart_values(**overrides: Any) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values.update(overrides)
    return values


def without_helm_labels(doc: dict[str, Any]) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    labels = doc["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "Helm"
    for key in HELM_ONLY_LABELS:
        labels.pop(key)
    return doc


@pytest.mark.parametrize("graph", ["agg", "disagg"])
def test_chart_renders_what_graph_render_prints(graph: str) -> None:
    chart = render_chart(CHART, chart_values(graph=graph, image=IMAGE), name=f"maru-{graph}", namespace="llm")
    assert sorted(d["kind"] for d in chart) == ["ConfigMap", "DaemonSet", "DynamoGraphDeployment"]
    ours = by_kind(render(load_graph(ROOT / "graphs" / f"{graph}.yaml"), RenderOptions(image=IMAGE, namespace="llm")))
    for doc in chart:
        assert without_helm_labels(doc) == ours[doc["kind"]], doc["kind"]


def test_chart_values_follow_the_graph_files() -> None:
    values = chart_values()
    agg, disagg = load_graph(ROOT / "graphs" / "agg.yaml"), load_graph(ROOT / "graphs" / "disagg.yaml")
    assert values["model"] == agg.kubernetes.model == disagg.kubernetes.model
    assert values["workers"]["agg"]["replicas"] == agg.workers[0].replicas
    assert [values["workers"][r]["replicas"] for r in ("prefill", "decode")] == [w.replicas for w in disagg.workers]
    assert values["pool"]["chunkTokens"] == agg.pool.chunk_tokens
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "maru-dynamo"


def test_chart_dax_pool_and_overrides() -> None:
    values = chart_values(graph="disagg", image=IMAGE, model="/models/m")
    values["pool"].update(backend="dax", path="/dev/dax1.0")
    values["frontend"]["poolTierWeight"] = 0.6
    values["workers"]["decode"].update(replicas=3, args=["--max-model-len", 8192])
    docs = by_kind(render_chart(CHART, values, name="r", namespace="ns"))
    spec = parse_graph({"name": "r", "model": "/models/m", "frontend": {"pool_tier_weight": 0.6},
                        "pool": {"backend": "dax", "path": "/dev/dax1.0", "size": "32G"},
                        "workers": [{"name": "prefill", "role": "prefill"},
                                    {"name": "decode", "role": "decode", "replicas": 3,
                                     "args": ["--max-model-len", 8192]}]})
    ours = by_kind(render(spec, RenderOptions(image=IMAGE, namespace="ns")))
    for kind, doc in docs.items():
        assert without_helm_labels(doc) == ours[kind], kind


def test_chart_refuses_missing_image_and_unknown_graph() -> None:
    with pytest.raises(TemplateError, match="image is required"):
        render_chart(CHART, chart_values(), name="r", namespace="ns")
    with pytest.raises(TemplateError, match='graph: "both" is not allowed; use agg or disagg'):
        render_chart(CHART, chart_values(graph="both", image=IMAGE), name="r", namespace="ns")
