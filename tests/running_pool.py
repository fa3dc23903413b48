"""A real pool service for one test module: `with running_pool("16M") as pool: ...`."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from maru_vllm.launch.stack import PoolProcess


@contextlib.contextmanager
def running_pool(size: str = "64M") -> Iterator[PoolProcess]:
    """`python -m maru_vllm.pool serve` on a unix socket in a private temporary folder."""
    d = Path(tempfile.mkdtemp(prefix="mp-", dir="/tmp"))  # short: unix socket paths are limited
    name = f"ts{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pool = PoolProcess(name, size, d / f"{name}.log", listen=[f"unix://{d / name}.sock"])
    try:
        yield pool.serve()
    finally:
        pool.stop()
        pool.region_path.unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)
