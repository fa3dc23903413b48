"""The routing comparison's command line refuses bad values before it starts anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "routing_comparison.py"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--window", "0"], "--window must be >= 1 (requests in flight at each routing decision), got 0"),
        (["--hot-sessions", "9"], "WorkloadSpec.hot_sessions must be between 0 and sessions (7), got 9"),
        (["--sessions", "1", "--hot-sessions", "0"], "1 sessions (0 of them hot) cannot cover 2 system prompts"),
        (
            ["--configs", "kv-gpu,bogus"],
            "unknown configs: bogus (choose from round-robin, kv-gpu, kv-gpu+pool, kv-pool)",
        ),
    ],
)
def test_bad_values_are_named_with_what_is_allowed(args: list[str], message: str) -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr, res.stderr
