"""Keeping a group of managed processes running: restart with backoff, give up on a crash loop.

A `Supervisor` watches the processes of a `ProcessGroup` (each started in its own session, as
`ManagedProcess` does). When one dies it

1. kills what is left of its session (a vLLM engine core outlives a SIGKILLed API server),
2. removes the /dev/shm segments that tree had open or mapped while it lived and that no live
   process holds now (`ShmSegments`; killed vLLM engines leave their shared-memory queues and
   named semaphores behind), never a path it was told to protect (the pool's region) nor
   anybody else's, and the vLLM file stores (`vllm_dist_*`) its log names,
3. tells `on_death(name)` (the graph runner takes a dead worker out of Dynamo's discovery),
4. starts it again after the delay its `RestartPolicy` gives, or gives up on it with one line
   that says why and where its log is.

The rest of the group keeps running meanwhile. `poll()` does one round and may be called from a
caller's own loop (the graph runner does, so that Ctrl-C lands in its main thread), or `start()`
runs the rounds in a thread until `stop()`. Reports go to `out`, one line per event. A stop of
the group that ends in SIGKILL leaves segments too: `stop()`, stop the group, then
`release_stopped()`.

`restart(name)` is a planned restart (a rolling upgrade): a graceful stop, the same clean-up,
and a start at once; it counts as no crash.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from maru_vllm.launch.process import ManagedProcess, ProcessGroup
from maru_vllm.launch.shm import (
    SHM_DIR,
    ShmSegments,
    remove_dist_stores,
    session_members,
    shm_inodes_of,
    shm_paths_of,
    wait_session_gone,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CrashHistory",
    "RestartPolicy",
    "ShmSegments",
    "Supervisor",
    "remove_dist_stores",
    "session_members",
    "shm_inodes_of",
    "shm_paths_of",
]


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When a dead process starts again, and when it is given up on.

    The n-th restart in a row waits ``first_delay_s * factor**(n-1)``, at most ``max_delay_s``.
    A process that ran ``stable_after_s`` or longer before it died starts a new row (one crash
    after a long run is not a loop). A process that died ``max_crashes`` times within
    ``window_s`` is given up on.
    """

    first_delay_s: float = 1.0
    factor: float = 2.0
    max_delay_s: float = 30.0
    max_crashes: int = 5
    window_s: float = 300.0
    stable_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.first_delay_s >= 0 or not self.max_delay_s >= self.first_delay_s:
            raise ValueError(
                f"invalid restart delays first={self.first_delay_s!r} max={self.max_delay_s!r}: "
                "use 0 <= first <= max seconds"
            )
        if not self.factor >= 1:
            raise ValueError(f"invalid restart backoff factor {self.factor!r}: use a number >= 1")
        if self.max_crashes < 1:
            raise ValueError(f"invalid max_crashes {self.max_crashes!r}: use an integer >= 1")
        if not self.window_s > 0 or not self.stable_after_s >= 0:
            raise ValueError(
                f"invalid window_s={self.window_s!r} / stable_after_s={self.stable_after_s!r}: "
                "use a window > 0 and a stable time >= 0 seconds"
            )

    def delay(self, streak: int) -> float:
        """Seconds before the `streak`-th restart in a row (1 = the first)."""
        return float(min(self.max_delay_s, self.first_delay_s * self.factor ** max(0, streak - 1)))


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do about one exit: restart after `delay_s`, or give up (`delay_s` None) because of `reason`."""

    delay_s: float | None
    reason: str = ""


class CrashHistory:
    """One process's exits under a policy (no clock of its own: callers pass monotonic times)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._exits: collections.deque[float] = collections.deque()
        self._streak = 0

    def exited(self, at: float, uptime_s: float) -> Decision:
        """Record an exit at time `at` after running `uptime_s`; say whether and when to restart."""
        p = self.policy
        self._exits.append(at)
        while self._exits and self._exits[0] < at - p.window_s:
            self._exits.popleft()
        if len(self._exits) >= p.max_crashes:
            return Decision(None, f"it exited {len(self._exits)} times within {p.window_s:.0f} s")
        self._streak = 1 if uptime_s >= p.stable_after_s else self._streak + 1
        return Decision(p.delay(self._streak))


# -- the supervisor --------------------------------------------------------------------------


@dataclasses.dataclass
class _Watched:
    proc: ManagedProcess
    history: CrashHistory
    segments: ShmSegments
    started_at: float
    restart_at: float | None = None  # dead, waiting for its restart
    given_up: str | None = None  # the reason, once given up on
    restarts: int = 0
    planned: bool = False  # stopped on purpose by `restart`: not a death


class Supervisor:
    """Restarts the dead processes of `group` under `policy` (see the module docstring).

    `protect`: /dev/shm paths never removed (the pool's region). `scan_interval_s`: how often the
    live trees' /dev/shm files are looked at. `on_give_up(name)` runs after the give-up line
    (the graph runner stops the graph when an essential process is given up on). `on_death(name)`
    runs once a process is found dead (or stopped by `restart`), before it is started again.
    """

    def __init__(
        self,
        group: ProcessGroup,
        *,
        policy: RestartPolicy | None = None,
        protect: Iterable[Path] = (),
        out: Callable[[str], None] = print,
        prefix: str = "[graph]",
        scan_interval_s: float = 2.0,
        shm_dir: Path = SHM_DIR,
        on_give_up: Callable[[str], None] | None = None,
        on_death: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.group = group
        self.policy = policy or RestartPolicy()
        self.protect = frozenset(protect)
        self.out = out
        self.prefix = prefix
        self.scan_interval_s = scan_interval_s
        self.shm_dir = shm_dir
        self.on_give_up = on_give_up
        self.on_death = on_death
        self.clock = clock
        self._watched: dict[str, _Watched] = {}
        self._lock = threading.RLock()
        self._next_scan = 0.0
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.removed_segments: list[Path] = []  # every file removed after a death or a stop

    # -- queries (thread-safe) ---------------------------------------------------------------
    def restarts(self, name: str) -> int:
        """How many times `name` was started again."""
        with self._lock:
            w = self._watched.get(name)
            return w.restarts if w else 0

    def given_up(self) -> dict[str, str]:
        """Processes given up on, with the reason."""
        with self._lock:
            return {n: w.given_up for n, w in self._watched.items() if w.given_up is not None}

    def serving(self, name: str) -> bool:
        """Whether `name` runs now (not dead, not waiting for a restart, not given up on)."""
        with self._lock:
            w = self._watched.get(name)
            return w is not None and w.restart_at is None and w.given_up is None and w.proc.alive()

    # -- the rounds ----------------------------------------------------------------------------
    def _watch(self, proc: ManagedProcess, now: float) -> _Watched:
        w = self._watched.get(proc.name)
        if w is None or w.proc is not proc:
            w = _Watched(proc, CrashHistory(self.policy), ShmSegments(self.shm_dir), started_at=now)
            self._watched[proc.name] = w
        return w

    def _say(self, line: str) -> None:
        self.out(f"{self.prefix} {line}")

    def watch(self, *, force: bool = False) -> None:
        """Look at the live processes' /dev/shm files (every `scan_interval_s`; `force`: now).

        `poll()` does this itself; call it while the group starts (before `poll()` runs), so a
        tree that dies or is stopped early is cleaned up too.
        """
        with self._lock:
            now = self.clock()
            if not force and now < self._next_scan:
                return
            self._next_scan = now + self.scan_interval_s
            for proc in list(self.group):
                w = self._watch(proc, now)
                if w.restart_at is None and w.given_up is None and proc.alive():
                    w.segments.scan(proc.pid)

    def poll(self) -> None:
        """One round: note deaths, clean up after them, start the processes whose delay is over."""
        with self._lock:
            if self._stopping.is_set():
                return
            self.watch()
            now = self.clock()
            for proc in list(self.group):
                if proc.proc is None:  # added to the group, not started (yet): not ours to start
                    continue
                w = self._watch(proc, now)
                if w.given_up is not None or w.planned:
                    continue
                if w.restart_at is None:
                    if proc.alive():
                        continue
                    self._died(w, now)
                if w.restart_at is not None and now >= w.restart_at:
                    self._restart(w, self.clock())

    def release_stopped(self) -> list[Path]:
        """After the group is stopped: remove the /dev/shm segments its trees left behind (a tree
        that had to be SIGKILLed, e.g. an engine still starting); returns the removed paths."""
        removed: list[Path] = []
        with self._lock:
            for w in self._watched.values():
                if w.proc.proc is None or w.proc.alive():
                    continue
                if not wait_session_gone(w.proc.pid):
                    logger.error("%s: processes of session %d survive its stop", w.proc.name, w.proc.pid)
                removed += w.segments.release(self.protect, since_ns=w.proc.started_ns) + remove_dist_stores(
                    w.proc.output()
                )
        self.removed_segments += removed
        if removed:
            logger.info("removed /dev/shm segments left by stopped processes: %s", ", ".join(p.name for p in removed))
        return removed

    def _died(self, w: _Watched, now: float) -> None:
        proc = w.proc
        code = proc.proc.returncode if proc.proc else None
        proc.kill()  # the rest of its session: engine cores, tokenizer workers
        if not wait_session_gone(proc.pid):
            logger.error("%s: processes of session %d survive SIGKILL", proc.name, proc.pid)
        self._clean_up(w)
        decision = w.history.exited(now, now - w.started_at)
        if decision.delay_s is None:
            w.given_up = decision.reason
            self._say(f"giving up on {proc.name}: {decision.reason} (last exit code {code}); log: {proc.log_path}")
            if self.on_give_up is not None:
                self.on_give_up(proc.name)
            return
        w.restart_at = now + decision.delay_s
        self._say(f"{proc.name} exited with code {code}; restarting it in {decision.delay_s:.0f} s")

    def _clean_up(self, w: _Watched) -> None:
        """After `w`'s tree is gone: what it left in /dev/shm, then `on_death`."""
        proc = w.proc
        removed = w.segments.release(self.protect, since_ns=proc.started_ns) + remove_dist_stores(proc.output())
        self.removed_segments += removed
        if removed:
            logger.info("%s: removed what its dead tree left: %s", proc.name, ", ".join(map(str, removed)))
        if self.on_death is not None:
            try:
                self.on_death(proc.name)
            except Exception:  # supervision goes on whatever the hook does
                logger.exception("%s: on_death failed", proc.name)

    def restart(self, name: str, grace_s: float) -> int | None:
        """A planned restart of `name`: SIGTERM, up to `grace_s` for it to exit (then SIGKILL, as
        `ManagedProcess.stop`), the clean-up of a death, and a start at once. No crash is counted
        and its restart delay does not apply. Returns the exit code of the stop.

        Raises KeyError for a name the group does not have and RuntimeError when it is not
        serving now (dead, waiting for a restart, given up on, being restarted) or the
        supervision is stopping.
        """
        with self._lock:
            procs = [p for p in self.group if p.name == name]
            if not procs:
                raise KeyError(name)
            w = self._watch(procs[-1], self.clock())
            if self._stopping.is_set() or w.planned or w.restart_at is not None or w.given_up is not None:
                raise RuntimeError(f"{name} is not serving now; it cannot be restarted")
            if not w.proc.alive():
                raise RuntimeError(f"{name} is not running; the supervisor restarts it by itself")
            w.planned = True
            w.segments.scan(w.proc.pid)  # what its tree holds now, to clean up after the stop
        try:
            code = w.proc.stop(grace_s)  # outside the lock: deaths of others are handled meanwhile
            with self._lock:
                if not wait_session_gone(w.proc.pid):
                    logger.error("%s: processes of session %d survive its stop", name, w.proc.pid)
                self._clean_up(w)
                if self._stopping.is_set():
                    return code
                self._say(f"{name} stopped with code {code}; starting it again")
                self._restart(w, self.clock())
                return code
        finally:
            w.planned = False

    def _restart(self, w: _Watched, now: float) -> None:
        w.restart_at = None
        w.started_at = now
        try:
            w.proc.restart()
        except OSError as exc:
            self._say(f"{w.proc.name}: cannot start it again: {exc}")
            self._died(w, now)
            return
        w.restarts += 1
        self._say(f"{w.proc.name} restarted (pid {w.proc.pid}, restart {w.restarts})")

    # -- in a thread -----------------------------------------------------------------------------
    def start(self, interval_s: float = 0.5) -> Supervisor:
        """Run `poll()` every `interval_s` in a daemon thread until `stop()`."""
        if self._thread is not None:
            raise RuntimeError("supervisor already running")

        def loop() -> None:
            while not self._stopping.wait(interval_s):
                try:
                    self.poll()
                except Exception:  # a round that fails must not end the supervision
                    logger.exception("supervisor round failed")

        self._thread = threading.Thread(target=loop, name="maru-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more restarts from now on (call before stopping the group, then `release_stopped()`
        after it); looks at the live trees' /dev/shm files one last time; joins the thread."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self.watch(force=True)
