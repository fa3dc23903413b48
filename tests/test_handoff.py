"""A worker handed over to Dynamo's entry point ends with that entry point's status once it is done:
exit handlers run and output is flushed, and no thread the runtime left behind keeps the process
alive or runs into a finalizing interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "entry_point.py").write_text(textwrap.dedent(body))
    launcher = textwrap.dedent(
        """
        import atexit, sys
        from maru_vllm.launch.handoff import run_module_then_exit
        atexit.register(lambda: print("exit handlers ran"))
        run_module_then_exit("entry_point", ["--flag"])
        """
    )
    return subprocess.run(
        [sys.executable, "-c", launcher],
        cwd=REPO,
        env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_finished_entry_point_ends_the_process_even_with_a_thread_still_running(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        import sys, threading
        threading.Thread(target=threading.Event().wait, name="runtime-thread").start()  # never ends
        print("served", sys.argv[1:], end="")  # no newline: flushed on the way out all the same
        """,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("served ['--flag']") and "exit handlers ran" in out.stdout


@pytest.mark.parametrize(
    ("body", "status", "stderr"),
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit('bad value: --flag')", 1, "bad value: --flag"),
        ("raise ValueError('engine failed')", 1, "ValueError: engine failed"),
    ],
)
def test_the_entry_points_exit_status_is_the_process_s(tmp_path: Path, body: str, status: int, stderr: str) -> None:
    out = _run(tmp_path, body)
    assert out.returncode == status
    assert stderr in out.stderr
    assert "exit handlers ran" in out.stdout
