"""`pool serve --event-loop`: the service works the same on uvloop (the default where installed)
and on asyncio's own loop - peer credentials on unix sockets, round trips, pins - and a bad choice
is one clear line."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from pool_helpers import pool_cli

from maru_vllm.launch.stack import PoolProcess
from maru_vllm.pool import PoolClient


@pytest.mark.parametrize("loop", ["auto", "uvloop", "asyncio"])
def test_the_service_serves_on_each_event_loop(loop: str, sockdir: Path, tmp_path: Path) -> None:
    name = f"el{uuid.uuid4().hex[:8]}"
    pool = PoolProcess(
        name, "8M", tmp_path / "pool.log", listen=[f"unix://{sockdir}/{name}.sock"], extra_args=["--event-loop", loop]
    )
    try:
        pool.serve()
        assert f"event loop {'asyncio' if loop == 'asyncio' else 'uvloop'}" in pool.output()
        with PoolClient.connect(pool.address) as client:
            assert client.put(b"k", b"v" * 4096, namespace="el")
            with client.get(b"k", namespace="el") as data:
                assert data is not None and bytes(data) == b"v" * 4096
            (pin,) = client.acquire([b"k"], "el")
            assert pin is not None and client.stats()["pins"] == 1
            client.release([pin])
            assert client.stats()["pins"] == 0
    finally:
        pool.stop()
        pool.region_path.unlink(missing_ok=True)


def test_an_unknown_event_loop_is_one_clear_line() -> None:
    out = pool_cli("serve", "--name", "x", "--size", "4M", "--event-loop", "trio")
    assert out.returncode == 2
    assert "--event-loop" in out.stderr and "'trio'" in out.stderr and "uvloop" in out.stderr


def test_asking_for_uvloop_where_it_is_missing_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from maru_vllm.pool.cli import event_loop_factory
    from maru_vllm.pool.errors import PoolError

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    with pytest.raises(PoolError) as exc:
        event_loop_factory("uvloop")
    assert "\n" not in str(exc.value) and "uvloop is not installed" in str(exc.value)
    assert event_loop_factory("auto") is None  # auto falls back to asyncio's own loop
    assert event_loop_factory("asyncio") is None
