"""Command lines and environments for the real services of a local graph.

One place that knows how to start nats-server, the pool service, a vLLM OpenAI server and Dynamo's
frontend on this machine (the graph components' own command lines, the Maru worker's among them,
are `components/commands.py`'s): loopback addresses only, one
pinned CPU thread per vLLM engine (two engines on two cores otherwise thrash, and greedy output is
bit-exact only with a fixed thread count), and the same PYTHONHASHSEED everywhere (vLLM's block hashes, and so the
pool keys and the router's view, match across instances only then).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from maru_vllm.launch.hash_seed import GRAPH_HASH_SEED
from maru_vllm.launch.ports import free_port
from maru_vllm.launch.process import ManagedProcess
from maru_vllm.pool.region import default_region_path
from maru_vllm.pool.service import READY_LINE

LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class StackEnv:
    """Environment shared by every process of one local graph."""

    discovery_dir: Path
    nats_url: str | None = None
    extra: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def build(self, *, cpu_thread: int | None = None, **overrides: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "PYTHONHASHSEED": GRAPH_HASH_SEED,
                "PYTHONUNBUFFERED": "1",
                "PYTHONFAULTHANDLER": "1",  # a crashing engine process leaves its stack in the log
                # Dynamo on one host: file discovery, everything bound to loopback.
                "DYN_DISCOVERY_BACKEND": "file",
                "DYN_FILE_KV": str(self.discovery_dir),
                "DYN_TCP_RPC_HOST": LOOPBACK,
                "DYN_EVENT_PLANE_HOST": LOOPBACK,
                "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
                "DYN_HTTP_HOST": LOOPBACK,
                # vLLM on CPU: a small KV space, no usage reporting.
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
            }
        )
        # vLLM binds its internal ports (torch.distributed's store) seconds after choosing them;
        # a base below the ephemeral range keeps outgoing connections off them (see ports.py).
        env.setdefault("VLLM_PORT", str(free_port()))
        if self.nats_url:
            env["NATS_SERVER"] = self.nats_url
            env["DYN_EVENT_PLANE"] = "nats"
        if cpu_thread is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_thread)
            env["OMP_NUM_THREADS"] = "1"
        env.update(self.extra)
        env.update(overrides)
        return env


def cpu_engines() -> bool:
    """Whether this install runs vLLM on CPU (the `vllm-cpu` build)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def worker_cpus(index: int, engines: int) -> tuple[int, ...] | None:
    """The cores to pin worker `index`'s whole process tree to, or None to leave it free.

    A vLLM CPU engine is three processes (API server, engine core, model runner) whose
    shared-memory queues busy-wait while it decodes: one decoding engine keeps two cores busy.
    When the engines cannot each have two cores, each worker stays on its engine's core, or a
    decoding worker starves its neighbours' prefills.
    """
    if not cpu_engines() or 2 * engines <= len(os.sched_getaffinity(0)):
        return None
    return (cpu_thread_for(index),)


def cpu_thread_for(index: int) -> int:
    """The core a vLLM engine is pinned to: engines alternate over the machine's cores."""
    return index % max(1, os.cpu_count() or 1)


NATS_READY_PATTERN = r"Server is ready"  # nats-server's log line once it accepts clients


def nats_server(log_dir: Path, port: int | None = None) -> tuple[ManagedProcess, str]:
    """A nats-server on a loopback port; returns the process and its URL."""
    port = port or free_port()
    proc = ManagedProcess(
        "nats-server",
        ["nats-server", "-a", LOOPBACK, "-p", str(port)],
        log_path=log_dir / f"nats-{port}.log",
    )
    return proc, f"nats://{LOOPBACK}:{port}"


POOL_MODULE = "maru_vllm.pool"  # `python -m maru_vllm.pool serve ...`, as `maru-dynamo pool serve`
# The line the pool prints once per address it serves, when it accepts clients.
POOL_READY_PATTERN = "(?m)^" + re.escape(READY_LINE).replace(re.escape("{address}"), r"(\S+)") + "$"


def pool_command(
    name: str,
    size: str | int,
    *,
    listen: Sequence[str] = (),
    nats: str | None = None,
    backend: str | None = None,
    path: str | Path | None = None,
    extra_args: Sequence[str] = (),
    entry: Sequence[str] = ("-m", POOL_MODULE, "serve"),
) -> list[str]:
    """The pool service's command line; `entry` follows the interpreter (the graph component
    passes its own module)."""
    argv = [sys.executable, *entry, "--name", name, "--size", str(size)]
    if backend is not None:
        argv += ["--backend", backend]
    for address in listen:
        argv += ["--listen", address]
    if nats is not None:
        argv += ["--nats", nats]
    argv += extra_args
    if path is not None:
        argv += ["--path", str(path)]
    return argv


class PoolProcess(ManagedProcess):
    """A pool service as a child process: `pool_command` plus a wait for its ready lines."""

    def __init__(
        self,
        pool_name: str,
        size: str | int,
        log_path: Path | str,
        *,
        listen: Sequence[str] = (),
        nats: str | None = None,
        backend: str = "shm",
        path: str | Path | None = None,
        extra_args: Sequence[str] = (),
        name: str = "pool",
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        cpus: Sequence[int] | None = None,
    ) -> None:
        argv = pool_command(
            pool_name,
            size,
            listen=listen,
            nats=nats,
            backend=None if backend == "shm" else backend,
            path=path,
            extra_args=extra_args,
        )
        super().__init__(name, argv, log_path=log_path, env=env, cwd=cwd, cpus=cpus)
        self.pool_name = pool_name
        self.region_path = Path(path) if path is not None else default_region_path(backend, pool_name)
        self._listens = len(listen) + sum(1 for a in extra_args if a == "--listen")
        self.addresses: list[str] = []

    @property
    def address(self) -> str:
        """The first address the pool serves (its default socket when no --listen was given)."""
        if not self.addresses:
            raise RuntimeError(f"{self.name}: not ready yet (call wait_ready)")
        return self.addresses[0]

    def wait_ready(self, timeout: float = 60.0) -> str:
        """Wait until this start has printed a ready line for every address; return the first."""
        regex = re.compile(POOL_READY_PATTERN)
        want = max(1, self._listens)
        found: list[str] = []

        def check() -> bool:
            found[:] = regex.findall(self.output())
            return len(found) >= want

        self.wait_until(check, timeout, f"{want} ready line(s) /{POOL_READY_PATTERN}/")
        self.addresses = list(found)
        return self.addresses[0]

    def serve(self, timeout: float = 60.0) -> PoolProcess:
        """Start (a started pool: stop it and start it again) and wait until it accepts clients."""
        if self.proc is None:
            self.start()
        else:
            self.stop()
            self.restart()
        self.wait_ready(timeout)
        return self


def vllm_openai_server(
    name: str,
    model: str | Path,
    env: Mapping[str, str],
    log_dir: Path,
    *,
    port: int | None = None,
    max_model_len: int = 4096,
    kv_transfer_config: Mapping[str, object] | None = None,
    extra_args: Sequence[str] = (),
    cpus: Sequence[int] | None = None,
) -> tuple[ManagedProcess, str]:
    """vLLM's OpenAI server, started through its module entry point with this interpreter (so it
    runs the venv's vLLM whatever `vllm` is on PATH); `cpus` pins its whole process tree."""
    port = port or free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",  # report cached_tokens in usage
        *extra_args,
    ]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    proc = ManagedProcess(name, argv, log_path=log_dir / f"{name}.log", env=env, cpus=cpus)
    return proc, f"http://{LOOPBACK}:{port}"
