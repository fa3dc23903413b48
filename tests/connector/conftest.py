"""A real pool service per test module, and a client of it per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from maru_vllm.launch.stack import PoolProcess
from maru_vllm.pool import PoolClient
from tests.running_pool import running_pool


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolProcess]:
    with running_pool("128M") as pool:
        yield pool


@pytest.fixture
def client(pool: PoolProcess) -> Iterator[PoolClient]:
    c = PoolClient(pool.address, timeout=5.0)
    yield c
    c.close()
