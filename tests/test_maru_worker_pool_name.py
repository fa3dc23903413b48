"""`maru-dynamo worker` takes the pool's name from the pool service; a wrong --maru-pool-name is refused;
--maru-pool-token-file lets it (connector, name lookup, event relay) into a TCP pool."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from maru_dynamo.components import maru_worker
from maru_vllm.launch import free_port
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


# -- a TCP pool with a token ------------------------------------------------------------------
TOKEN = "w" * 32


@pytest.fixture(scope="module")
def tcp_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PoolProcess, Path]]:
    d = tmp_path_factory.mktemp("tcp-pool")
    token_file = d / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    name = f"tk{uuid.uuid4().hex[:8]}"
    pool = PoolProcess(
        name,
        "8M",
        d / "pool.log",
        listen=[f"tcp://127.0.0.1:{free_port()}"],
        extra_args=["--token-file", str(token_file)],
    )
    try:
        yield pool.serve(), token_file
    finally:
        pool.stop()
        pool.region_path.unlink(missing_ok=True)


def test_the_token_file_reaches_the_connector_config(tmp_path: Path) -> None:
    _, rest = maru_worker.build(
        ["--maru-pool-address", "tcp://127.0.0.1:1", "--maru-pool-token-file", str(tmp_path / "t"), "--model", "m"]
    )
    config = json.loads(rest[rest.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["maru_pool_token_file"] == str(tmp_path / "t")
    _, rest = maru_worker.build(["--maru-pool-address", "tcp://127.0.0.1:1", "--model", "m"])
    assert (
        "maru_pool_token_file"
        not in json.loads(rest[rest.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    )


def test_a_tcp_pool_answers_the_name_lookup_with_the_token(tcp_pool: tuple[PoolProcess, Path]) -> None:
    pool, token_file = tcp_pool
    token = maru_worker.pool_token(str(token_file))
    assert maru_worker.resolve_pool_name(pool.address, None, token=token) == pool.pool_name


@pytest.mark.parametrize("token", [None, "x" * 32], ids=["no-token", "wrong-token"])
def test_a_refusing_pool_stops_the_worker_at_once_in_one_line(tcp_pool: tuple[PoolProcess, Path], token) -> None:
    pool, _ = tcp_pool
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        maru_worker.resolve_pool_name(pool.address, pool.pool_name, token=token, wait_s=20.0)
    msg = str(exc.value.code)
    assert "\n" not in msg and pool.address in msg and "refused" in msg
    assert time.monotonic() - t0 < 10  # no waiting for a pool that answered


def test_an_exposed_token_file_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN)
    f.chmod(0o644)
    with pytest.raises(SystemExit) as exc:
        maru_worker.pool_token(str(f))
    msg = str(exc.value.code)
    assert "\n" not in msg and "--maru-pool-token-file" in msg and "chmod 600" in msg
