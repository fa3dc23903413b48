"""Helpers for the pool tests: client-worker processes that talk to a real pool over stdin/stdout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from maru_vllm.launch.lines import StdoutLines

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def pool_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`maru-dynamo pool ARGS...` in a child process; its exit status and output."""
    return subprocess.run(
        [sys.executable, "-m", "maru_vllm.cli", "pool", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env(),
        timeout=timeout,
    )


def spawn_worker(*args: str) -> tuple[subprocess.Popen, StdoutLines]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=child_env(),
    )
    return proc, StdoutLines(proc)
