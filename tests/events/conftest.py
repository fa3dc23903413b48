"""A real pool service (with --nats) that tests can restart, and a subscriber for relay output."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from maru_vllm.launch import ManagedProcess, ProcessGroup


class PoolService:
    def __init__(self, procs: ProcessGroup, log_dir: Path, nats_url: str, size: str = "64M") -> None:
        self.name = f"ev{uuid.uuid4().hex[:8]}"
        self.sock = f"/tmp/maru-{self.name}.sock"
        self.address = f"unix://{self.sock}"
        self.procs, self.log_dir, self.nats_url, self.size = procs, log_dir, nats_url, size
        self.proc: ManagedProcess | None = None
        self.starts = 0

    def start(self) -> PoolService:
        self.starts += 1
        self.proc = ManagedProcess(
            f"pool-{self.starts}",
            [sys.executable, "-m", "maru_vllm.pool", "serve", "--name", self.name, "--size", self.size,
             "--listen", self.address, "--nats", self.nats_url],
            log_path=self.log_dir / f"pool-{self.starts}.log",
        )
        self.procs.start(self.proc)
        self.proc.wait_for_log(r"maru-pool serving on", timeout=60)
        return self

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.stop()

    def restart(self) -> PoolService:
        self.stop()
        return self.start()

    def client(self):
        from maru_vllm.pool import PoolClient

        return PoolClient.connect(self.address)

    def wait_nats(self, timeout: float = 20.0) -> None:
        with self.client() as c:
            wait_for(lambda: c.stats().get("nats_connected"), timeout, "pool connected to NATS")


def wait_for(pred, timeout: float = 20.0, what: str = "condition", interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout}s (last: {last!r})")


@pytest.fixture
def pool_service(procs: ProcessGroup, log_dir: Path, nats) -> Iterator[PoolService]:
    _, url = nats
    svc = PoolService(procs, log_dir, url).start()
    svc.wait_nats()
    yield svc
    Path(f"/dev/shm/maru-{svc.name}").unlink(missing_ok=True)
