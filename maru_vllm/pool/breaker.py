"""Process-wide health of one pool address: a circuit breaker with a background probe.

A pool request that misses its deadline means the service is not answering - stopped, hung,
swamped - not that it is gone (a dead service refuses connections at once). Waiting for such a
service is the one thing a caller on an engine's critical path must never do again and again, so
every connection of a process to one address shares one `PoolBreaker` (`shared_breaker`):

* **Trip.** The first request that misses its deadline opens the breaker (`trip`). Requests of
  the process's other connections that are waiting on the same service at that moment are cut
  short (their socket is shut down; they fail at once instead of each waiting out its own
  deadline). So a hung pool costs a process at most one deadline.
* **Open.** While it is open, a connection refuses every request without touching its socket
  and drops its session on its next use: its pins and reservations become inert (connection
  generations) and the service releases them when it reads the close. Nothing waits.
* **Probe.** One daemon thread per open breaker asks the service on a connection of its own:
  a `hello` (waiting as long as it takes - a stopped service answers the moment it resumes),
  then a `ping` that must come back within the deadline. When it does, the breaker closes and
  each connection reconnects on its next request: caching resumes by itself. A service that
  answers, but slower than the deadline, keeps the breaker open (the probe asks again).

The breaker knows nothing about sockets: the probe is a callable (`connection.probe_service`),
and members are anything with an `interrupt()` method (`connection.PoolConnection`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

from maru_vllm.pool.errors import PoolError

logger = logging.getLogger(__name__)

# Pause between probes of a service that refused or answered too slowly: doubled up to the cap.
PROBE_BACKOFF_S = (0.02, 0.5)

#: `probe(deadline_s, stop)`: return once the service answered a ping within `deadline_s`;
#: raise `PoolError` otherwise. May block while the service does not answer at all, but must
#: return soon after `stop` is set.
Probe = Callable[[float, threading.Event], None]


class Member(Protocol):
    def interrupt(self) -> None:
        """Cut short a request this member is waiting on (called from the tripping thread)."""


class PoolBreaker:
    """Open (the pool counts as down) from `trip` until the probe sees it answer in time."""

    def __init__(self, name: str, deadline_s: float, probe: Probe, *, what: str = "pool") -> None:
        """`what` names the service in its log lines ("pool at NAME ...")."""
        self.name = name
        self.what = what
        self.deadline_s = deadline_s
        self._probe = probe
        self._cv = threading.Condition()
        self._open = False
        self._opened_at = 0.0
        self._members: weakref.WeakSet[Member] = weakref.WeakSet()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.trips = 0  # times it opened
        self.recoveries = 0  # times the probe closed it again
        self.last_outage_s = 0.0  # how long the last outage lasted, trip to close

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def open_for_s(self) -> float:
        """Seconds since it opened (0 while closed)."""
        return time.monotonic() - self._opened_at if self._open else 0.0

    def join(self, member: Member) -> None:
        with self._cv:
            self._members.add(member)

    def require(self, deadline_s: float) -> None:
        """A new user with this deadline: the probe holds the service to the strictest one."""
        with self._cv:
            self.deadline_s = min(self.deadline_s, deadline_s)

    def trip(self, why: str) -> None:
        """A request missed its deadline: open, cut short the members' waits, start probing."""
        with self._cv:
            if self._open or self._stop.is_set():
                return
            self._open = True
            self._opened_at = time.monotonic()
            self.trips += 1
            members = list(self._members)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="maru-pool-probe", daemon=True)
                self._thread.start()
        logger.warning(
            "%s at %s missed a %.0f ms deadline (%s): every caller in this process serves without it "
            "until a probe sees it answer",
            self.what,
            self.name,
            self.deadline_s * 1000,
            why,
        )
        for m in members:
            m.interrupt()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until the breaker is closed (True) or `timeout` passes (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._open, timeout)

    def close(self) -> None:
        """Stop probing (tests, shutdown); the breaker stays as it is."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()

    def _run(self) -> None:
        pause = PROBE_BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                self._probe(self.deadline_s, self._stop)
            except PoolError as exc:
                logger.debug("pool at %s: probe: %s", self.name, exc)
                if self._stop.wait(pause):
                    return
                pause = min(pause * 2, PROBE_BACKOFF_S[1])
                continue
            with self._cv:
                self.last_outage_s = time.monotonic() - self._opened_at
                self._open = False
                self.recoveries += 1
                self._thread = None
                self._cv.notify_all()
            logger.warning(
                "%s at %s answers again (after %.2f s); %s caching resumes",
                self.what,
                self.name,
                self.last_outage_s,
                self.what,
            )
            return


_registry: dict[str, PoolBreaker] = {}
_registry_lock = threading.Lock()


def shared_breaker(address: str, deadline_s: float, make_probe: Callable[[], Probe]) -> PoolBreaker:
    """This process's breaker for `address` (its probe made by `make_probe` the first time); its
    deadline is the strictest any user asked for."""
    with _registry_lock:
        breaker = _registry.get(address)
        if breaker is None:
            breaker = _registry[address] = PoolBreaker(address, deadline_s, make_probe())
        else:
            breaker.require(deadline_s)
        return breaker


def forget_breakers() -> None:
    """Drop every shared breaker and stop their probes (tests; a process that starts over)."""
    with _registry_lock:
        breakers = list(_registry.values())
        _registry.clear()
    for breaker in breakers:
        breaker.close()


def _after_fork_in_child() -> None:
    # The child inherits the registry but not the probe threads (nor, safely, any lock another
    # thread held at the fork): it starts with no breakers.
    global _registry_lock
    _registry.clear()
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
