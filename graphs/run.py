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
restart`, `graph status`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType

from maru_dynamo.components import commands
from maru_dynamo.graphs.spec import GraphSpec
from maru_vllm.launch import ManagedProcess, ProcessFailed, ProcessGroup, free_port, free_ports, mooncake, stack
from maru_vllm.launch.argv import has_flag
from maru_vllm.launch.file_discovery import remove_instance
from maru_vllm.launch.lifecycle import INSTANCE_FILE_ENV, MAX_GRACE_S, grace_seconds, read_instance_file
from maru_vllm.launch.ports import free_system_port
from maru_vllm.launch.supervisor import RestartPolicy, Supervisor
from maru_vllm.routing import pool_tier_weight

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
# vLLM on CPU builds and warms each engine before it serves, and several may share a few cores.
READY_TIMEOUT_S = 600.0
# What each vLLM engine gets locally unless the graph's args say otherwise (as in stack.py).
LOCAL_WORKER_DEFAULTS: tuple[tuple[str, str | None], ...] = (("--max-model-len", "4096"), ("--enforce-eager", None))
DISCOVERY_DIR = "discovery"  # Dynamo's file discovery, in the work dir
INSTANCES_DIR = "instances"  # each worker's Dynamo instance id (MARU_WORKER_INSTANCE_FILE)


def instance_file(work_dir: Path, name: str) -> Path:
    """Where worker `name` of the graph in `work_dir` records its Dynamo instance id."""
    return work_dir / INSTANCES_DIR / f"{name.replace(':', '-')}.json"


def worker_lifecycle_grace(env: Mapping[str, str]) -> float:
    """How long a worker started with `env` drains when stopped (the longest when `env` is bad)."""
    try:
        return grace_seconds(env)
    except ValueError:
        return MAX_GRACE_S


@dataclasses.dataclass(frozen=True)
class PlannedProcess:
    """One process of the graph: its command, full environment and what the graph set in it."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    graph_env: Mapping[str, str]  # the variables that differ from this shell's environment
    ready_log: str | None = None  # wait for this log line before starting the next process
    cpus: tuple[int, ...] | None = None  # pin the process tree to these cores (see stack.worker_cpus)
    metrics_url: str | None = None  # a worker's Dynamo system server (DYN_SYSTEM_PORT): /metrics, /health


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: GraphSpec
    model: str
    url: str
    work_dir: Path
    processes: tuple[PlannedProcess, ...]
    pool_region: Path | None = None  # the pool's region file: never removed as a dead worker's segment
    pool_regions: tuple[Path, ...] = ()  # every pool's region file (one per domain)

    @property
    def workers(self) -> tuple[PlannedProcess, ...]:
        return tuple(p for p in self.processes if p.name.startswith("worker:"))


def resolve_model(name: str, *, build: bool = True) -> str:
    """A fixture name (tiny, bench) -> its directory (built if needed); anything else unchanged."""
    from maru_vllm.fixtures import models

    if name not in models.SPECS:
        return name
    if build:
        return str(models.ensure_model(name))
    return str(models.default_cache_dir() / models.model_dir_name(models.SPECS[name], 0))


def _with_defaults(args: tuple[str, ...]) -> list[str]:
    out = list(args)
    for flag, value in LOCAL_WORKER_DEFAULTS:
        if not has_flag(out, flag):
            out += [flag] if value is None else [flag, value]
    return out


def build_plan(
    spec: GraphSpec, *, model: str, work_dir: Path, http_port: int | None = None, pin_workers: bool = False
) -> Plan:
    """Every process of `spec` with its command line and environment (nothing is started).

    A pool is planned only where a Maru worker uses it (plain `vllm` workers have none). Each
    worker's process tree is pinned to its engine's core where the cores are too few for two per
    engine (`stack.worker_cpus`), or always with `pin_workers` (benchmarks that must not depend
    on the machine's size)."""
    py = sys.executable
    logs = work_dir / "logs"
    http_port = http_port or free_port()
    processes: list[PlannedProcess] = []

    def add(
        name: str,
        argv: list[str],
        env: dict[str, str],
        ready_log: str | None = None,
        cpus: tuple[int, ...] | None = None,
        metrics_url: str | None = None,
    ) -> None:
        graph_env = {k: v for k, v in sorted(env.items()) if os.environ.get(k) != v}
        processes.append(PlannedProcess(name, tuple(argv), env, graph_env, ready_log, cpus, metrics_url))

    nats_url = spec.nats.url
    if nats_url is None:
        nats_proc, nats_url = stack.nats_server(logs)
        add("nats-server", nats_proc.argv, dict(os.environ), stack.NATS_READY_PATTERN)
    stack_env = stack.StackEnv(discovery_dir=work_dir / DISCOVERY_DIR, nats_url=nats_url)

    def env_for(cpu_thread: int | None = None, **extra: str) -> dict[str, str]:
        return stack_env.build(cpu_thread=cpu_thread, **extra)

    tier_args: list[str] = []
    if spec.mooncake is not None:
        master, metadata = spec.mooncake.master, spec.mooncake.metadata
        if master is None:  # the graph's own master, with its built-in metadata server
            rpc, http, master_metrics = free_ports(3)
            master_argv = mooncake.master_command(rpc, http, master_metrics)
            add("mooncake-master", master_argv, env_for(), mooncake.MASTER_READY_PATTERN)
            master, metadata = f"{stack.LOOPBACK}:{rpc}", f"http://{stack.LOOPBACK}:{http}/metadata"
        tier_args = ["--mooncake-master", master, "--mooncake-protocol", spec.mooncake.protocol]
        tier_args += ["--mooncake-segment-size", str(spec.mooncake.segment_size)]
        if metadata is not None:
            tier_args += ["--mooncake-metadata", metadata]

    pool_addresses: dict[str | None, str] = {}
    regions: list[Path] = []
    pooled = {w.domain for w in spec.workers if w.engine != "vllm"}
    for domain in spec.domains or (None,):
        if domain not in pooled:
            continue
        pool_name = spec.pool_name_of(domain)
        socket = work_dir / f"pool-{pool_name}.sock"
        pool_addresses[domain] = f"unix://{socket}"
        path = spec.pool.path if domain is None else None
        if path is None and spec.pool.backend == "shm":
            # A region of its own per run: two graphs (or a graph and a test) never share one.
            path = f"/dev/shm/maru-{pool_name}-{work_dir.name}"
        pool_argv = stack.pool_command(
            pool_name,
            spec.pool.size,
            backend=spec.pool.backend,
            listen=[pool_addresses[domain]],
            nats=nats_url,
            extra_args=["--metrics-port", str(free_port()), *tier_args],
            path=path,
            entry=commands.POOL_COMPONENT_ENTRY,
        )
        add("pool" if domain is None else f"pool:{domain}", pool_argv, env_for(), stack.POOL_READY_PATTERN)
        if path is not None:
            regions.append(Path(path))

    engine = 0
    engines = sum(worker.replicas for worker in spec.workers)
    for worker in spec.workers:
        for replica in range(worker.replicas):
            if worker.engine == "vllm":  # plain dynamo.vllm: vLLM's own prefix cache, no pool
                argv = [*commands.vllm_worker_command(model), *_with_defaults(worker.args)]
            else:
                argv = commands.maru_worker_command(
                    model,
                    pool_addresses[worker.domain],
                    spec.pool_name_of(worker.domain),
                    [
                        "--maru-chunk-tokens",
                        str(spec.pool.chunk_tokens),
                        "--disaggregation-mode",
                        worker.role,
                        *_with_defaults(worker.args),
                    ],
                )
            # Each worker's metrics and health on a port of its own (the worker's env may set it).
            name = f"worker:{worker.name}-{replica}"
            system = {"DYN_SYSTEM_PORT": str(free_system_port())}
            if worker.engine != "vllm":  # a Maru worker records its instance id (supervision)
                system[INSTANCE_FILE_ENV] = str(instance_file(work_dir, name))
            system.update(worker.env)
            env = env_for(cpu_thread=stack.cpu_thread_for(engine), **system)
            metrics = f"http://{stack.LOOPBACK}:{env['DYN_SYSTEM_PORT']}/metrics"
            add(
                name,
                argv,
                env,
                cpus=(stack.cpu_thread_for(engine),) if pin_workers else stack.worker_cpus(engine, engines),
                metrics_url=metrics,
            )
            engine += 1

    weight = spec.frontend.pool_tier_weight
    if weight is None:
        weight = pool_tier_weight()
    fe_argv = [
        py,
        "-m",
        "maru_dynamo.components.frontend",
        "--http-host",
        stack.LOOPBACK,
        "--http-port",
        str(http_port),
        "--router-mode",
        spec.frontend.router_mode,
        "--router-host-cache-hit-weight",
        repr(weight),
        *spec.frontend.args,
    ]
    add("frontend", fe_argv, env_for())
    one = regions[0] if regions and not spec.domains else None
    return Plan(spec, model, f"http://{stack.LOOPBACK}:{http_port}", work_dir, tuple(processes), one, tuple(regions))


def format_plan(plan: Plan) -> str:
    """The `--dry-run` listing: every process with its command line and the env the graph sets."""
    lines = [
        f"# graph {plan.spec.name} ({plan.spec.mode}) from {plan.spec.source}",
        f"# model {plan.model}",
        f"# url {plan.url}",
        f"# work dir {plan.work_dir}",
    ]
    for p in plan.processes:
        lines.append(f"\n[{p.name}]")
        lines.append("command: " + shlex.join(p.argv))
        if p.cpus is not None:
            lines.append("cpus: " + ",".join(map(str, p.cpus)))
        for key, value in p.graph_env.items():
            lines.append(f"env: {key}={value}")
    return "\n".join(lines)


def curl_example(plan: Plan) -> str:
    body = json.dumps({"model": plan.model, "prompt": "Maru shares KV.", "max_tokens": 16})
    return f"curl {plan.url}/v1/completions -H 'content-type: application/json' -d {shlex.quote(body)}"


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
    logs = plan.work_dir / "logs"
    for p in plan.processes:
        proc = group.start(
            ManagedProcess(p.name, p.argv, log_path=logs / f"{p.name.replace(':', '-')}.log", env=p.env, cpus=p.cpus)
        )
        if p.ready_log:
            proc.wait_for_log(p.ready_log, timeout=60)
    _wait_ready(group, plan, timeout, tick=supervisor.watch if supervisor is not None else None)


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
        if not name.startswith("worker:"):
            return f"{name} is given up on"
    if plan.workers and all(w.name in given_up for w in plan.workers):
        return "every worker is given up on"
    return None


def run_plan(plan: Plan, *, keep_logs: bool = False, out: Callable[[str], None] = print) -> int:
    """Start the graph, serve (restarting dead processes) until SIGINT/SIGTERM, stop it. Returns the exit code."""
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
