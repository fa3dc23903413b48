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


# A stand-in for a vLLM engine that ignores SIGTERM (named as a fake): it maps a queue file named
# like vLLM's and another /dev/shm file (as an engine maps the pool's region), then waits.
HOLDS_SHM = (
    "import mmap, os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "maps = []\n"
    "for name in sys.argv[1:]:\n"
    "    fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)\n"
    "    os.ftruncate(fd, 4096)\n"
    "    maps.append(mmap.mmap(fd, 4096))\n"
    "print('holding', flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_stop_that_has_to_kill_removes_the_vllm_queues_it_left_and_nothing_else(tmp_path: Path) -> None:
    tag = f"{os.getpid()}-{tmp_path.name}"
    queue, region = Path(f"/dev/shm/psm_fake{tag}"), Path(f"/dev/shm/maru-fake{tag}")
    proc = ManagedProcess(
        "fake-engine", [sys.executable, "-c", HOLDS_SHM, str(queue), str(region)], log_path=tmp_path / "fake.log"
    ).start()
    try:
        proc.wait_until(lambda: "holding" in proc.log_text(), 30, "the fake engine to map its files")
        proc.stop(grace_s=0.5)  # SIGTERM is ignored: the tree is SIGKILLed
        assert not queue.exists()  # vLLM's kind of file, held by nobody now
        assert region.exists()  # not vLLM's: maybe a pool's region, which outlives its users
    finally:
        region.unlink(missing_ok=True)
        queue.unlink(missing_ok=True)
