"""Shared fixtures: the offline model, a log folder per test, nats-server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from maru_vllm.launch import ManagedProcess, ProcessGroup, stack
from tests.cleanup import stop_leaving_nothing


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from maru_vllm.fixtures.models import ensure_model

    return ensure_model("tiny")


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    d.mkdir()
    return d


@pytest.fixture
def procs(request: pytest.FixtureRequest) -> Iterator[ProcessGroup]:
    """Processes of one test; their log tails are printed when the test fails."""
    group = ProcessGroup()
    yield group
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print("\n" + group.log_tails(60))
    stop_leaving_nothing(group)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]


@pytest.fixture
def nats(procs: ProcessGroup, log_dir: Path) -> tuple[ManagedProcess, str]:
    """A real nats-server on a free loopback port: (process, url)."""
    proc, url = stack.nats_server(log_dir)
    procs.start(proc)
    proc.wait_for_log(stack.NATS_READY_PATTERN, timeout=30)
    return proc, url


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # MARU_SKIP_E2E=1 runs only the fast tests (handy while editing); CI never sets it.
    if os.environ.get("MARU_SKIP_E2E") == "1":
        skip = pytest.mark.skip(reason="MARU_SKIP_E2E=1")
        for item in items:
            if "e2e" in item.keywords:
                item.add_marker(skip)
