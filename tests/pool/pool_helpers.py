"""Helpers for the pool tests: client-worker processes that talk to a real pool over stdin/stdout,
and a pool service run in this process (for tests that reach into it)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
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
        [sys.executable, "-m", "maru_dynamo.components.main", "pool", *args],
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


@contextlib.contextmanager
def service_in_process(name: str, address: str) -> Iterator[tuple[object, threading.Thread]]:
    """A real `PoolService` of 4 MiB listening on `address`, its event loop on a thread of this
    process; yields (service, loop thread) and stops it (region removed) on exit."""
    from maru_vllm.pool.service import PoolService, ServiceConfig

    svc = PoolService(ServiceConfig(name=name, size=4 << 20, listen=[address], metrics_port=0))
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(svc.start())
        started.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert started.wait(30), "the in-process pool service did not start"
        yield svc, t
    finally:
        asyncio.run_coroutine_threadsafe(svc.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)
        Path(f"/dev/shm/maru-{name}").unlink(missing_ok=True)
