"""A real pool service (with --nats) that tests can restart, and a subscriber for relay output."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from maru_vllm.launch import ProcessGroup
from maru_vllm.launch.stack import PoolProcess
from maru_vllm.pool import PoolClient
from tests.waiting import wait_until


def wait_pool_nats(pool: PoolProcess, timeout: float = 20.0) -> None:
    """Until the pool says it is connected to NATS (its events flow from then on)."""
    with PoolClient.connect(pool.address) as c:
        wait_until(lambda: c.stats().get("nats_connected"), timeout, "pool connected to NATS")


def restart_pool(pool: PoolProcess) -> None:
    """Stop the pool and start it again: a new, empty incarnation, connected to NATS."""
    pool.serve()
    wait_pool_nats(pool)


@pytest.fixture
def pool_service(procs: ProcessGroup, log_dir: Path, nats) -> Iterator[PoolProcess]:
    _, url = nats
    name = f"ev{uuid.uuid4().hex[:8]}"
    pool = PoolProcess(name, "64M", log_dir / "pool.log", listen=[f"unix:///tmp/maru-{name}.sock"], nats=url)
    procs.add(pool)
    pool.serve()
    wait_pool_nats(pool)
    yield pool
    pool.region_path.unlink(missing_ok=True)
