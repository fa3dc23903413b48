"""The CLI of the graph layer: `graph run --dry-run`, `frontend`, the pool component."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from maru_dynamo.components.frontend import build_argv
from maru_vllm.launch import stack
from maru_vllm.launch.hash_seed import GRAPH_HASH_SEED
from maru_vllm.pool.service import READY_LINE
from maru_vllm.routing import POOL_TIER_WEIGHT

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maru_dynamo.components.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def sections(dry_run: str) -> dict[str, list[str]]:
    """'[name]' blocks of the dry-run output -> their lines."""
    out: dict[str, list[str]] = {}
    current = None
    for line in dry_run.splitlines():
        m = re.match(r"^\[(.+)\]$", line)
        if m:
            current = m.group(1)
            out[current] = []
        elif current and line:
            out[current].append(line)
    return out


def env_of(lines: list[str]) -> dict[str, str]:
    return dict(line.removeprefix("env: ").split("=", 1) for line in lines if line.startswith("env: "))


def command_of(lines: list[str]) -> str:
    return next(line.removeprefix("command: ") for line in lines if line.startswith("command: "))


def test_help_lists_the_graph_commands() -> None:
    res = cli("--help")
    assert res.returncode == 0, res.stderr
    for command in ("graph", "frontend", "worker", "pool"):
        assert re.search(rf"^\s+{command}\s", res.stdout, re.M), res.stdout


def test_dry_run_lists_every_process_on_loopback() -> None:
    res = cli("graph", "run", "graphs/agg.yaml", "--dry-run", "--http-port", "18080")
    assert res.returncode == 0, res.stderr
    procs = sections(res.stdout)
    assert list(procs) == ["nats-server", "pool", "worker:worker-0", "worker:worker-1", "frontend"]
    assert "# url http://127.0.0.1:18080" in res.stdout

    # Every address anywhere in the commands and environments is the loopback one.
    addresses = set(re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", res.stdout))
    assert addresses == {"127.0.0.1"}, addresses
    assert "0.0.0.0" not in res.stdout and "localhost" not in res.stdout

    nats_cmd = command_of(procs["nats-server"])
    nats_port = re.search(r"-a 127\.0\.0\.1 -p (\d+)", nats_cmd).group(1)
    pool_cmd = command_of(procs["pool"])
    assert "-m maru_dynamo.components.pool --name kv --size 1073741824 --backend shm" in pool_cmd
    assert f"--nats nats://127.0.0.1:{nats_port}" in pool_cmd
    socket = re.search(r"--listen (unix://\S+)", pool_cmd).group(1)

    fe_cmd = command_of(procs["frontend"])
    assert "-m maru_dynamo.components.frontend --http-host 127.0.0.1 --http-port 18080 --router-mode kv" in fe_cmd
    assert f"--router-host-cache-hit-weight {POOL_TIER_WEIGHT!r}" in fe_cmd

    binds = []
    discovery = set()
    for name in ("worker:worker-0", "worker:worker-1"):
        cmd, env = command_of(procs[name]), env_of(procs[name])
        assert "-m maru_dynamo.components.maru_worker --model " in cmd
        assert f"--maru-pool-address {socket} --maru-pool-name kv" in cmd and "--disaggregation-mode agg" in cmd
        binds.append(env["VLLM_CPU_OMP_THREADS_BIND"])
        discovery.add(env["DYN_FILE_KV"])
    assert binds == ["0", str(1 % (os.cpu_count() or 1))]  # round-robin over the cores
    # Two CPU engines on fewer than four cores: each worker's whole process tree stays on its engine's core.
    pinned = [
        next((line.removeprefix("cpus: ") for line in procs[n] if line.startswith("cpus: ")), None)
        for n in ("worker:worker-0", "worker:worker-1")
    ]
    assert pinned == (binds if stack.cpu_engines() and len(os.sched_getaffinity(0)) < 4 else [None, None])
    assert not any(line.startswith("cpus: ") for n in ("pool", "frontend") for line in procs[n])

    for name in ("pool", "worker:worker-0", "worker:worker-1", "frontend"):
        env = env_of(procs[name])
        assert env.get("PYTHONHASHSEED", os.environ.get("PYTHONHASHSEED")) == GRAPH_HASH_SEED, name
        assert env["DYN_EVENT_PLANE"] == "nats" and env["NATS_SERVER"] == f"nats://127.0.0.1:{nats_port}", name
        assert env["DYN_DISCOVERY_BACKEND"] == "file", name
        discovery.add(env["DYN_FILE_KV"])
        for key in ("DYN_HTTP_HOST", "DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_TCP_RESPONSE_STREAM_HOST"):
            assert env[key] == "127.0.0.1", (name, key)
    assert len(discovery) == 1 and Path(discovery.pop()).parent.name.startswith("maru-graph-")


def test_dry_run_disagg_and_model_override() -> None:
    res = cli("graph", "run", "disagg", "--dry-run", "--model", "/models/other")
    assert res.returncode == 0, res.stderr
    procs = sections(res.stdout)
    assert list(procs) == ["nats-server", "pool", "worker:prefill-0", "worker:decode-0", "frontend"]
    assert "--model /models/other" in command_of(procs["worker:prefill-0"])
    assert "--disaggregation-mode prefill" in command_of(procs["worker:prefill-0"])
    assert "--disaggregation-mode decode" in command_of(procs["worker:decode-0"])


def test_graph_run_reports_bad_graphs(tmp_path: Path) -> None:
    res = cli("graph", "run", "graphs/nope.yaml", "--dry-run")
    assert res.returncode != 0 and "graphs/nope.yaml: no such graph file" in res.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: g\nworkers: [{name: w, role: both}]\n")
    res = cli("graph", "run", str(bad), "--dry-run")
    assert res.returncode != 0
    assert "workers[0].role: invalid value 'both': use one of agg, prefill, decode" in res.stderr


def test_frontend_help_passes_through_to_dynamo() -> None:
    res = cli("frontend", "--help")
    assert res.returncode == 0, res.stderr
    assert "--router-host-cache-hit-weight" in res.stdout and "--router-mode" in res.stdout
    assert "Dynamo Frontend" in res.stdout


def test_frontend_adds_kv_router_pool_weight_and_migration_unless_given() -> None:
    assert build_argv(["--http-port", "9000"], {}) == [
        "--http-port",
        "9000",
        "--router-mode",
        "kv",
        "--router-host-cache-hit-weight",
        repr(POOL_TIER_WEIGHT),
        "--migration-limit",
        "3",
    ]
    assert build_argv(["--router-mode=round-robin", "--migration-limit=0"], {"MARU_POOL_TIER_WEIGHT": "0.5"}) == [
        "--router-mode=round-robin",
        "--migration-limit=0",
        "--router-host-cache-hit-weight",
        "0.5",
    ]
    given = ["--router-mode", "random", "--router-host-cache-hit-weight", "0.1", "--migration-limit", "1"]
    assert build_argv(given, {"MARU_POOL_TIER_WEIGHT": "0.5"}) == given
    # Dynamo's own variables count as the user's choice.
    dyn_env = {"DYN_ROUTER_MODE": "random", "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT": "0.2", "DYN_MIGRATION_LIMIT": "0"}
    assert build_argv([], dyn_env) == []


def test_frontend_rejects_a_bad_weight() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "maru_dynamo.components.frontend"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MARU_POOL_TIER_WEIGHT": "2"},
    )
    assert res.returncode != 0
    assert "$MARU_POOL_TIER_WEIGHT: invalid pool tier weight '2': use a number from 0.0 to 1.0" in res.stderr


def test_pool_component_serves_and_stops(tmp_path: Path) -> None:
    sock = tmp_path / "p.sock"
    region = f"/dev/shm/maru-test-component-{os.getpid()}"
    log = open(tmp_path / "pool.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "maru_dynamo.components.pool",
            "serve",
            "--name",
            "comp",
            "--size",
            "8M",
            "--path",
            region,
            "--listen",
            f"unix://{sock}",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    log.close()
    try:
        line = proc.stdout.readline()
        assert line.strip() == READY_LINE.format(address=f"unix://{sock}"), (tmp_path / "pool.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not Path(region).exists() and not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        Path(region).unlink(missing_ok=True)  # a killed pool leaves its region behind


def test_pool_component_rejects_bad_options() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "maru_dynamo.components.pool", "--name", "x", "--size", "4X"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "maru-dynamo pool serve: error: argument --size: invalid size '4X'" in res.stderr


@pytest.mark.parametrize("command", ["frontend", "worker"])
def test_components_are_listed_with_help_text(command: str) -> None:
    res = cli("--help")
    assert re.search(rf"{command}\s+\S", res.stdout)


def test_worker_passes_arguments_to_the_maru_worker_component() -> None:
    if not (ROOT / "components" / "maru_worker.py").exists():
        pytest.skip("components/maru_worker.py is not there yet")
    res = cli("worker", "--model", "m")  # no pool address: the component itself refuses
    assert res.returncode != 0
    assert "--maru-pool-address" in res.stderr, res.stderr
