"""Fixtures that run real pool services (and nats-server) as separate processes."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pool_helpers import NatsProc, PoolProc, free_port, stop_process


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # short path: unix socket paths are limited to 107 bytes
    d = Path(tempfile.mkdtemp(prefix="mp-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pool_factory(sockdir: Path):
    started: list[PoolProc] = []

    def make(size: str = "64M", extra: list[str] | None = None, start: bool = True) -> PoolProc:
        name = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
        sock = str(sockdir / f"{name}.sock")
        p = PoolProc(
            name, sock, ["--size", size, "--listen", f"unix://{sock}", *(extra or [])], sockdir / f"{name}.log"
        )
        started.append(p)
        return p.start() if start else p

    yield make
    for p in started:
        if p.proc is not None:
            stop_process(p.proc)
        Path(p.region_path).unlink(missing_ok=True)


@pytest.fixture
def pool(pool_factory) -> PoolProc:
    return pool_factory()


@pytest.fixture
def nats_server() -> Iterator[NatsProc]:
    n = NatsProc(free_port()).start()
    yield n
    n.stop()
