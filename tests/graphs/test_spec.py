"""Graph files: the bundled ones load; bad ones are refused with the field, the value and what is allowed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from maru_dynamo.graphs.spec import GraphSpecError, load_graph, parse_graph, resolve_graph_path
from maru_vllm import routing

ROOT = Path(__file__).resolve().parents[2]
AGG = yaml.safe_load((ROOT / "graphs" / "agg.yaml").read_text())


def test_bundled_agg_graph() -> None:
    spec = load_graph(ROOT / "graphs" / "agg.yaml")
    assert spec.name == "maru-agg" and spec.mode == "agg" and spec.model == "tiny"
    assert [(w.name, w.role, w.replicas) for w in spec.workers] == [("worker", "agg", 2)]
    assert spec.frontend.router_mode == "kv"
    assert spec.pool.backend == "shm" and spec.pool.size == 1 << 30 and spec.pool.chunk_tokens == 256
    assert spec.kubernetes.model == "Qwen/Qwen3-0.6B" and spec.kubernetes.pool_size == 32 << 30


def test_bundled_disagg_graph() -> None:
    spec = load_graph(ROOT / "graphs" / "disagg.yaml")
    assert spec.mode == "disagg"
    assert [(w.name, w.role, w.replicas) for w in spec.workers] == [("prefill", "prefill", 1), ("decode", "decode", 1)]


def test_bundled_graphs_resolve_by_name() -> None:
    assert resolve_graph_path("agg").name == "agg.yaml"
    assert resolve_graph_path("disagg.yaml").name == "disagg.yaml"
    with pytest.raises(GraphSpecError, match=r"no such graph file .*bundled graphs: agg, disagg"):
        resolve_graph_path("nope")


def test_minimal_graph_gets_defaults() -> None:
    spec = parse_graph({"name": "g", "workers": [{"name": "w"}]})
    assert spec.model == "tiny" and spec.pool.name == "kv" and spec.workers[0].role == "agg"
    assert spec.nats.url is None and spec.frontend.pool_tier_weight is None


def test_numbers_in_args_become_words() -> None:
    spec = parse_graph({"name": "g", "workers": [{"name": "w", "args": ["--max-model-len", 2048]}]})
    assert spec.workers[0].args == ("--max-model-len", "2048")


def _with(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(AGG)
    *parents, last = path.split(".")
    node: Any = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


BAD = [
    ("workers.0.role", "both", ["workers[0].role", "'both'", "agg, prefill, decode"]),
    ("workers.0.replicas", 0, ["workers[0].replicas", "0", "integer from 1 to 64"]),
    ("workers.0.replicas", "two", ["workers[0].replicas", "'two'"]),
    ("workers.0.replicas", True, ["workers[0].replicas", "True"]),
    ("workers.0.replica", 2, ["workers[0].replica: unknown field", "allowed fields: name, role, replicas"]),
    ("workers.0.name", "Worker_1", ["workers[0].name", "DNS label"]),
    ("workers.0.args", "--enforce-eager", ["workers[0].args", "list of command-line words"]),
    ("workers.0.args", ["--disaggregation-mode", "prefill"], ["workers[0].args", "set by the graph", "role"]),
    ("workers.0.env", {"1BAD": "x"}, ["workers[0].env", "environment variable names"]),
    ("workers", [], ["workers", "non-empty list"]),
    ("pool.size", "4X", ["pool.size", "'4X'", "512M, 4G"]),
    ("pool.size", 0, ["pool.size", "bytes or a size"]),
    ("pool.backend", "ram", ["pool.backend", "'ram'", "shm, dax, file"]),
    ("pool.backend", "dax", ["pool.path: missing", "'dax' needs a path"]),
    ("pool.name", "a/b", ["pool.name", "'a/b'"]),
    ("pool.colour", "red", ["pool.colour: unknown field", "allowed fields: name, size"]),
    ("frontend.router_mode", "fastest", ["frontend.router_mode", "'fastest'", "kv, round-robin"]),
    ("frontend.pool_tier_weight", 1.5, ["frontend.pool_tier_weight", "1.5", "0.0 to 1.0"]),
    ("nats.url", "127.0.0.1:4222", ["nats.url", "nats://host:port"]),
    ("name", "Maru Agg", ["name", "'Maru Agg'", "DNS label"]),
    ("kubernetes.gpus_per_rank", 2, ["kubernetes.gpus_per_rank", "1 (one GPU per tensor-parallel rank) or 0"]),
    ("kubernetes.socket_dir", "run/maru", ["kubernetes.socket_dir", "absolute"]),
    ("extra", 1, ["extra: unknown field", "allowed fields: name, model, nats"]),
]


@pytest.mark.parametrize(("path", "value", "expected"), BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_bad_values_are_rejected_with_a_clear_message(path: str, value: Any, expected: list[str]) -> None:
    with pytest.raises(GraphSpecError) as info:
        parse_graph(_with(path, value), "graphs/test.yaml")
    msg = str(info.value)
    assert msg.startswith("graphs/test.yaml: "), msg
    for part in expected:
        assert part in msg, msg


def test_missing_required_fields() -> None:
    with pytest.raises(GraphSpecError, match=r"^g.yaml: name: missing; use a lowercase DNS label"):
        parse_graph({"workers": [{"name": "w"}]}, "g.yaml")
    with pytest.raises(GraphSpecError, match=r"workers\[0\].name: missing"):
        parse_graph({"name": "g", "workers": [{"role": "agg"}]}, "g.yaml")
    with pytest.raises(GraphSpecError, match=r"<top level>: invalid value \['x'\]: use a mapping"):
        parse_graph(["x"], "g.yaml")


@pytest.mark.parametrize("roles", [["prefill"], ["decode", "decode"], ["agg", "prefill", "decode"]])
def test_roles_must_make_a_graph(roles: list[str]) -> None:
    workers = [{"name": f"w{i}", "role": r} for i, r in enumerate(roles)]
    with pytest.raises(GraphSpecError, match=r"workers: roles .* do not make a graph: use only 'agg' workers, or"):
        parse_graph({"name": "g", "workers": workers}, "g.yaml")


def test_duplicate_worker_names() -> None:
    with pytest.raises(GraphSpecError, match=r"workers\[1\].name: duplicate worker name 'w'"):
        parse_graph({"name": "g", "workers": [{"name": "w"}, {"name": "w"}]}, "g.yaml")


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(GraphSpecError, match=r"missing.yaml: cannot read the graph file"):
        load_graph(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(GraphSpecError, match=r"bad.yaml: not valid YAML"):
        load_graph(bad)


def test_pool_tier_weight_constant_and_env_override() -> None:
    assert 0.0 <= routing.POOL_TIER_WEIGHT <= 1.0
    assert routing.pool_tier_weight({}) == routing.POOL_TIER_WEIGHT
    assert routing.pool_tier_weight({"MARU_POOL_TIER_WEIGHT": "0.4"}) == 0.4
    for bad in ("1.2", "-0.1", "nan", "lots"):
        with pytest.raises(ValueError, match=r"\$MARU_POOL_TIER_WEIGHT: invalid pool tier weight .*0.0 to 1.0"):
            routing.pool_tier_weight({"MARU_POOL_TIER_WEIGHT": bad})
