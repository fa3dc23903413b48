"""ManagedProcess(cpus=...): pinning reaches the process and everything it starts; bad cores are refused."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from maru_vllm.launch import ManagedProcess

# The child prints its own CPU set and that of a grandchild it starts (as vLLM starts its engine core).
REPORT_AFFINITY = (
    "import os, subprocess, sys\n"
    "print('child', sorted(os.sched_getaffinity(0)), flush=True)\n"
    "subprocess.run([sys.executable, '-c', 'import os; print(\"grandchild\", sorted(os.sched_getaffinity(0)))'])\n"
)


def _run(tmp_path: Path, cpus: list[int] | None) -> str:
    proc = ManagedProcess(
        "probe", [sys.executable, "-c", REPORT_AFFINITY], log_path=tmp_path / "probe.log", cpus=cpus
    ).start()
    assert proc.proc is not None
    assert proc.proc.wait(timeout=60) == 0
    return proc.log_text()


def test_pinned_process_and_its_children_run_on_the_given_core(tmp_path: Path) -> None:
    core = max(os.sched_getaffinity(0))
    text = _run(tmp_path, [core])
    assert f"child [{core}]" in text
    assert f"grandchild [{core}]" in text


def test_unpinned_process_keeps_the_parents_cores(tmp_path: Path) -> None:
    text = _run(tmp_path, None)
    assert f"child {sorted(os.sched_getaffinity(0))}" in text


def test_pinning_to_a_core_that_is_not_usable_is_a_clear_error(tmp_path: Path) -> None:
    missing = (os.cpu_count() or 1) + 64
    with pytest.raises(ValueError) as err:
        ManagedProcess("probe", [sys.executable, "-c", "pass"], log_path=tmp_path / "p.log", cpus=[missing])
    assert f"cannot pin to cores [{missing}]" in str(err.value)
    assert f"may use cores {sorted(os.sched_getaffinity(0))}" in str(err.value)


def test_failure_report_shows_the_first_traceback_even_when_the_tail_does_not(tmp_path: Path) -> None:
    # An engine core's root cause comes long before its parent's traceback and shutdown noise.
    script = (
        "import traceback\n"
        "try:\n    raise OSError('Address already in use (root cause)')\n"
        "except OSError:\n    traceback.print_exc()\n"
        "for i in range(200):\n    print('noise', i)\n"
        "raise SystemExit(3)\n"
    )
    proc = ManagedProcess("crash", [sys.executable, "-c", script], log_path=tmp_path / "crash.log").start()
    assert proc.proc is not None and proc.proc.wait(timeout=60) == 3
    assert "root cause" not in proc.log_tail(60)
    report = proc.failure_report(tail=60)
    assert "Address already in use (root cause)" in report
    assert report.rstrip().endswith("noise 199")
