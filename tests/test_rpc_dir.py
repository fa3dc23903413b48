"""A worker's vLLM IPC socket files live in a directory of its own that does not outlive it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from maru_vllm.launch import rpc_dir

CHILD = """
import os, socket, sys
from pathlib import Path
from maru_vllm.launch.rpc_dir import use_private_rpc_dir
own = use_private_rpc_dir(Path(sys.argv[1]))
s = socket.socket(socket.AF_UNIX)  # what a ZeroMQ ipc:// bind leaves behind
s.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "engine-core-input"))
print(own, flush=True)
if sys.argv[2] == "crash":
    os._exit(1)  # no exit handlers: like SIGKILL
"""


def _run(base: Path, how: str) -> Path:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(base), how],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != rpc_dir.ENV},
        check=False,
    )
    return Path(out.stdout.strip())


def test_a_worker_removes_its_socket_dir_at_exit(tmp_path: Path) -> None:
    own = _run(tmp_path, "exit")
    assert own.parent == tmp_path and own.name.startswith(rpc_dir.PREFIX)
    assert not own.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_crashed_workers_socket_dir_goes_when_the_next_worker_starts(tmp_path: Path) -> None:
    crashed = _run(tmp_path, "crash")
    assert (crashed / "engine-core-input").is_socket()  # left behind by the crash
    unrelated = tmp_path / "maru-rpc-notapid"
    unrelated.mkdir()
    live = tmp_path / f"{rpc_dir.PREFIX}{os.getppid()}"  # a running process's
    live.mkdir()
    nxt = _run(tmp_path, "exit")
    assert not crashed.exists() and not nxt.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([unrelated.name, live.name])


def test_a_base_path_the_user_set_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rpc_dir.ENV, str(tmp_path))
    assert rpc_dir.use_private_rpc_dir(tmp_path) is None
    assert os.environ[rpc_dir.ENV] == str(tmp_path)
    assert list(tmp_path.iterdir()) == []
