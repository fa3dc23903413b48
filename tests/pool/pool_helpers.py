"""Helpers for the pool tests: real service, nats-server and client-worker processes."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")
READY = "maru-pool serving on "


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 10.0) -> int:
    """SIGTERM (or `sig`), then SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


class LineReader:
    """Reads a child's stdout lines on a thread so tests can wait with a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.proc = proc
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line starting with {prefix!r} within {timeout}s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"process exited (rc={self.proc.wait()}) before printing {prefix!r}")
            if line.startswith(prefix):
                return line


@dataclass
class PoolProc:
    name: str
    sock: str
    args: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    address: str = ""
    extra_addresses: list[str] = field(default_factory=list)

    @property
    def region_path(self) -> str:
        return f"/dev/shm/maru-{self.name}"

    def start(self, timeout: float = 30.0) -> PoolProc:
        cmd = [sys.executable, "-m", "maru_vllm.pool", "serve", "--name", self.name, *self.args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=open(self.log, "a"), text=True, cwd=REPO, env=child_env()
        )
        reader = LineReader(self.proc)
        try:
            self.address = reader.wait_for(READY, timeout)[len(READY):]
        except (TimeoutError, RuntimeError) as exc:
            stop_process(self.proc)
            raise AssertionError(f"pool {self.name} did not start: {exc}\n{self.log.read_text()}") from exc
        self.extra_addresses = []
        # further ready lines (extra --listen addresses) arrive right away
        while True:
            try:
                line = reader.lines.get(timeout=0.2)
            except queue.Empty:
                break
            if line and line.startswith(READY):
                self.extra_addresses.append(line[len(READY):])
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        return stop_process(self.proc, sig)

    def restart(self) -> PoolProc:
        self.stop()
        return self.start()

    def logs(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


@dataclass
class NatsProc:
    port: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsProc:
        exe = shutil.which("nats-server")
        if exe is None:
            pytest.skip("nats-server is not on PATH")
        self.proc = subprocess.Popen(
            [exe, "-a", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


def spawn_worker(*args: str) -> tuple[subprocess.Popen, LineReader]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO, env=child_env(),
    )
    return proc, LineReader(proc)


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"):
    """Poll for a state change (a correctness deadline, not a speed requirement)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout}s (last value {last!r})")

