"""A child process with a log file, readiness checks and a clean stop.

Every end-to-end test and the local graph runner start servers (nats-server, the pool service,
vLLM, Dynamo) the same way: in their own process group so that a stop also ends grandchildren,
output captured to a file that is shown when something fails, readiness by a log line or an
HTTP probe with a deadline, and a stop that sends SIGTERM to the process, waits (vLLM and Dynamo need a few
seconds to shut down their engine cores) and only then SIGKILLs the group.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from maru_vllm.launch.shm import VLLM_SHM_PREFIXES, ShmSegments, remove_dist_stores, wait_session_gone

logger = logging.getLogger(__name__)

DEFAULT_STOP_GRACE_S = 10.0


class ProcessFailed(RuntimeError):
    """A managed process exited early or did not become ready in time (message has its log tail)."""


class ManagedProcess:
    """One child process (its own process group), logging to `log_path`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path | str,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        cpus: Iterable[int] | None = None,
    ) -> None:
        """`cpus`: pin the process, and so every process it starts, to these cores (why a vLLM CPU
        worker needs that: `maru_vllm.launch.stack.worker_cpus`)."""
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.cpus = frozenset(cpus) if cpus is not None else None
        if self.cpus is not None:
            usable = os.sched_getaffinity(0)
            if not self.cpus or not self.cpus <= usable:
                raise ValueError(
                    f"{name}: cannot pin to cores {sorted(self.cpus)}; this process may use cores {sorted(usable)}"
                )
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0  # where this start's output begins in the (appended) log
        self.started_ns: int | None = None  # wall clock (time.time_ns) of this start

    def restart(self) -> ManagedProcess:
        """Start again after a stop, with the same command, environment and log file."""
        if self.alive():
            raise RuntimeError(f"{self.name} is still running (pid {self.pid})")
        self.proc = None
        return self.start()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> ManagedProcess:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already started (pid {self.proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.started_ns = time.time_ns()
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed in `finally` once the child holds its copy
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=functools.partial(os.sched_setaffinity, 0, self.cpus) if self.cpus else None,
            )
        finally:
            log.close()
        logger.info("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(self.argv))
        return self

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} is not started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = DEFAULT_STOP_GRACE_S) -> int | None:
        """SIGTERM the process, wait up to `grace_s`, then SIGKILL its group. Returns the exit code.

        A tree that had to be killed leaves vLLM's /dev/shm queues and semaphores and its file
        store: those nobody holds any more are removed (`shm.py`)."""
        if self.proc is None:
            return None
        segments = ShmSegments()
        if self.proc.poll() is None:
            segments.scan(self.proc.pid)
            # SIGTERM the leader only: it shuts its children down in order (vLLM's engine core,
            # Dynamo's runtime). Signalling the whole group kills the engine core under it and
            # turns a graceful stop into an "engine dead" exit.
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0fs of SIGTERM; killing it", self.name, grace_s)
        # Kill what is left of the group (engine cores, tokenizer workers) even after a clean exit.
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("%s (pid %d) survived SIGKILL", self.name, self.proc.pid)
        if wait_session_gone(self.proc.pid, timeout_s=5.0):
            removed = segments.release(only=VLLM_SHM_PREFIXES, since_ns=self.started_ns) + remove_dist_stores(
                self.output()
            )
            if removed:
                logger.info("%s left %d shared-memory files; removed", self.name, len(removed))
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, as tests simulate it)."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ManagedProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- output and readiness --------------------------------------------------------------------
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def output(self) -> str:
        """What this start has written so far (the log holds every start's output)."""
        return self.log_text()[self._log_offset :]

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def failure_report(self, tail: int = 60, first_error_lines: int = 40) -> str:
        """This start's first traceback (a root cause: vLLM's engine core prints it long before its
        parent's own traceback fills the tail) followed by the last `tail` lines of the log."""
        lines = self.output().splitlines()
        first = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
        report = ""
        if first is not None and first < len(lines) - tail:
            report = (
                f"--- first traceback in {self.log_path} ---\n"
                + "\n".join(lines[first : first + first_error_lines])
                + "\n"
            )
        return report + f"--- last lines of {self.log_path} ---\n" + "\n".join(lines[-tail:])

    def _fail(self, why: str) -> ProcessFailed:
        return ProcessFailed(f"{self.name}: {why}\n{self.failure_report()}")

    def wait_until(self, check: Callable[[], bool], timeout: float, what: str, poll_s: float = 0.2) -> None:
        """Poll `check` until it returns True; fail early when the process exits."""
        deadline = time.monotonic() + timeout
        while True:
            if check():
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise self._fail(f"exited with code {self.proc.returncode} while waiting for {what}")
            if time.monotonic() > deadline:
                raise self._fail(f"not ready after {timeout:.0f}s (waiting for {what})")
            time.sleep(poll_s)

    def wait_for_log(self, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        """Wait for a line matching `pattern` in this start's output and return its match."""
        regex = re.compile(pattern)
        found: list[re.Match[str]] = []

        def check() -> bool:
            m = regex.search(self.output())
            if m:
                found.append(m)
            return bool(m)

        self.wait_until(check, timeout, f"log line /{pattern}/")
        return found[0]

    def wait_for_http(self, url: str, timeout: float = 120.0, accept: Callable[[bytes], bool] | None = None) -> bytes:
        """Wait until GET `url` answers 200 (and `accept(body)` holds); return the body."""
        body: list[bytes] = []

        def check() -> bool:
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    data = resp.read()
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                return False
            if accept is not None and not accept(data):
                return False
            body.append(data)
            return True

        self.wait_until(check, timeout, f"HTTP {url}", poll_s=0.5)
        return body[0]


P = TypeVar("P", bound=ManagedProcess)


class ProcessGroup:
    """Processes started together and stopped together, last started first stopped."""

    def __init__(self) -> None:
        self.processes: list[ManagedProcess] = []

    def add(self, proc: P) -> P:
        self.processes.append(proc)
        return proc

    def start(self, proc: P) -> P:
        self.add(proc).start()
        return proc

    def stop_all(self, grace_s: float = DEFAULT_STOP_GRACE_S) -> None:
        for proc in reversed(self.processes):
            try:
                proc.stop(grace_s)
            except OSError as exc:
                logger.error("stopping %s failed: %s", proc.name, exc)

    def log_tails(self, lines: int = 40) -> str:
        return "\n\n".join(f"=== {p.name} ({p.log_path}) ===\n{p.log_tail(lines)}" for p in self.processes)

    def __iter__(self) -> Iterator[ManagedProcess]:
        return iter(self.processes)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
