"""The newest supported vLLM release's scheduler drives the connector as the installed one does.

`scripts/compat/scheduler.py` runs the connector's scheduler tests against a release's own sources
(fetched by name from the package index and cached in `.compat-cache/`). Here it runs them
against the newest release in `maru_vllm.versions.VLLM`, so a connector change that breaks on it
fails CI, not a user's upgrade.
"""

from __future__ import annotations

import pytest

from maru_vllm.versions import VLLM
from scripts.compat.scheduler import run_scheduler_level

pytestmark = [pytest.mark.slow]


def test_the_newest_release_schedules_with_the_connector() -> None:
    newest = VLLM.releases[-1]
    result = run_scheduler_level(newest, timeout=600)
    assert result.imported.split("+")[0] == newest, result.summary()
    assert result.ok, result.summary() + "".join(f"\n  failed: {t}" for t in result.failing)
    # Every test of the level ran on it: the sleep-mode checks need no skip from 0.33 on.
    assert result.skipped == 0, result.skip_reasons
    assert result.passed >= 20
