"""`maru-dynamo graph run GRAPH`: run a whole Maru graph on this machine with one command.

Starts nats-server, the pool service, the Maru workers and Dynamo's frontend as separate
processes (each in its own process group, logging to a file), waits until the frontend serves
the model, prints the URL and a curl example, then runs until SIGINT/SIGTERM and stops
everything: frontend first, then the workers, the pool and NATS, each with SIGTERM and SIGKILL
after 10 s. While it serves, a process that dies is started again with backoff while the rest
keep serving (`maru_vllm.launch.supervisor`; the dead tree's /dev/shm segments are removed
first); one that keeps crashing is given up on in one line, and giving up on the frontend, the
pool, nats-server or the last worker stops the graph. Everything binds to 127.0.0.1; Dynamo
uses file discovery in a private temporary directory and the NATS event plane; every process
shares PYTHONHASHSEED=0 (pool keys and the router's block hashes match across processes only
then), and each vLLM engine is pinned to one core, round-robin over the machine's cores.

A worker that dies is taken out of Dynamo's discovery at once (each worker records its instance
id in `<work dir>/instances/`; `maru_vllm.launch.file_discovery`), so the frontend stops routing
to it before its registration would expire. While the graph serves, `<work dir>/control.sock`
takes status and rolling-restart requests (`maru_dynamo.graphs.control`: `maru-dynamo graph
restart`, `graph status`). With `--prometheus PORT` a Prometheus scrapes every process of the
graph, with the chart's alert rules (`maru_dynamo.graphs.prometheus`); it is supervised like the
rest, but the graph serves on without it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType

from maru_dynamo.graphs import prometheus as graph_prometheus
from maru_dynamo.graphs.plan import DISCOVERY_DIR, Plan, PlannedProcess, curl_example, instance_file
from maru_vllm.launch import ManagedProcess, ProcessFailed, ProcessGroup
from maru_vllm.launch.file_discovery import remove_instance
from maru_vllm.launch.lifecycle import MAX_GRACE_S, grace_seconds, read_instance_file
from maru_vllm.launch.supervisor import RestartPolicy, Supervisor

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
# vLLM on CPU builds and warms each engine before it serves, and several may share a few cores.
READY_TIMEOUT_S = 600.0


def worker_lifecycle_grace(env: Mapping[str, str]) -> float:
    """How long a worker started with `env` drains when stopped (the longest when `env` is bad)."""
    try:
        return grace_seconds(env)
    except ValueError:
        return MAX_GRACE_S


class _Stop(BaseException):
    """SIGINT or SIGTERM arrived (a BaseException, like KeyboardInterrupt: no `except Exception` eats it)."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def frontend_instances(url: str) -> set[int]:
    """Instance ids of the workers the frontend routes to (its /health lists each one's generate
    endpoint); empty when it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            health = json.loads(resp.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return set()
    instances = health.get("instances") if isinstance(health, dict) else None
    return {
        int(i["instance_id"])
        for i in instances or []
        if isinstance(i, dict) and i.get("endpoint") == "generate" and isinstance(i.get("instance_id"), int)
    }


def _worker_instances(url: str) -> int:
    """How many worker instances the frontend knows."""
    return len(frontend_instances(url))


def _wait_ready(group: ProcessGroup, plan: Plan, timeout: float, tick: Callable[[], None] | None = None) -> None:
    """Until the frontend lists the model and knows every worker; fails early if any process exits."""
    want = len(plan.workers)
    deadline = time.monotonic() + timeout
    models_url = f"{plan.url}/v1/models"
    while True:
        if tick is not None:
            tick()
        for proc in group:
            if not proc.alive():
                code = proc.proc.returncode if proc.proc else None
                raise ProcessFailed(
                    f"{proc.name} exited with code {code} before the graph was ready"
                    f"\n--- last lines of {proc.log_path} ---\n{proc.log_tail()}"
                )
        if _model_listed(models_url, plan.model) and _worker_instances(plan.url) >= want:
            return
        if time.monotonic() > deadline:
            raise ProcessFailed(
                f"graph not ready after {timeout:.0f}s (waiting for {plan.model} and {want} "
                f"workers at {models_url})\n{group.log_tails(20)}"
            )
        time.sleep(0.5)


def _model_listed(url: str, model: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return model.encode() in resp.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def stop_graph(group: ProcessGroup, grace_s: float = STOP_GRACE_S, supervisor: Supervisor | None = None) -> None:
    """Frontend first (no new requests), then all workers at once (each takes seconds), then the rest.

    With `supervisor`: it stops restarting first, and afterwards removes the /dev/shm segments
    of any tree the stop had to SIGKILL.
    """
    if supervisor is not None:
        supervisor.stop()
    _stop_in_order(group, grace_s)
    if supervisor is not None:
        supervisor.release_stopped()


def _stop_in_order(group: ProcessGroup, grace_s: float) -> None:
    procs = list(reversed(group.processes))
    workers = [p for p in procs if p.name.startswith("worker:")]
    others = [p for p in procs if p not in workers]
    front = [p for p in others if p.name == "frontend"]
    for proc in front:
        proc.stop(grace_s)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
        for fut in [pool.submit(p.stop, grace_s) for p in workers]:
            try:
                fut.result()
            except OSError as exc:
                logger.error("stopping a worker failed: %s", exc)
    for proc in others:
        if proc not in front:
            proc.stop(grace_s)


def start_graph(
    plan: Plan, group: ProcessGroup, timeout: float = READY_TIMEOUT_S, supervisor: Supervisor | None = None
) -> None:
    """Start every process of `plan` in order into `group` and wait until the graph serves
    (`supervisor`, made for `group`, looks at the trees' /dev/shm files meanwhile)."""
    for p in plan.processes:
        start_process(plan, p, group)
    _wait_ready(group, plan, timeout, tick=supervisor.watch if supervisor is not None else None)


def start_process(plan: Plan, p: PlannedProcess, group: ProcessGroup) -> ManagedProcess:
    """Start planned process `p` of `plan` into `group`, logging to the graph's logs dir, and
    wait for its ready line if it has one."""
    log_path = plan.work_dir / "logs" / f"{p.name.replace(':', '-')}.log"
    proc = group.start(ManagedProcess(p.name, p.argv, log_path=log_path, env=p.env, cpus=p.cpus))
    if p.ready_log:
        proc.wait_for_log(p.ready_log, timeout=60)
    return proc


class _GiveUp(Exception):
    """The supervisor gave up on a process the graph cannot serve without."""


def supervise(
    plan: Plan,
    group: ProcessGroup,
    *,
    policy: RestartPolicy | None = None,
    out: Callable[[str], None] = print,
    on_give_up: Callable[[str], None] | None = None,
) -> Supervisor:
    """A supervisor for a started graph: restarts its dead processes, never removes the pool's region.

    Pass it to `start_graph`, call its `poll()` from a loop or `start()` it in a thread, and pass
    it to `stop_graph`; `restarts(name)`, `given_up()` and `serving(name)` say how it went. A
    worker found dead is taken out of discovery at once (`out_of_discovery`).
    """
    protect = list(plan.pool_regions) or ([plan.pool_region] if plan.pool_region is not None else [])

    def on_death(name: str) -> None:
        out_of_discovery(plan, name, out)

    return Supervisor(
        group,
        policy=policy,
        protect=protect,
        out=out,
        on_give_up=on_give_up,
        on_death=on_death,
    )


def out_of_discovery(plan: Plan, name: str, out: Callable[[str], None] = print) -> list[Path]:
    """Remove dead worker `name`'s entries from the graph's file discovery (what its own clean
    shutdown would have removed); the frontend stops routing to it as soon as it sees them go."""
    path = instance_file(plan.work_dir, name)
    instance = read_instance_file(path)
    if instance is None:
        return []
    removed = remove_instance(plan.work_dir / DISCOVERY_DIR, instance)
    path.unlink(missing_ok=True)
    if removed:
        out(f"[graph] {name}: instance {instance:x} taken out of discovery ({len(removed)} entries)")
    return removed


def essential_lost(plan: Plan, given_up: Mapping[str, str]) -> str | None:
    """Why the graph cannot serve once `given_up` are given up on, or None while it can."""
    for name in given_up:
        if not name.startswith("worker:") and name != graph_prometheus.PROCESS:
            return f"{name} is given up on"
    if plan.workers and all(w.name in given_up for w in plan.workers):
        return "every worker is given up on"
    return None


def run_plan(
    plan: Plan, *, keep_logs: bool = False, prometheus_port: int | None = None, out: Callable[[str], None] = print
) -> int:
    """Start the graph (and a Prometheus on `prometheus_port`), serve (restarting dead processes)
    until SIGINT/SIGTERM, stop it. Returns the exit code."""
    group = ProcessGroup()
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    logs = plan.work_dir / "logs"
    code = 0
    supervisor: Supervisor | None = None
    control = None
    try:
        out(f"[graph] {plan.spec.name}: model {plan.model}; logs in {logs}")
        supervisor = supervise(plan, group, out=out)
        start_graph(plan, group, supervisor=supervisor)
        if prometheus_port is not None:
            try:
                prometheus = graph_prometheus.start_prometheus(plan, group, prometheus_port)
            except graph_prometheus.PrometheusUnavailable as exc:
                raise ProcessFailed(f"cannot start Prometheus: {exc}") from exc
            out(f"[graph] prometheus: {prometheus.url} (the graph's metrics and the chart's alerts)")
        from maru_dynamo.graphs.control import ControlServer

        control = ControlServer(plan, group, supervisor, out=out).start()
        out(f"[graph] ready: {plan.url} ({len(plan.workers)} workers); Ctrl-C stops the graph")
        out(f"[graph] try: {curl_example(plan)}")
        out(f"[graph] control: {control.path} (maru-dynamo graph status | graph restart WORKER|--all)")
        while True:
            supervisor.poll()
            if (why := essential_lost(plan, supervisor.given_up())) is not None:
                raise _GiveUp(why)
            time.sleep(0.5)
    except _Stop as stop:
        out(f"[graph] {stop}: stopping")
    except _GiveUp as exc:
        out(f"[graph] error: {exc}; stopping the graph")
        code = 1
    except ProcessFailed as exc:
        out(f"[graph] error: {exc}")
        code = 1
    except OSError as exc:  # e.g. nats-server not on PATH
        out(f"[graph] error: cannot start {group.processes[-1].name if group.processes else 'the graph'}: {exc}")
        code = 1
    finally:
        for s in previous:  # a second Ctrl-C must not cut the stop short
            signal.signal(s, signal.SIG_IGN)
        if control is not None:
            control.stop()
        stop_graph(group, supervisor=supervisor)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if code == 0 and not keep_logs:
        shutil.rmtree(plan.work_dir, ignore_errors=True)
    else:
        out(f"[graph] logs kept in {logs}")
    out("[graph] stopped")
    return code


def new_work_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="maru-graph-"))
