"""A stopping worker drains before it migrates, through Dynamo's own signal handler; it records
its instance id as it registers.

Dynamo's real `install_signal_handlers` runs here on a real SIGTERM to this process. What it
acts on are stand-ins, named as such: `FakeEngine` for vLLM's AsyncLLM (only its count of
unfinished requests), `FakeEndpoint` for Dynamo's Endpoint, `FakeRuntime` for its runtime. The
real worker's stop, under load, is in tests/e2e/test_restarts_e2e.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from maru_dynamo.components.dynamo_hooks import install_worker_lifecycle
from maru_vllm.launch.lifecycle import (
    DEFAULT_GRACE_S,
    WorkerLifecycle,
    grace_seconds,
    read_instance_file,
)


@pytest.fixture
def dynamo_main():  # type: ignore[no-untyped-def]
    """dynamo.vllm.main as the worker imports it; the hooked attributes restored after."""
    from maru_dynamo.components.text_only import install_text_only_stand_ins

    install_text_only_stand_ins()
    import dynamo.vllm.main as dm
    from dynamo.common.utils import graceful_shutdown

    saved = (dm.install_signal_handlers, dm.register_vllm_model)
    graceful_shutdown._shutdown_started.clear()  # Dynamo shuts a process down once
    yield dm
    dm.install_signal_handlers, dm.register_vllm_model = saved
    graceful_shutdown._shutdown_started.clear()


class FakeEngine:
    """Stands in for vLLM's AsyncLLM: `running` requests, which finish `finish_s` after it is
    first asked for its count (the stop's first look)."""

    def __init__(self, running: int, finish_s: float) -> None:
        self.running, self.finish_s = running, finish_s
        self.done_at: float | None = None

    def get_num_unfinished_requests(self) -> int:
        if self.done_at is None:
            self.done_at = time.monotonic() + self.finish_s
        return 0 if time.monotonic() >= self.done_at else self.running


class FakeEndpoint:
    """Stands in for Dynamo's Endpoint: a connection id, and unregistering from discovery."""

    def __init__(self, events: list[tuple[str, float]]) -> None:
        self.events = events

    def connection_id(self) -> int:
        return 0x75223865412C9966

    async def unregister_endpoint_instance(self) -> None:
        self.events.append(("unregistered", time.monotonic()))


class FakeRuntime:
    """Stands in for Dynamo's DistributedRuntime: records its shutdown."""

    def __init__(self, events: list[tuple[str, float]]) -> None:
        self.events = events
        self.down = asyncio.Event()

    def shutdown(self) -> None:
        self.events.append(("runtime shutdown", time.monotonic()))
        self.down.set()


def test_the_grace_period_is_dynamos_variable_and_a_bad_value_is_one_line() -> None:
    assert grace_seconds({}) == DEFAULT_GRACE_S
    assert grace_seconds({"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0"}) == 0.0
    assert grace_seconds({"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": " 12.5 "}) == 12.5
    for bad in ("-1", "31", "soon", "nan"):
        with pytest.raises(ValueError) as err:
            grace_seconds({"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": bad})
        assert str(err.value).startswith(f"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS={bad!r}: use seconds from 0 to 30")
        assert "\n" not in str(err.value)


def _stop_with_sigterm(dm: Any, lifecycle: WorkerLifecycle, engine: FakeEngine) -> list[tuple[str, float]]:
    """Register a worker, install Dynamo's handler as dynamo.vllm does, SIGTERM this process."""
    events: list[tuple[str, float]] = []

    async def registered(  # the shape of dynamo.vllm.main.register_vllm_model (ai-dynamo 1.6.1)
        model_input: Any,
        model_type: Any,
        generate_endpoint: Any,
        config: Any,
        engine_client: Any,
        vllm_config: Any,
        worker_type: Any,
        needs: Any = None,
    ) -> None:
        events.append(("registered", time.monotonic()))

    dm.register_vllm_model = registered
    install_worker_lifecycle(lifecycle)
    endpoint = FakeEndpoint(events)

    class ShutdownEvent(asyncio.Event):  # the worker's shutdown event, its setting recorded
        def set(self) -> None:
            events.append(("shutdown event", time.monotonic()))
            super().set()

    async def main() -> None:
        runtime = FakeRuntime(events)
        await dm.register_vllm_model(None, None, endpoint, None, engine, None, None)
        dm.install_signal_handlers(asyncio.get_running_loop(), runtime, [endpoint], ShutdownEvent())
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(runtime.down.wait(), 10)

    asyncio.run(main())
    return events


def test_a_stopping_worker_unregisters_then_lets_its_requests_finish_then_shuts_down(
    dynamo_main: Any, tmp_path: Path
) -> None:
    lifecycle = WorkerLifecycle(grace_s=20, instance_file=tmp_path / "instances" / "worker-0.json")
    engine = FakeEngine(running=2, finish_s=0.5)
    events = _stop_with_sigterm(dynamo_main, lifecycle, engine)
    names = [name for name, _ in events]
    assert names == ["registered", "unregistered", "shutdown event", "runtime shutdown"], names
    at = dict(events)
    assert engine.done_at is not None and at["shutdown event"] >= engine.done_at  # they ran to their end first
    assert lifecycle.report is not None
    assert (lifecycle.report.running_at_stop, lifecycle.report.left) == (2, 0)
    assert lifecycle.report.seconds < 20  # it ended when nothing ran, not at the grace period
    assert lifecycle.engines == [engine]
    assert read_instance_file(tmp_path / "instances" / "worker-0.json") == 0x75223865412C9966


def test_what_is_still_running_when_the_grace_period_ends_is_left_to_migration(dynamo_main: Any) -> None:
    lifecycle = WorkerLifecycle(grace_s=0.3)
    engine = FakeEngine(running=3, finish_s=1e9)  # never finishes by itself
    events = _stop_with_sigterm(dynamo_main, lifecycle, engine)
    assert [name for name, _ in events] == ["registered", "unregistered", "shutdown event", "runtime shutdown"]
    assert lifecycle.report is not None
    assert (lifecycle.report.running_at_stop, lifecycle.report.left) == (3, 3)
    assert 0.3 <= lifecycle.report.seconds < 5


class LateArrival(FakeEngine):
    """Nothing runs at the stop's first look; then a request a frontend routed before it saw the
    worker leave discovery arrives at +0.3 s and runs until +0.8 s."""

    def __init__(self) -> None:
        super().__init__(running=0, finish_s=0.0)
        self.first: float | None = None

    def get_num_unfinished_requests(self) -> int:
        now = time.monotonic()
        self.first = self.first or now
        self.done_at = self.first + 0.8
        return 1 if self.first + 0.3 <= now < self.done_at else 0


def test_a_request_that_arrives_after_the_stop_began_finishes_here(dynamo_main: Any) -> None:
    lifecycle = WorkerLifecycle(grace_s=20)
    engine = LateArrival()
    events = _stop_with_sigterm(dynamo_main, lifecycle, engine)
    at = dict(events)
    assert engine.done_at is not None and at["shutdown event"] >= engine.done_at  # not cut off: not migrated
    assert lifecycle.report is not None and lifecycle.report.left == 0


def test_the_hook_refuses_a_signal_handler_of_another_shape(dynamo_main: Any) -> None:
    def other(loop: Any, runtime: Any) -> None:
        pass

    dynamo_main.install_signal_handlers = other
    with pytest.raises(RuntimeError, match=r"install_signal_handlers is not what ai-dynamo 1\.6\.1 has"):
        install_worker_lifecycle(WorkerLifecycle(grace_s=1))
