"""Fixtures of the what-if tests: the Mooncake traces beside the repository (../shared/traces)."""

from __future__ import annotations

from pathlib import Path

import pytest

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


@pytest.fixture(scope="session")
def synthetic_trace() -> Path:
    path = TRACES / "mooncake_synthetic.jsonl"
    assert path.is_file(), f"{path} is missing: the Mooncake traces live in ../shared/traces beside the repository"
    return path
