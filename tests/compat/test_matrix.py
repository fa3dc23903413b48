"""`make compat`'s matrix: what it prints, what it records in its JSON file, what it refuses."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from scripts.compat import matrix
from scripts.compat.engines import run_engines_level


def test_a_static_run_of_one_release_is_recorded_with_its_date_and_keeps_other_cells(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "compat-matrix.json"
    earlier = {"scheduler": {"status": "pass", "detail": "26 passed, 0 failed", "date": "2026-01-01"}}
    out.write_text(json.dumps({"levels": list(matrix.LEVELS), "releases": {"vllm==0.33.0": earlier}}))

    assert matrix.main(["--levels", "static", "--vllm", "0.34.0", "--out", str(out)]) == 0

    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("vllm==0.34.0"))
    assert row.split()[1:] == ["pass", "-", "-"]
    text = out.read_text()
    recorded = json.loads(text)
    assert text == json.dumps(recorded, indent=2, sort_keys=True) + "\n"  # stable: a rerun diffs only what changed
    cell = recorded["releases"]["vllm==0.34.0"]["static"]
    assert cell["status"] == "pass" and cell["checked"] > 0
    assert cell["date"] == datetime.date.today().isoformat()
    assert recorded["releases"]["vllm==0.33.0"]["scheduler"] == earlier["scheduler"]


def test_unknown_levels_and_unsupported_releases_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        matrix.main(["--levels", "static,gpu", "--no-write"])
    assert exc.value.code == 2
    assert "unknown level(s) gpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        matrix.main(["--vllm", "0.30.0", "--no-write"])
    assert "vLLM 0.30.0 is not a supported release" in capsys.readouterr().err


def test_a_release_without_an_environment_is_not_run_rather_than_failed() -> None:
    result = run_engines_level("0.34.0")  # no CPU build of 0.34 is published, so no venv holds it
    assert not result.ok and result.passed == 0
    assert result.first_error == "not run: no environment here holds vllm 0.34.0 (no CPU build of it)"
    assert matrix.tests_cell(result)["status"] == "not run"
