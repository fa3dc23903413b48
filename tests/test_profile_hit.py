"""benchmarks/profile_hit.py's tracer: it times the named methods in a fresh process when asked,
and leaves everything alone when not; the report sums a request's calls inside its window."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import profile_hit  # noqa: E402 - benchmarks/ is not a package

CALL_RELEASE = (
    "import types\n"
    "from maru_vllm.connector.pool_access import PoolAccess\n"
    "fake = types.SimpleNamespace(_contained=lambda *a, **k: None, _client=types.SimpleNamespace(release=None))\n"
    "PoolAccess.release(fake, [])\n"
    "print(hasattr(PoolAccess.release, '__wrapped__'))\n"
)


def _run(tmp_path: Path, trace: bool) -> str:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'benchmarks' / 'hooktrace'}:{REPO}"}
    env.pop("MARU_HOOK_TRACE", None)
    if trace:
        env["MARU_HOOK_TRACE"] = str(tmp_path / "hooks")
    out = subprocess.run([sys.executable, "-c", CALL_RELEASE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_tracer_times_named_methods_only_when_asked(tmp_path):
    assert _run(tmp_path, trace=False) == "False"
    assert not list(tmp_path.iterdir())
    assert _run(tmp_path, trace=True) == "True"
    rows = profile_hit.read_trace(tmp_path / "hooks")
    assert [label for _, label, _ in rows] == ["PoolAccess.release"]
    assert rows[0][2] >= 0


def test_parts_in_sums_the_calls_inside_the_window():
    rows = [(1.0, "A", 2.0), (2.0, "A", 3.0), (2.5, "B", 1.0), (9.0, "A", 7.0)]
    assert profile_hit.parts_in(rows, 1.5, 3.0) == {"A": 3.0, "B": 1.0}
    assert profile_hit.parts_in(rows, 0.0, 10.0) == {"A": 12.0, "B": 1.0}
