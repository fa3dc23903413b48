"""A tensor-parallel size per role: graphs/disagg-tp.yaml (prefill TP 1, decode TP 2) as the
local runner plans it, as `graph render` renders it and as `helm template` renders the chart,
each checked with the real Helm engine and the real schemas; bad sizes are refused in one line
that names the field."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from maru_dynamo.graphs import helm
from maru_dynamo.graphs.plan import build_plan
from maru_dynamo.graphs.render import RenderOptions, chart_values, render_yaml
from maru_dynamo.graphs.spec import GraphSpecError, load_graph, parse_graph
from tests.graphs.k8s_schemas import validate_manifest
from tests.graphs.test_cli import cli, command_of, env_of, sections
from tests.graphs.test_render import IMAGE, by_kind, cli_render, components, docs_of, flag, main_container

ROOT = Path(__file__).resolve().parents[2]
GRAPH = ROOT / "graphs" / "disagg-tp.yaml"
# The same graph written as chart values by hand, as a `helm install` user would.
TP_VALUES = {
    "image": IMAGE,
    "graph": "disagg",
    "workers": {
        "disagg": [
            {"name": "prefill", "type": "prefill", "replicas": 1, "tensorParallelSize": 1},
            {"name": "decode", "type": "decode", "replicas": 1, "tensorParallelSize": 2},
        ]
    },
}


def workers_of(manifest: str) -> dict[str, dict[str, Any]]:
    """Worker component name -> its main container, from rendered manifests."""
    dgd = by_kind(docs_of(manifest))["DynamoGraphDeployment"]
    return {n: main_container(c) for n, c in components(dgd).items() if n != "Frontend"}


def tp_and_gpus(container: dict[str, Any]) -> tuple[str, str | None]:
    gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    return flag(container["args"], "--tensor-parallel-size"), gpus


# -- the graph file --------------------------------------------------------------------------------
def test_the_bundled_graph_gives_each_role_its_size() -> None:
    spec = load_graph(GRAPH)
    assert spec.mode == "disagg"
    assert [(w.name, w.role, w.tensor_parallel_size) for w in spec.workers] == [
        ("prefill", "prefill", 1),
        ("decode", "decode", 2),
    ]
    assert parse_graph({"name": "g", "workers": [{"name": "w"}]}).workers[0].tensor_parallel_size == 1


BAD = [
    ({"tensor_parallel_size": 0}, "workers[0].tensor_parallel_size: invalid value 0: use an integer from 1 to 64"),
    ({"tensor_parallel_size": 65}, "workers[0].tensor_parallel_size: invalid value 65"),
    ({"tensor_parallel_size": "2"}, "workers[0].tensor_parallel_size: invalid value '2'"),
    ({"tensor_parallel_size": True}, "workers[0].tensor_parallel_size: invalid value True"),
    (
        {"args": ["--tensor-parallel-size", "2"]},
        "'--tensor-parallel-size' is set by the graph; use tensor_parallel_size",
    ),
    ({"args": ["-tp=2"]}, "'-tp=2' is set by the graph; use tensor_parallel_size instead"),
]


@pytest.mark.parametrize(("fields", "message"), BAD, ids=[str(f) for f, _ in BAD])
def test_bad_sizes_are_refused_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(GraphSpecError) as info:
        parse_graph({"name": "g", "workers": [{"name": "w", **fields}]}, "g.yaml")
    assert str(info.value).startswith("g.yaml: ") and message in str(info.value)
    assert "\n" not in str(info.value)


# -- locally: graph run ----------------------------------------------------------------------------
def test_graph_run_starts_the_decode_worker_with_two_ranks() -> None:
    res = cli("graph", "run", str(GRAPH), "--dry-run")
    assert res.returncode == 0, res.stderr
    procs = sections(res.stdout)
    assert list(procs) == ["nats-server", "pool", "worker:prefill-0", "worker:decode-0", "frontend"]
    prefill, decode = command_of(procs["worker:prefill-0"]), command_of(procs["worker:decode-0"])
    assert "--disaggregation-mode prefill --tensor-parallel-size 1 " in prefill
    assert "--distributed-executor-backend" not in prefill
    assert "--disaggregation-mode decode --tensor-parallel-size 2 --distributed-executor-backend mp " in decode
    # One core per rank: the prefill engine's, then the decode engine's two (round-robin).
    cores = os.cpu_count() or 1
    assert env_of(procs["worker:prefill-0"])["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env_of(procs["worker:decode-0"])["VLLM_CPU_OMP_THREADS_BIND"] == f"{1 % cores}|{2 % cores}"


def test_a_graphs_own_executor_is_kept(tmp_path: Path) -> None:
    spec = parse_graph(
        {
            "name": "g",
            "workers": [{"name": "w", "tensor_parallel_size": 2, "args": ["--distributed-executor-backend=ray"]}],
        }
    )
    (worker,) = build_plan(spec, model="/models/m", work_dir=tmp_path).workers
    assert worker.argv.count("--tensor-parallel-size") == 1
    assert "--distributed-executor-backend=ray" in worker.argv and "mp" not in worker.argv


# -- on Kubernetes: graph render and the chart ------------------------------------------------------
def test_graph_render_sets_each_roles_size_and_gpus() -> None:
    res = cli_render(str(GRAPH), "--image", IMAGE, "--namespace", "llm")
    assert res.returncode == 0, res.stderr
    for doc in docs_of(res.stdout):
        validate_manifest(doc)
    workers = workers_of(res.stdout)
    assert {name: tp_and_gpus(c) for name, c in workers.items()} == {"prefill": ("1", "1"), "decode": ("2", "2")}
    assert flag(workers["decode"]["args"], "--disaggregation-mode") == "decode"
    assert helm.lint(chart_values(load_graph(GRAPH), RenderOptions(image=IMAGE))) == []


def test_helm_template_with_a_size_per_role_equals_graph_render() -> None:
    plain = helm.template(TP_VALUES, release="maru-disagg-tp", namespace="llm")
    ours = render_yaml(load_graph(GRAPH), RenderOptions(image=IMAGE, namespace="llm"))
    assert ours.split("\n", 1)[1] == plain.lstrip("\n")  # byte for byte, after graph render's header line


def test_cpu_nodes_get_the_size_and_no_gpus() -> None:
    spec = load_graph(GRAPH)
    cpu = parse_graph(
        {
            "name": "g",
            "model": "m",
            "workers": [{"name": "w", "tensor_parallel_size": 2}],
            "kubernetes": {"gpus_per_rank": 0},
        }
    )
    assert {n: tp_and_gpus(c) for n, c in workers_of(render_yaml(cpu, RenderOptions(image=IMAGE))).items()} == {
        "w": ("2", None)
    }
    explicit = {**TP_VALUES, "workers": {"disagg": [{**w, "gpus": 0} for w in TP_VALUES["workers"]["disagg"]]}}
    rendered = workers_of(helm.template(explicit, release=spec.name, namespace="llm"))
    assert {n: tp_and_gpus(c) for n, c in rendered.items()} == {"prefill": ("1", None), "decode": ("2", None)}


def _decode(**fields: Any) -> dict[str, Any]:
    prefill, decode = TP_VALUES["workers"]["disagg"]
    return {**TP_VALUES, "workers": {"disagg": [prefill, {**decode, **fields}]}}


CHART_BAD = [
    ({"tensorParallelSize": 0}, r"at '/workers/disagg/1/tensorParallelSize': minimum: got 0, want 1"),
    ({"tensorParallelSize": 65}, r"at '/workers/disagg/1/tensorParallelSize': maximum: got 65, want 64"),
    ({"tensorParallelSize": "2"}, r"at '/workers/disagg/1/tensorParallelSize': got string, want integer"),
    (
        {"tensorParallelSize": 2, "gpus": 3},
        r'workers.disagg: worker "decode": gpus 3 with tensorParallelSize 2; use a multiple of tensorParallelSize',
    ),
    (
        {"args": ["--tensor-parallel-size=4"]},
        r'workers.disagg: worker "decode": args: --tensor-parallel-size is set by tensorParallelSize',
    ),
]


@pytest.mark.parametrize(("fields", "line"), CHART_BAD, ids=[str(f) for f, _ in CHART_BAD])
def test_the_chart_refuses_bad_sizes_in_one_line(fields: dict[str, Any], line: str) -> None:
    with pytest.raises(helm.ChartError) as info:
        helm.template(_decode(**fields), release="r", namespace="ns")
    assert any(line in text for text in str(info.value).splitlines()), str(info.value)


def test_gpus_for_more_than_the_ranks_are_a_multiple_of_them() -> None:
    """Pipeline parallelism in `args` needs TP x PP GPUs: any multiple of the size is taken as given."""
    rendered = workers_of(
        helm.template(_decode(gpus=4, args=["--pipeline-parallel-size", 2]), release="r", namespace="ns")
    )
    assert tp_and_gpus(rendered["decode"]) == ("2", "4")
