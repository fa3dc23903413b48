"""A pool that is alive but not answering (SIGSTOP) costs one deadline, then nobody waits for it.

Real pool service processes; the hang is a real SIGSTOP. Nothing here gates on a wall-clock
time: "did not wait" is told by the error a caller gets - a caller that waited for the pool
gets `PoolTimeout`, one that was turned away by the breaker gets a plain `PoolUnavailable`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import pytest

from maru_vllm.launch.stack import PoolProcess
from maru_vllm.pool import PoolClient
from maru_vllm.pool.breaker import PoolBreaker, forget_breakers
from maru_vllm.pool.connection import probe_service, process_breaker
from maru_vllm.pool.errors import PoolError, PoolTimeout, PoolUnavailable
from tests.waiting import wait_until

DEADLINE_S = 0.3


@pytest.fixture(autouse=True)
def _fresh_breakers() -> Iterator[None]:
    yield
    forget_breakers()


@contextlib.contextmanager
def stopped(pool: PoolProcess) -> Iterator[None]:
    """The pool process stopped (alive, its sockets open, answering nothing) for the block."""
    assert pool.proc is not None
    os.kill(pool.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pool.proc.pid, signal.SIGCONT)


def client(pool: PoolProcess, breaker: PoolBreaker, timeout: float = DEADLINE_S) -> PoolClient:
    c = PoolClient(pool.address, timeout=timeout, breaker=breaker)
    c.connect_now(30.0)
    return c


def _leak_free(st: dict) -> bool:
    return st["pins"] == 0 and st["reserved"] == 0


class FakeProbe:
    """A stand-in for `probe_service` (no service): fails `failures` times, then answers; the
    first call waits for `gate`."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.deadlines: list[float] = []
        self.gate = threading.Event()

    def __call__(self, deadline_s: float, stop: threading.Event) -> None:
        self.gate.wait(60)
        self.deadlines.append(deadline_s)
        if len(self.deadlines) <= self.failures:
            raise PoolTimeout("fake: answered too slowly")


class Waiter:
    def __init__(self) -> None:
        self.interrupted = 0

    def interrupt(self) -> None:
        self.interrupted += 1


def test_the_breaker_opens_once_cuts_waits_short_and_closes_when_the_probe_sees_an_answer() -> None:
    probe = FakeProbe(failures=2)
    breaker = PoolBreaker("fake", 0.5, probe)
    waiter = Waiter()
    breaker.join(waiter)
    breaker.require(0.2)  # a stricter user: the probe holds the service to 200 ms
    breaker.trip("first")
    breaker.trip("second, while open")
    assert breaker.is_open and breaker.trips == 1 and waiter.interrupted == 1
    probe.gate.set()
    assert breaker.wait_closed(timeout=60)
    assert probe.deadlines == [0.2, 0.2, 0.2] and breaker.recoveries == 1 and not breaker.is_open
    breaker.trip("again")
    assert breaker.is_open and breaker.trips == 2 and waiter.interrupted == 2
    assert breaker.wait_closed(timeout=60)


def test_one_missed_deadline_marks_the_pool_down_for_every_connection_until_it_answers(pool) -> None:
    breaker = process_breaker(pool.address, None, DEADLINE_S)
    a, b = client(pool, breaker), client(pool, breaker)
    try:
        assert a.put(b"present", b"x" * 1000)
        with stopped(pool):
            with pytest.raises(PoolTimeout):
                a.lookup([b"absent"])  # the one deadline this process pays
            assert breaker.is_open and a.marked_down and b.marked_down
            for call in (lambda: a.lookup([b"present"]), lambda: b.lookup([b"present"]), lambda: b.stats()):
                with pytest.raises(PoolUnavailable) as err:
                    call()
                assert not isinstance(err.value, PoolTimeout), "a caller waited for the hung pool"
                assert "marked down" in str(err.value)
        assert breaker.wait_closed(timeout=60), "the probe never saw the pool answer again"
        assert breaker.trips == 1 and breaker.recoveries == 1
        # a's first lookup timed out: its late reply ([False]) must never answer a later request
        assert a.lookup([b"present"]) == [True]
        assert a.lookup([b"absent", b"present"]) == [False, True]
        assert b.lookup([b"present"]) == [True]
    finally:
        a.close()
        b.close()


def test_pins_and_reservations_of_a_dropped_session_are_inert_and_released(pool) -> None:
    breaker = process_breaker(pool.address, None, DEADLINE_S)
    a = client(pool, breaker)
    try:
        assert a.put(b"pinned", b"p" * 4096)
        (pin,) = a.acquire([b"pinned"])
        (res,) = a.reserve([(b"half-written", 4096)])
        assert pin is not None and res is not None
        with stopped(pool), pytest.raises(PoolTimeout):
            a.lookup([b"pinned"])
        assert breaker.wait_closed(timeout=60)
        # the service read the dropped session's close and released what it held
        st = wait_until(lambda: _leak_free(s := a.stats()) and s, timeout=60, what="session released")
        assert st["reserved"] == 0 and st["pins"] == 0
        a.release([pin])  # inert: it belongs to the dropped session
        assert a.commit([res]) == [False]  # never published: that space went with the session
        assert a.lookup([b"half-written"]) == [False]
        assert _leak_free(a.stats())
        with a.get(b"pinned") as v:
            assert v is not None and bytes(v) == b"p" * 4096
    finally:
        a.close()


def test_a_request_waiting_on_the_hung_pool_is_cut_short_when_another_misses_its_deadline(pool) -> None:
    breaker = process_breaker(pool.address, None, DEADLINE_S)
    patient = client(pool, breaker, timeout=600.0)  # would wait ten minutes on its own
    quick = client(pool, breaker)
    outcome: list[BaseException] = []

    def ask() -> None:
        try:
            patient.lookup([b"k"])
        except PoolError as exc:
            outcome.append(exc)

    try:
        with stopped(pool):
            t = threading.Thread(target=ask)
            t.start()
            wait_until(lambda: patient._waiting_sock is not None, timeout=30, what="the request to be waiting")
            with pytest.raises(PoolTimeout):
                quick.lookup([b"k"])
            t.join(120)
            assert not t.is_alive()
        assert len(outcome) == 1 and "cut short" in str(outcome[0]), outcome
        assert breaker.wait_closed(timeout=60)
        assert patient.lookup([b"k"]) == [False] and quick.lookup([b"k"]) == [False]
    finally:
        patient.close()
        quick.close()


def test_the_probe_wants_a_ping_within_the_deadline_and_waits_out_a_stopped_pool(pool) -> None:
    probe_service(pool.address, None, 5.0)  # answering: returns
    with pytest.raises(PoolTimeout, match="answered a ping in"):
        probe_service(pool.address, None, 0.0)  # no service answers within 0 ms
    done: list[BaseException | None] = []

    def probe() -> None:
        try:
            probe_service(pool.address, None, 5.0, patience_s=120.0)
            done.append(None)
        except PoolError as exc:
            done.append(exc)

    with stopped(pool):
        t = threading.Thread(target=probe)
        t.start()
        t.join(0.5)
        assert not done  # waiting for the hello to be answered
    t.join(120)
    assert done == [None]


def test_a_missing_pool_is_not_a_missed_deadline(tmp_path) -> None:
    breaker = process_breaker(f"unix://{tmp_path}/none.sock", None, DEADLINE_S)
    c = PoolClient(f"unix://{tmp_path}/none.sock", timeout=DEADLINE_S, breaker=breaker)
    with pytest.raises(PoolUnavailable) as err:
        c.lookup([b"k"])
    assert not isinstance(err.value, PoolTimeout)
    assert not breaker.is_open  # refused at once: nothing waits, the client's own backoff applies
    c.close()
