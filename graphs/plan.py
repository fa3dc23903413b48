"""A graph's plan: every process of a graph file with its command line, environment and cores.

`build_plan` turns a parsed graph (`maru_dynamo.graphs.spec`) into a `Plan` without starting
anything: nats-server (unless the graph names one), the graph's own Mooncake master when it asks
for a second tier, one pool per domain that a Maru worker uses, each worker replica with its
core, Dynamo system port and instance file, and the frontend with the pool-tier weight.
`graph run --dry-run` prints it (`format_plan`); `maru_dynamo.graphs.run` starts, supervises and
stops it; benchmarks and e2e tests start the same plans.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from maru_dynamo.components import commands
from maru_dynamo.graphs.client import COMPLETIONS
from maru_dynamo.graphs.spec import GraphSpec, WorkerSpec
from maru_vllm.launch import free_port, free_ports, mooncake, stack
from maru_vllm.launch.argv import has_flag
from maru_vllm.launch.lifecycle import INSTANCE_FILE_ENV
from maru_vllm.launch.ports import free_system_port
from maru_vllm.routing import pool_tier_weight

# What each vLLM engine gets locally unless the graph's args say otherwise (as in stack.py).
LOCAL_WORKER_DEFAULTS: tuple[tuple[str, str | None], ...] = (("--max-model-len", "4096"), ("--enforce-eager", None))
DISCOVERY_DIR = "discovery"  # Dynamo's file discovery, in the work dir
INSTANCES_DIR = "instances"  # each worker's Dynamo instance id (MARU_WORKER_INSTANCE_FILE)


def instance_file(work_dir: Path, name: str) -> Path:
    """Where worker `name` of the graph in `work_dir` records its Dynamo instance id."""
    return work_dir / INSTANCES_DIR / f"{name.replace(':', '-')}.json"


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
    pool_addresses: Mapping[str | None, str] = dataclasses.field(default_factory=dict)  # domain -> address

    def process(self, name: str) -> PlannedProcess:
        """The planned process called `name` (KeyError naming the ones there are)."""
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(f"no process {name!r} in the plan; it has {', '.join(p.name for p in self.processes)}")

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


def _parallel_args(worker: WorkerSpec) -> list[str]:
    """The worker's tensor-parallel size; a multi-rank engine runs its ranks as processes on this
    host (vLLM's `mp` executor, what vLLM CPU needs) unless its args pick another executor."""
    args = ["--tensor-parallel-size", str(worker.tensor_parallel_size)]
    if worker.tensor_parallel_size > 1 and not has_flag(worker.args, "--distributed-executor-backend"):
        args += ["--distributed-executor-backend", "mp"]
    return args


def build_plan(
    spec: GraphSpec, *, model: str, work_dir: Path, http_port: int | None = None, pin_workers: bool = False
) -> Plan:
    """Every process of `spec` with its command line and environment (nothing is started).

    A pool is planned only where a Maru worker uses it (plain `vllm` workers have none). Every
    tensor-parallel rank gets a core of its own, round-robin over the machine's cores. Each
    worker's process tree is pinned to its ranks' cores where the cores are too few for two per
    rank (`stack.worker_cpus`), or always with `pin_workers` (benchmarks that must not depend
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

    rank = 0  # the first core-slot of the next engine: each tensor-parallel rank takes one
    ranks = sum(worker.replicas * worker.tensor_parallel_size for worker in spec.workers)
    for worker in spec.workers:
        for replica in range(worker.replicas):
            if worker.engine == "vllm":  # plain dynamo.vllm: vLLM's own prefix cache, no pool
                argv = [*commands.vllm_worker_command(model), *_parallel_args(worker), *_with_defaults(worker.args)]
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
                        *_parallel_args(worker),
                        *_with_defaults(worker.args),
                    ],
                )
            # Each worker's metrics and health on a port of its own (the worker's env may set it).
            name = f"worker:{worker.name}-{replica}"
            system = {"DYN_SYSTEM_PORT": str(free_system_port())}
            if worker.engine != "vllm":  # a Maru worker records its instance id (supervision)
                system[INSTANCE_FILE_ENV] = str(instance_file(work_dir, name))
            cores = tuple(stack.cpu_thread_for(rank + i) for i in range(worker.tensor_parallel_size))
            if len(cores) > 1:  # vLLM CPU: one OpenMP core per rank, ranks separated by '|'
                system["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, cores))
            system.update(worker.env)
            env = env_for(cpu_thread=cores[0] if len(cores) == 1 else None, **system)
            metrics = f"http://{stack.LOOPBACK}:{env['DYN_SYSTEM_PORT']}/metrics"
            pin = pin_workers or stack.worker_cpus(rank, ranks) is not None
            add(name, argv, env, cpus=tuple(dict.fromkeys(cores)) if pin else None, metrics_url=metrics)
            rank += worker.tensor_parallel_size

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
    url = f"http://{stack.LOOPBACK}:{http_port}"
    return Plan(spec, model, url, work_dir, tuple(processes), one, tuple(regions), dict(pool_addresses))


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
    return f"curl {plan.url}{COMPLETIONS} -H 'content-type: application/json' -d {shlex.quote(body)}"
