"""Fixtures that run real pool services (and nats-server) as separate processes."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from maru_vllm.launch import ProcessGroup
from maru_vllm.launch.stack import PoolProcess


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # short path: unix socket paths are limited to 107 bytes
    d = Path(tempfile.mkdtemp(prefix="mp-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pool_factory(sockdir: Path, procs: ProcessGroup):
    started: list[PoolProcess] = []

    def make(size: str = "64M", extra: list[str] | None = None, start: bool = True) -> PoolProcess:
        name = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
        p = PoolProcess(
            name, size, sockdir / f"{name}.log", listen=[f"unix://{sockdir / name}.sock"], extra_args=extra or []
        )
        started.append(procs.add(p))
        return p.serve() if start else p

    yield make
    procs.stop_all()
    for p in started:
        p.region_path.unlink(missing_ok=True)


@pytest.fixture
def pool(pool_factory) -> PoolProcess:
    return pool_factory()
