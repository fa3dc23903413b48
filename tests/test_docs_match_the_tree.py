"""The docs' inventories match what is in the repository: docs/design.md's module table lists
every source module (and only modules that exist), the README's extras table says what
pyproject.toml declares, and the LICENSE file is the licence pyproject.toml names."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
README = ROOT / "README.md"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# The source folders the module table covers, and what counts as a module in them.
SOURCE_FOLDERS = ("maru_vllm", "components", "graphs")
MODULE_ROW = re.compile(r"^\|\s*`((?:" + "|".join(SOURCE_FOLDERS) + r")/[^`]+)`\s*\|", re.M)


def modules_on_disk() -> set[str]:
    """Every Python module (package `__init__.py` files aside) and C source under SOURCE_FOLDERS."""
    out = set()
    for folder in SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            if (path.suffix == ".py" and path.name != "__init__.py") or path.suffix == ".c":
                out.add(str(path.relative_to(ROOT)))
    return out


def modules_in_the_table(text: str) -> list[str]:
    """The first cells of design.md's table rows that name a file under SOURCE_FOLDERS."""
    return MODULE_ROW.findall(text)


def test_the_module_table_lists_every_module_and_only_modules_that_exist() -> None:
    listed = modules_in_the_table(DESIGN.read_text())
    on_disk = modules_on_disk()
    assert len(on_disk) > 50, f"found only {len(on_disk)} modules: is SOURCE_FOLDERS right?"
    missing = sorted(on_disk - set(listed))
    gone = sorted(set(listed) - on_disk)
    twice = sorted({m for m in listed if listed.count(m) > 1})
    problems = [f"{m}: not in docs/design.md's module table" for m in missing]
    problems += [f"{m}: in docs/design.md's module table, but there is no such file" for m in gone]
    problems += [f"{m}: listed more than once in docs/design.md's module table" for m in twice]
    assert not problems, "\n".join(problems)


def test_the_module_table_check_sees_a_missing_and_a_stale_row() -> None:
    rows = "| `maru_vllm/pool/allocator.py` | pages |\n| `graphs/nothing_here.py` | gone |\n| `x/y.py` | other |\n"
    assert modules_in_the_table(rows) == ["maru_vllm/pool/allocator.py", "graphs/nothing_here.py"]
    assert "maru_vllm/pool/allocator.py" in modules_on_disk()
    assert "graphs/nothing_here.py" not in modules_on_disk()
    assert not any(m.endswith("__init__.py") for m in modules_on_disk())


def _readme_extras() -> dict[str, set[str]]:
    """README's "Installation details" table: extra name -> the requirements its row shows."""
    section = README.read_text().split("## Installation details", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("extra", "---"):
            continue
        names = re.findall(r"`([^`]+)`", cells[0]) or ["(base)"]
        shown = set(re.findall(r"`([^`]+)`", cells[1]))
        for name in names:
            out[name] = shown
    return out


def _as_shown(requirement: str) -> str:
    """How the README shows a requirement: exact pins with their version, ranges by name."""
    req = Requirement(requirement)
    pins = [s.version for s in req.specifier if s.operator == "=="]
    return f"{req.name}=={pins[0]}" if pins else req.name


def _normal(shown: str) -> str:
    name, _, version = shown.partition("==")
    return canonicalize_name(name) + (f"=={version}" if version else "")


def test_the_readme_extras_table_matches_pyproject() -> None:
    declared = {"(base)": PYPROJECT["project"]["dependencies"], **PYPROJECT["project"]["optional-dependencies"]}
    rows = _readme_extras()
    assert sorted(rows) == sorted(declared), "README's extras table and pyproject.toml name different extras"
    # A row naming several extras shows all of their requirements together.
    by_row: dict[frozenset[str], set[str]] = {}
    for extra, shown in rows.items():
        by_row.setdefault(frozenset(shown), set()).add(extra)
    for shown, extras in by_row.items():
        want = {_normal(_as_shown(r)) for e in extras for r in declared[e]}
        got = {_normal(s) for s in shown}
        assert got == want, f"README's row for {sorted(extras)} shows {sorted(got)}, pyproject.toml has {sorted(want)}"


def test_the_license_file_is_the_licence_pyproject_declares() -> None:
    declared = PYPROJECT["project"]["license"]["text"]
    assert declared == "Apache-2.0", f"pyproject.toml declares {declared}: put that licence's text in LICENSE"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


RUNBOOK = ROOT / "docs" / "operations.md"
TESTS_SECTION = "## The tests behind this page"
TEST_REF = re.compile(r"`(tests/[\w/.-]+\.py)(?:::(\w+))?`")


def test_the_runbook_names_tests_only_in_its_last_table_and_each_exists() -> None:
    text = RUNBOOK.read_text()
    assert TESTS_SECTION in text, f"docs/operations.md has no {TESTS_SECTION!r} section"
    body, table = text.split(TESTS_SECTION, 1)
    problems = [f"{m.group(0)}: a test id outside {TESTS_SECTION!r}" for m in TEST_REF.finditer(body)]
    refs = TEST_REF.findall(table)
    assert len(refs) > 20, f"only {len(refs)} test ids in the runbook's table"
    for path, name in refs:
        f = ROOT / path
        if not f.is_file():
            problems.append(f"{path}: no such file")
        elif name and not re.search(rf"^\s*(async\s+)?def {re.escape(name)}\(", f.read_text(), re.M):
            problems.append(f"{path}::{name}: no such test")
    assert not problems, "\n".join(problems)


MODEL_MATRIX = ROOT / "tests" / "e2e" / "test_model_matrix.py"


def test_the_readme_model_tables_tp_column_is_what_the_matrix_runs() -> None:
    """Each row of "Supported models" gives a TP size for the fixtures it names; the matrix runs a
    case of each of them at that size (`tp=N` in its Case, 1 when it has none)."""
    section = README.read_text().split("## Supported models", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Shape")]
    cases = re.findall(r'Case\(\s*"([\w-]+)"[^)]*?\)', MODEL_MATRIX.read_text())
    sized = {(f, int(tp)) for f, tp in re.findall(r'Case\(\s*"([\w-]+)"[^)]*?\btp=(\d+)', MODEL_MATRIX.read_text())}
    sizes = {(f, 1) for f in cases} | sized
    checked = 0
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[1].isdigit():
            continue
        for fixture in [f for f in re.findall(r"`([\w-]+)`", cells[0]) if f in cases]:
            assert (fixture, int(cells[1])) in sizes, f"{fixture} at TP {cells[1]}: no such case in {MODEL_MATRIX.name}"
            checked += 1
    assert checked >= 10 and any(size > 1 for _, size in sized), f"read only {checked} rows"
