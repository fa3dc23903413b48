"""Talking to a running `maru-dynamo graph run`: its status, and restarts one process at a time.

**The control channel.** Once the graph serves, `graph run` listens on a unix socket in its work
dir, `<work dir>/control.sock` (mode 0600: only the user who started the graph may use it; the
work dir is the `maru-graph-*` directory `graph run` prints). A client sends one JSON line, a
`ControlRequest`, and reads JSON lines back: `Progress` lines while the graph works on it, then
one `Done`. The socket goes away when the graph stops. `maru-dynamo graph restart` and `graph
status` are its clients; they find the graph by its work dir (`--work-dir`), or, without it, the
one graph of this user that answers in the temporary directory.

**A rolling restart** (`restart`, targets in the order given; `all_workers`: every worker in the
graph's order) restarts one process at a time, each back before the next is touched:

* a worker is sent SIGTERM: it leaves discovery at once, lets its running requests finish
  (`maru_vllm.launch.lifecycle`: at most its grace period), hands what is left to the
  frontend's request migration, commits its queued pool stores and exits; it is started again
  with the same command, and it is back once the frontend lists its new instance - which a
  Maru worker registers only after its warm-up (ready means warm; a plain `dynamo.vllm`
  worker, `engine: vllm`, records no instance id: it is back once the frontend lists an instance
  it did not list before the stop). The worker's stop is given its grace period plus
  `SHUTDOWN_MARGIN_S` before SIGKILL;
* the frontend is sent SIGTERM (Dynamo's frontend stops its HTTP service and lets the streams
  it serves finish), started again, and is back once it lists the model and every worker.

A restart that does not come back within `READY_TIMEOUT_S` ends the rolling restart with an
error and leaves the targets after it alone. One restart runs at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import stat
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from maru_dynamo.graphs.plan import Plan, instance_file
from maru_dynamo.graphs.run import frontend_instances, worker_lifecycle_grace
from maru_vllm.launch.lifecycle import INSTANCE_FILE_ENV, read_instance_file
from maru_vllm.launch.process import ProcessGroup
from maru_vllm.launch.supervisor import Supervisor

logger = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
WORK_DIR_GLOB = "maru-graph-*"
MAX_REQUEST_BYTES = 64 * 1024
# What a stopping worker needs past its drain: the engine's shutdown and its store writer's flush.
SHUTDOWN_MARGIN_S = 30.0
FRONTEND_STOP_GRACE_S = 30.0
READY_TIMEOUT_S = 600.0
FRONTEND = "frontend"


class ControlRequest(msgspec.Struct, forbid_unknown_fields=True):
    op: Literal["status", "restart"]
    targets: list[str] = msgspec.field(default_factory=list)
    all_workers: bool = False


class Progress(msgspec.Struct, tag="progress"):
    line: str


class Done(msgspec.Struct, tag="done"):
    ok: bool
    error: str | None = None
    status: dict[str, Any] | None = None


Reply = Progress | Done
_reply_decoder = msgspec.json.Decoder(Reply)
_request_decoder = msgspec.json.Decoder(ControlRequest)


class ControlError(Exception):
    """A control request that cannot be served, or a graph that cannot be reached (one line)."""


def socket_path(work_dir: Path) -> Path:
    return work_dir / SOCKET_NAME


# -- what a restart does ------------------------------------------------------------------------
@dataclasses.dataclass
class RestartStep:
    name: str
    exit_code: int | None
    stop_s: float  # SIGTERM -> exited
    back_s: float  # exited -> serving again (a worker: registered, so warm)
    instance: int | None = None  # a worker's new instance id


class RollingRestart:
    """Restarts processes of a running graph one at a time (module docstring)."""

    def __init__(
        self,
        plan: Plan,
        group: ProcessGroup,
        supervisor: Supervisor,
        say: Callable[[str], None],
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        self.plan, self.group, self.supervisor, self.say = plan, group, supervisor, say
        self.ready_timeout_s = ready_timeout_s

    def resolve(self, targets: list[str], all_workers: bool) -> list[str]:
        """Process names to restart, in order; ControlError (one line) for anything else."""
        workers = [p.name for p in self.plan.workers]
        allowed = [*workers, FRONTEND]
        if all_workers:
            if targets:
                raise ControlError("give targets or --all, not both")
            return workers
        if not targets:
            raise ControlError(f"nothing to restart: name targets ({', '.join(allowed)}) or --all")
        out: list[str] = []
        for target in targets:
            name = target if target in allowed else f"worker:{target}"
            if name not in allowed:
                raise ControlError(f"unknown target {target!r}: use one of {', '.join(allowed)} (or --all)")
            if name in out:
                raise ControlError(f"target {target!r} given twice")
            out.append(name)
        return out

    def run(self, names: list[str]) -> list[RestartStep]:
        steps = []
        for name in names:
            steps.append(self.restart_frontend() if name == FRONTEND else self.restart_worker(name))
        return steps

    def _stop_and_start(self, name: str, grace_s: float) -> tuple[int | None, float]:
        t0 = time.monotonic()
        try:
            code = self.supervisor.restart(name, grace_s)
        except (KeyError, RuntimeError) as exc:
            raise ControlError(f"{name}: {exc}") from None
        return code, time.monotonic() - t0

    def restart_worker(self, name: str) -> RestartStep:
        planned = next(p for p in self.plan.workers if p.name == name)
        grace = worker_lifecycle_grace(planned.env)
        records = INSTANCE_FILE_ENV in planned.env  # a Maru worker; a plain dynamo.vllm one does not
        path = instance_file(self.plan.work_dir, name)
        old = read_instance_file(path)
        listed_before = frontend_instances(self.plan.url)
        how = f"it drains for up to {grace:g} s, then migrates what is left" if records else "Dynamo's own stop"
        self.say(f"{name}: stopping ({how})")
        code, stop_s = self._stop_and_start(name, grace + SHUTDOWN_MARGIN_S)
        self.say(f"{name}: stopped in {stop_s:.1f} s (exit code {code}); waiting until it is back and warm")
        t0 = time.monotonic()
        found: list[int] = []

        def back() -> bool:
            listed = frontend_instances(self.plan.url)
            if records:
                new = read_instance_file(path)
                fresh = [new] if new is not None and new != old and new in listed else []
            else:  # the instance the frontend lists that it did not list before the stop
                fresh = sorted(listed - listed_before)
            found[:] = fresh[:1]
            return bool(found)

        self._wait(name, back)
        step = RestartStep(name, code, stop_s, time.monotonic() - t0, found[0])
        self.say(f"{name}: back and warm in {step.back_s:.1f} s (instance {step.instance:x})")
        return step

    def restart_frontend(self) -> RestartStep:
        want = len(self.plan.workers)
        self.say(f"{FRONTEND}: stopping (the streams it serves finish first)")
        code, stop_s = self._stop_and_start(FRONTEND, FRONTEND_STOP_GRACE_S)
        self.say(f"{FRONTEND}: stopped in {stop_s:.1f} s (exit code {code}); waiting until it serves")
        t0 = time.monotonic()
        self._wait(FRONTEND, lambda: _model_listed(self.plan) and len(frontend_instances(self.plan.url)) >= want)
        step = RestartStep(FRONTEND, code, stop_s, time.monotonic() - t0)
        self.say(f"{FRONTEND}: back in {step.back_s:.1f} s, listing {want} workers")
        return step

    def _wait(self, name: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not ready():
            why = self.supervisor.given_up().get(name)
            if why is not None:
                raise ControlError(f"{name} did not come back: the supervisor gave up on it ({why})")
            if time.monotonic() > deadline:
                log = next((p.log_path for p in self.group if p.name == name), None)
                raise ControlError(f"{name} did not come back within {self.ready_timeout_s:.0f} s; log: {log}")
            time.sleep(0.5)


def _model_listed(plan: Plan) -> bool:
    try:
        with urllib.request.urlopen(f"{plan.url}/v1/models", timeout=2) as resp:
            return plan.model.encode() in resp.read()
    except (urllib.error.URLError, OSError):
        return False


def graph_status(plan: Plan, group: ProcessGroup, supervisor: Supervisor) -> dict[str, Any]:
    """Every process's pid, whether it serves and its restarts; the workers' instance ids."""
    processes = {}
    for proc in group:
        row: dict[str, Any] = {
            "pid": proc.proc.pid if proc.proc is not None else None,
            "serving": supervisor.serving(proc.name),
            "restarts": supervisor.restarts(proc.name),
        }
        if proc.name.startswith("worker:"):
            row["instance"] = read_instance_file(instance_file(plan.work_dir, proc.name))
        processes[proc.name] = row
    return {
        "graph": plan.spec.name,
        "url": plan.url,
        "work_dir": str(plan.work_dir),
        "processes": processes,
        "given_up": supervisor.given_up(),
        "listed_instances": sorted(frontend_instances(plan.url)),
    }


# -- the server (in graph run) ----------------------------------------------------------------
class ControlServer:
    """Serves `ControlRequest`s on `<work dir>/control.sock` from a thread (module docstring)."""

    def __init__(
        self, plan: Plan, group: ProcessGroup, supervisor: Supervisor, out: Callable[[str], None] = print
    ) -> None:
        self.plan, self.group, self.supervisor, self.out = plan, group, supervisor, out
        self.path = socket_path(plan.work_dir)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._busy = threading.Lock()
        self._closing = threading.Event()

    def start(self) -> ControlServer:
        self.path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: the socket is the graph's control, its user's only
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        sock.listen(4)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="graph-control", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closing.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        self.path.unlink(missing_ok=True)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="graph-control-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            writer = conn.makefile("wb")

            def send(reply: Reply) -> None:
                try:
                    writer.write(msgspec.json.encode(reply) + b"\n")
                    writer.flush()
                except OSError:  # the client went away: the restart goes on regardless
                    pass

            try:
                request = _request_decoder.decode(_read_line(conn))
            except (ControlError, msgspec.DecodeError, msgspec.ValidationError, OSError) as exc:
                send(Done(False, f"bad control request: {exc}"))
                return
            send(self.handle(request, lambda line: send(Progress(line))))

    def handle(self, request: ControlRequest, progress: Callable[[str], None]) -> Done:
        status = graph_status(self.plan, self.group, self.supervisor)
        if request.op == "status":
            return Done(True, status=status)
        if not self._busy.acquire(blocking=False):
            return Done(False, "a restart is already running; try again when it is done")
        try:
            restart = RollingRestart(self.plan, self.group, self.supervisor, lambda line: self._say(line, progress))
            names = restart.resolve(request.targets, request.all_workers)
            self._say(f"restart of {', '.join(names)}, one at a time", progress)
            steps = restart.run(names)
        except ControlError as exc:
            self._say(f"restart failed: {exc}", progress)
            return Done(False, str(exc))
        finally:
            self._busy.release()
        self._say(f"restart done: {', '.join(s.name for s in steps)}", progress)
        return Done(True, status=graph_status(self.plan, self.group, self.supervisor))

    def _say(self, line: str, progress: Callable[[str], None]) -> None:
        self.out(f"[graph] {line}")
        progress(line)


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST_BYTES:
            raise ControlError(f"longer than {MAX_REQUEST_BYTES} bytes")
    return data.strip()


# -- the client (graph restart / graph status) -------------------------------------------------
def running_graphs(base: Path | None = None) -> list[Path]:
    """Work dirs of this user's graphs in the temporary directory whose control socket answers."""
    base = Path(tempfile.gettempdir()) if base is None else base
    found = []
    for path in sorted(base.glob(f"{WORK_DIR_GLOB}/{SOCKET_NAME}")):
        try:
            if path.lstat().st_uid != os.getuid() or not stat.S_ISSOCK(path.lstat().st_mode):
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(2)
                probe.connect(str(path))
        except OSError:
            continue
        found.append(path.parent)
    return found


def find_work_dir(work_dir: Path | None) -> Path:
    """The work dir to talk to: `work_dir` when given, else the one running graph; ControlError."""
    if work_dir is not None:
        if not socket_path(work_dir).exists():
            raise ControlError(f"--work-dir {work_dir}: no graph runs there (no {SOCKET_NAME})")
        return work_dir
    graphs = running_graphs()
    if not graphs:
        raise ControlError(
            f"no running graph found in {tempfile.gettempdir()} (start one with `maru-dynamo graph run`)"
        )
    if len(graphs) > 1:
        raise ControlError(
            f"{len(graphs)} graphs are running ({', '.join(map(str, graphs))}): pass --work-dir with one of them"
        )
    return graphs[0]


def send(
    work_dir: Path, request: ControlRequest, on_progress: Callable[[str], None] = print, timeout_s: float = 3600.0
) -> Done:
    """Send `request` to the graph in `work_dir`; progress lines go to `on_progress`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(socket_path(work_dir)))
        except OSError as exc:
            raise ControlError(f"cannot reach the graph in {work_dir}: {exc}") from None
        sock.sendall(msgspec.json.encode(request) + b"\n")
        for raw in sock.makefile("rb"):
            reply = _reply_decoder.decode(raw)
            if isinstance(reply, Progress):
                on_progress(reply.line)
            else:
                return reply
    raise ControlError(f"the graph in {work_dir} closed the connection before it answered")


def format_status(status: Mapping[str, Any]) -> str:
    lines = [f"graph {status['graph']} at {status['url']} (work dir {status['work_dir']})"]
    listed = set(status.get("listed_instances") or [])
    for name, row in status["processes"].items():
        state = "serving" if row["serving"] else "down"
        extra = ""
        if "instance" in row:
            inst = row["instance"]
            extra = f", instance {inst:x}" if inst is not None else ", no instance yet"
            extra += " (routed to)" if inst in listed else " (not routed to)"
        lines.append(f"  {name:<24} pid {row['pid']}, {state}, restarts {row['restarts']}{extra}")
    for name, why in (status.get("given_up") or {}).items():
        lines.append(f"  given up on {name}: {why}")
    return "\n".join(lines)
