"""Graphs with a second tier: the `mooncake:` section and `domains`, run locally (dry run) and
rendered for Kubernetes by the real Helm engine, every object checked against its schema."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from maru_dynamo.graphs import helm
from maru_dynamo.graphs.render import RenderOptions, chart_values
from maru_dynamo.graphs.spec import GraphSpecError, load_graph, parse_graph
from tests.graphs.k8s_schemas import validate_manifest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "registry.example/maru-dynamo:0.1.0"


def _sections(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"^\[(.+)\]$", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name is not None and line:
            out[name].append(line)
    return out


def _command(lines: list[str]) -> str:
    return next(line.removeprefix("command: ") for line in lines if line.startswith("command: "))


def test_domains_graph_runs_a_master_a_pool_per_domain_and_each_worker_on_its_domains_pool() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "maru_dynamo.components.main", "graph", "run", "domains", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    procs = _sections(res.stdout)
    assert list(procs) == [
        "nats-server",
        "mooncake-master",
        "pool:a",
        "pool:b",
        "worker:worker-a-0",
        "worker:worker-b-0",
        "frontend",
    ]
    master = _command(procs["mooncake-master"])
    rpc = re.search(r"--rpc_port=(\d+)", master).group(1)
    http = re.search(r"--http_metadata_server_port=(\d+)", master).group(1)
    assert "--rpc_address=127.0.0.1" in master and "--http_metadata_server_host=127.0.0.1" in master
    sockets = {}
    for d in "ab":
        pool = _command(procs[f"pool:{d}"])
        assert f"--name kv-{d} " in pool
        assert f"--mooncake-master 127.0.0.1:{rpc}" in pool
        assert f"--mooncake-metadata http://127.0.0.1:{http}/metadata" in pool
        sockets[d] = re.search(r"--listen (unix://\S+)", pool).group(1)
    assert sockets["a"] != sockets["b"]
    for d in "ab":
        worker = _command(procs[f"worker:worker-{d}-0"])
        assert f"--maru-pool-address {sockets[d]} --maru-pool-name kv-{d}" in worker


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"domains": ["a"], "workers": [{"name": "w"}]}, "workers[0].domain: none is not a domain of this graph"),
        ({"workers": [{"name": "w", "domain": "a"}]}, "workers[0].domain: the graph has no `domains`"),
        ({"domains": ["a", "a"], "workers": [{"name": "w"}]}, "domains: invalid value ['a', 'a']"),
        ({"mooncake": {"master": "nohost"}, "workers": [{"name": "w"}]}, "mooncake.master: invalid value 'nohost'"),
        ({"mooncake": {"protocol": "udp"}, "workers": [{"name": "w"}]}, "mooncake.protocol: invalid value 'udp'"),
        ({"mooncake": {"segment_size": "4X"}, "workers": [{"name": "w"}]}, "mooncake.segment_size: invalid value"),
        ({"mooncake": {"masters": "h:1"}, "workers": [{"name": "w"}]}, "mooncake.masters: unknown field"),
    ],
)
def test_bad_tier_and_domain_fields_are_one_line_naming_the_field(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(GraphSpecError) as err:
        parse_graph({"name": "g", **doc})
    assert message in str(err.value) and "\n" not in str(err.value)


def _render(spec_doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    spec = parse_graph({"name": "maru-t2", "model": "Qwen/Qwen3-0.6B", "workers": [{"name": "w"}], **spec_doc})
    docs = [
        d
        for d in yaml.safe_load_all(
            helm.template(chart_values(spec, RenderOptions(image=IMAGE)), release="maru-t2", namespace="llm")
        )
        if d
    ]
    for d in docs:
        validate_manifest(d)
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _pool_args(objs: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    ds = objs[("DaemonSet", "maru-t2-pool")]
    (pool,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "pool"]
    return pool["args"]


def test_render_runs_the_master_as_a_deployment_and_service_and_points_every_pool_at_it() -> None:
    objs = _render({"mooncake": {}})
    master = objs[("Deployment", "maru-t2-mooncake")]
    service = objs[("Service", "maru-t2-mooncake")]
    assert master["spec"]["replicas"] == 1 and master["spec"]["strategy"]["type"] == "Recreate"
    assert {p["name"] for p in service["spec"]["ports"]} == {"rpc", "metadata", "metrics"}
    args = _pool_args(objs)
    assert args[args.index("--mooncake-master") + 1] == "maru-t2-mooncake.llm.svc:50051"
    assert args[args.index("--mooncake-metadata") + 1] == "http://maru-t2-mooncake.llm.svc:8080/metadata"
    assert args[args.index("--mooncake-host") + 1] == "$(POD_IP)"


def test_render_with_an_existing_master_runs_none_and_without_a_tier_passes_nothing() -> None:
    objs = _render({"mooncake": {"master": "mooncake.infra:50051"}})
    assert not any(kind == "Deployment" for kind, _ in objs)
    args = _pool_args(objs)
    assert args[args.index("--mooncake-master") + 1] == "mooncake.infra:50051"
    assert "--mooncake-metadata" not in args  # the pool's default: the master's built-in server
    assert not any(a.startswith("--mooncake") for a in _pool_args(_render({})))


def test_the_bundled_domains_graph_is_valid() -> None:
    spec = load_graph(ROOT / "graphs" / "domains.yaml")
    assert spec.domains == ("a", "b") and spec.mooncake is not None and spec.mooncake.master is None
    assert [spec.pool_name_of(w.domain) for w in spec.workers] == ["kv-a", "kv-b"]
