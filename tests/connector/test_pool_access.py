"""The connector's typed view of the pool keeps every pool failure away from the engine."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from maru_vllm.connector.pool_access import PoolAccess
from maru_vllm.connector.pool_interface import ConnectorPool
from tests.connector.chunk_meta import chunk_meta
from tests.running_pool import running_pool

NS = "kv:test:access"


def outage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name == "maru_vllm.connector.pool_access"
    ]


def test_every_operation_answers_its_failure_value_while_the_pool_is_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="maru_vllm.connector.pool_access")
    access: ConnectorPool = PoolAccess(f"unix://{tmp_path}/no-pool.sock", None, 1.0, True, "test")
    access.release([None])  # nothing to unpin: nothing is sent, nothing fails
    assert access.lookup_prefix([b"k"], NS) == 0
    assert access.lookup_parts([b"k"], NS) == []
    assert access.acquire([b"k"], NS, verify_payload=False) is None
    assert access.acquire_parts([b"k"], NS) is None
    assert access.reserve([(b"k", 64)], NS) is None
    assert access.region_view is None and not access.available
    assert isinstance(access, PoolAccess) and access.failures == 5
    warnings = outage_warnings(caplog)
    assert len(warnings) == 1 and "unavailable" in warnings[0] and "during lookup_prefix" in warnings[0]
    access.close()


def test_an_outage_is_logged_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="maru_vllm.connector.pool_access")
    with running_pool("8M") as svc:
        access = PoolAccess(svc.address, None, 5.0, True, "test")
        try:
            (res,) = access.reserve([(b"c0", 4096)], NS) or [None]
            assert res is not None
            res.buffer[:] = b"x" * 4096
            assert access.commit([res], [chunk_meta(0)], [[b"c0-part"]]) == [True]
            assert access.lookup_prefix([b"c0", b"c1"], NS) == 1
            assert access.lookup_parts([b"c0-part", b"nope"], NS) == [1, 0]
            pins = access.acquire([b"c0", b"c1"], NS)
            assert pins is not None and pins[1] is None and bytes(pins[0].data) == b"x" * 4096
            access.release(pins)
            assert access.available and not outage_warnings(caplog)

            svc.stop()
            for _ in range(3):
                assert access.lookup_prefix([b"c0"], NS) == 0
            assert not access.available
            svc.serve()
            deadline = time.monotonic() + 30
            while access.lookup_prefix([b"c0"], NS) == 0 and not access.available:
                assert time.monotonic() < deadline, "the pool did not come back"
                time.sleep(0.1)
            warnings = outage_warnings(caplog)
            assert len(warnings) == 2, warnings
            assert "unavailable" in warnings[0] and "is back (test)" in warnings[1]
        finally:
            access.close()
