"""`maru-dynamo worker` takes the pool's name from the pool service; a wrong --maru-pool-name is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from maru_dynamo.components import maru_worker
from maru_vllm.launch.stack import PoolProcess
from tests.running_pool import running_pool


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolProcess]:
    with running_pool() as pool:
        yield pool


def test_name_is_asked_from_the_pool_when_not_given(pool: PoolProcess) -> None:
    assert maru_worker.resolve_pool_name(pool.address, None) == pool.pool_name


def test_a_matching_name_is_accepted(pool: PoolProcess) -> None:
    assert maru_worker.resolve_pool_name(pool.address, pool.pool_name) == pool.pool_name


def test_a_mismatching_name_is_refused_in_one_line(pool: PoolProcess) -> None:
    with pytest.raises(SystemExit) as exc:
        maru_worker.resolve_pool_name(pool.address, "other")
    msg = str(exc.value.code)
    assert "\n" not in msg
    assert "--maru-pool-name 'other'" in msg and repr(pool.pool_name) in msg and pool.address in msg


def test_no_pool_and_no_name_stops_in_one_line(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/nobody.sock"
    with pytest.raises(SystemExit) as exc:
        maru_worker.resolve_pool_name(address, None, wait_s=1.0)
    msg = str(exc.value.code)
    assert "\n" not in msg and address in msg and "--maru-pool-name" in msg


def test_a_given_name_is_used_while_the_pool_is_down(tmp_path: Path) -> None:
    # The worker serves without the pool; the event relay catches up once the pool is there.
    assert maru_worker.resolve_pool_name(f"unix://{tmp_path}/nobody.sock", "kv") == "kv"


def test_the_flag_is_optional() -> None:
    ours, _ = maru_worker.build(["--maru-pool-address", "unix:///tmp/p.sock", "--model", "m"])
    assert ours.maru_pool_name is None
