"""Benchmark-only tracer: times chosen vLLM and connector methods in every engine process.

`benchmarks/profile_hit.py` puts this directory first on PYTHONPATH and sets MARU_HOOK_TRACE to
a path prefix; every Python process of the engine (API server, engine core, worker) then appends
one line per call, `<perf_counter at entry> <Class.method> <milliseconds>`, to `<prefix>.<pid>`.
perf_counter is CLOCK_MONOTONIC, so lines of different processes share one time axis. Without
MARU_HOOK_TRACE nothing is patched.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import os
import sys
import time

TRACED: dict[str, list[tuple[str, str]]] = {
    "vllm.v1.engine.core": [("EngineCore", "step")],
    "vllm.v1.core.sched.scheduler": [("Scheduler", "schedule"), ("Scheduler", "update_from_output")],
    "vllm.v1.worker.gpu_model_runner": [("GPUModelRunner", "execute_model"), ("GPUModelRunner", "sample_tokens")],
    "maru_vllm.connector.connector": [
        ("MaruKVConnector", "get_num_new_matched_tokens"),
        ("MaruKVConnector", "build_connector_meta"),
        ("MaruKVConnector", "start_load_kv"),
        ("MaruKVConnector", "wait_for_save"),
    ],
    "maru_vllm.connector.worker": [("MaruWorkerSide", "_acquire"), ("MaruWorkerSide", "_load_batched")],
    "maru_vllm.connector.pool_access": [("PoolAccess", "release")],
}

_prefix = os.environ.get("MARU_HOOK_TRACE")
_lines: list[str] = []


def _flush() -> None:
    if _lines:
        with open(f"{_prefix}.{os.getpid()}", "a") as f:
            f.write("".join(_lines))
        _lines.clear()


def _timed(fn, label: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _lines.append(f"{t0:.6f} {label} {(time.perf_counter() - t0) * 1e3:.4f}\n")
            if len(_lines) >= 16:  # written between requests too: profile_hit.py sends trailing ones
                _flush()

    return wrapper


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the traced modules through the other finders, then wraps their methods once loaded."""

    def find_spec(self, name, path, target=None):
        if name not in TRACED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            for cls_name, meth in TRACED[name]:
                cls = getattr(module, cls_name, None)
                if cls is not None and meth in vars(cls):
                    setattr(cls, meth, _timed(vars(cls)[meth], f"{cls_name}.{meth}"))

        spec.loader.exec_module = exec_module
        return spec


if _prefix:
    atexit.register(_flush)
    sys.meta_path.insert(0, _PatchOnImport())
