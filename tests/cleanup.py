"""Stopping a test's processes so that nothing of them is left in /dev/shm."""

from __future__ import annotations

from pathlib import Path

from maru_vllm.launch import ProcessGroup
from maru_vllm.launch.stack import PoolProcess

SHM = Path("/dev/shm")


def stop_leaving_nothing(group: ProcessGroup) -> None:
    """Stop every process of `group` and remove what they leave in /dev/shm: vLLM's segments
    (`ManagedProcess.stop` removes those) and the regions of its pools, which outlive a pool that
    was killed (a warm restart recovers them) or that ran with --keep-region."""
    group.stop_all()
    for proc in group:
        if isinstance(proc, PoolProcess) and proc.region_path.parent == SHM:
            proc.region_path.unlink(missing_ok=True)
