"""The connector's one start-up line: what it runs on and what it enabled.

Every engine start says, in one line of the engine log, the vLLM, LMCache, torch and Dynamo
releases installed and which copy path the connector took (LMCache's kernel path or the torch
path, and why). A release outside `maru_vllm.versions` is named in the same line, at WARNING:
the connector still serves (every hook fails closed), but nothing outside those releases was
tested. Logged once per engine, by the worker of rank 0.
"""

from __future__ import annotations

import logging

from maru_vllm.connector.kernels import kernel_path_summary
from maru_vllm.versions import stack_versions, unsupported


def copy_path(device_type: str, use_lmcache_kernels: bool, copy_format: str) -> str:
    """Which copies this engine runs, and why (`kernels.kernel_path_summary`), and its objects' format."""
    return f"{kernel_path_summary(device_type, use_lmcache_kernels)}; object format {copy_format}"


def stack_line(copy_path: str) -> tuple[int, str]:
    """(log level, line) for this engine; `copy_path` says which copies run and why."""
    versions = stack_versions()
    stack = ", ".join(f"{name} {version or 'not installed'}" for name, version in versions.items())
    line = f"MaruKVConnector on {stack}; {copy_path}"
    problems = unsupported(versions)
    if problems:
        return logging.WARNING, f"{line}; {'; '.join(problems)}: the connector serves, untested on it"
    return logging.INFO, line
