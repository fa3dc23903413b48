"""Command lines and environments for the real services of a local graph.

One place that knows how to start nats-server, a vLLM OpenAI server, Dynamo's frontend and a
Dynamo vLLM worker on this machine: loopback addresses only, one pinned CPU thread per vLLM
engine (two engines on two cores otherwise thrash, and greedy output is bit-exact only with a
fixed thread count), and the same PYTHONHASHSEED everywhere (vLLM's block hashes, and so the
pool keys and the router's view, match across instances only then).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from maru_vllm.launch.ports import free_port
from maru_vllm.launch.process import ManagedProcess

LOOPBACK = "127.0.0.1"
GRAPH_HASH_SEED = "0"  # Dynamo sets 0 for its workers; every process of a graph uses it.


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


def nats_server(log_dir: Path, port: int | None = None) -> tuple[ManagedProcess, str]:
    """A nats-server on a loopback port; returns the process and its URL."""
    port = port or free_port()
    proc = ManagedProcess(
        "nats-server",
        ["nats-server", "-a", LOOPBACK, "-p", str(port)],
        log_path=log_dir / f"nats-{port}.log",
    )
    return proc, f"nats://{LOOPBACK}:{port}"


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
    """vLLM's OpenAI server (`vllm serve` is broken in vllm-cpu; the module entry point works);
    `cpus` pins its whole process tree."""
    port = port or free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", LOOPBACK, "--port", str(port),
        "--max-model-len", str(max_model_len),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",  # report cached_tokens in usage
        *extra_args,
    ]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    proc = ManagedProcess(name, argv, log_path=log_dir / f"{name}.log", env=env, cpus=cpus)
    return proc, f"http://{LOOPBACK}:{port}"


def dynamo_frontend(
    env: Mapping[str, str],
    log_dir: Path,
    *,
    port: int | None = None,
    router_mode: str = "kv",
    extra_args: Sequence[str] = (),
) -> tuple[ManagedProcess, str]:
    port = port or free_port()
    argv = [
        sys.executable, "-m", "dynamo.frontend",
        "--http-host", LOOPBACK, "--http-port", str(port),
        "--router-mode", router_mode,
        *extra_args,
    ]
    return ManagedProcess("frontend", argv, log_path=log_dir / "frontend.log", env=env), f"http://{LOOPBACK}:{port}"


def dynamo_vllm_worker(
    name: str,
    model: str | Path,
    env: Mapping[str, str],
    log_dir: Path,
    *,
    max_model_len: int = 4096,
    kv_events_port: int | None = None,
    extra_args: Sequence[str] = (),
    cpus: Sequence[int] | None = None,
) -> ManagedProcess:
    """A plain `dynamo.vllm` worker (through our text-only entry point); `cpus` pins it."""
    kv_events_port = kv_events_port or free_port()
    argv = [
        sys.executable, "-m", "maru_dynamo.components.vllm_worker",
        "--model", str(model),
        "--max-model-len", str(max_model_len),
        "--enforce-eager",
        # vLLM binds its KV-event publisher itself; `tcp://127.0.0.1:N` silently delivers nothing.
        "--kv-events-config",
        json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_events_port}"}),
        *extra_args,
    ]
    return ManagedProcess(name, argv, log_path=log_dir / f"{name}.log", env=env, cpus=cpus)
