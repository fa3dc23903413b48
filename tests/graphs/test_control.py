"""The control channel of a running `graph run`: its socket, its requests and their refusals.

The graph here is a plan of the bundled agg graph whose processes are fakes named as such (a
Python process that sleeps, under each process name of the plan); restarting real workers under
load through this channel is tests/e2e/test_restarts_e2e.py.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from maru_dynamo.graphs import control
from maru_dynamo.graphs.plan import Plan, build_plan
from maru_dynamo.graphs.spec import load_graph, resolve_graph_path
from maru_vllm.launch import ManagedProcess, ProcessGroup
from maru_vllm.launch.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
FAKE = "import time; time.sleep(600)"  # stands in for every process of the graph


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Plan, control.ControlServer]]:
    work = tmp_path / "maru-graph-test"
    work.mkdir()
    plan = build_plan(load_graph(resolve_graph_path("agg")), model="/models/fake", work_dir=work)
    group = ProcessGroup()
    for p in plan.processes:
        group.start(ManagedProcess(p.name, [sys.executable, "-c", FAKE], log_path=work / "logs" / f"{p.name}.log"))
    supervisor = Supervisor(group, out=lambda line: None)
    supervisor.poll()  # as graph run's loop does
    server = control.ControlServer(plan, group, supervisor, out=lambda line: None)
    server.start()
    try:
        yield plan, server
    finally:
        server.stop()
        group.stop_all(grace_s=1)


def test_status_names_every_process_and_the_socket_is_the_users_only(
    served: tuple[Plan, control.ControlServer],
) -> None:
    plan, server = served
    mode = server.path.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    done = control.send(plan.work_dir, control.ControlRequest("status"))
    assert done.ok and done.status is not None
    assert list(done.status["processes"]) == [p.name for p in plan.processes]
    assert all(row["serving"] for row in done.status["processes"].values())
    assert done.status["processes"]["worker:worker-0"]["instance"] is None  # not registered (a fake)
    text = control.format_status(done.status)
    assert "worker:worker-0" in text and "no instance yet (not routed to)" in text


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (control.ControlRequest("restart", targets=["bogus"]), "unknown target 'bogus': use one of"),
        (control.ControlRequest("restart"), "nothing to restart: name targets"),
        (control.ControlRequest("restart", targets=["worker-0"], all_workers=True), "give targets or --all, not both"),
        (control.ControlRequest("restart", targets=["worker-0", "worker:worker-0"]), "given twice"),
    ],
)
def test_a_bad_restart_is_refused_in_one_line_and_touches_nothing(
    served: tuple[Plan, control.ControlServer], request_: control.ControlRequest, error: str
) -> None:
    plan, server = served
    pids = {p.name: p.pid for p in server.group}
    done = control.send(plan.work_dir, request_, on_progress=lambda line: None)
    assert not done.ok and done.error is not None and error in done.error and "\n" not in done.error
    assert {p.name: p.pid for p in server.group} == pids


def test_a_malformed_request_and_a_second_restart_are_refused(served: tuple[Plan, control.ControlServer]) -> None:
    plan, server = served
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(server.path))
        sock.sendall(b'{"op": "explode"}\n')
        answer = sock.makefile("rb").readline()
    assert b'"ok":false' in answer and b"bad control request" in answer
    with server._busy:  # a restart is running
        done = control.send(plan.work_dir, control.ControlRequest("restart", targets=["worker-0"]))
    assert not done.ok and done.error == "a restart is already running; try again when it is done"


def test_the_running_graph_is_found_by_its_socket(served: tuple[Plan, control.ControlServer], tmp_path: Path) -> None:
    plan, server = served
    (tmp_path / "maru-graph-stale").mkdir()
    (tmp_path / "maru-graph-stale" / "control.sock").write_text("")  # a file, not a live socket
    assert control.running_graphs(tmp_path) == [plan.work_dir]
    with pytest.raises(control.ControlError, match="no graph runs there"):
        control.find_work_dir(tmp_path / "maru-graph-stale-nothing")
    server.stop()
    assert control.running_graphs(tmp_path) == []


def test_the_cli_refuses_a_restart_without_targets_and_a_missing_graph(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "maru_dynamo.components.main", "graph", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )

    res = cli("restart")
    assert res.returncode == 1
    assert res.stderr.strip() == (
        "maru-dynamo graph restart: error: name the targets (worker-0 ..., frontend) or give --all"
    )
    res = cli("restart", "--all")
    assert res.returncode == 1
    assert res.stderr.strip() == (
        f"maru-dynamo graph restart: error: no running graph found in {tmp_path} "
        "(start one with `maru-dynamo graph run`)"
    )
    res = cli("status", "--work-dir", str(tmp_path))
    assert res.returncode == 1 and "no graph runs there (no control.sock)" in res.stderr
