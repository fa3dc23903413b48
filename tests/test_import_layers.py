"""The engine-side package's layers: it never depends on the Dynamo side, the connector never
reaches into the event relay, and no two modules of the pool import each other (read from the
sources, imports inside functions too).

`maru_vllm` is what a vLLM engine loads; `maru_dynamo.components` and `maru_dynamo.graphs` (the
top-level `components/` and `graphs/`, see pyproject's package-dir) build on it. So no module of
`maru_vllm` imports the Dynamo side, and none names one of its modules in a string either
(`importlib.import_module`, `python -m ...` command lines), docstrings included."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "maru_vllm"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every maru_vllm module `path` imports (`from pkg import mod` counts as pkg.mod only)."""
    out: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for n in ast.walk(block)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: not a runtime dependency
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("maru_vllm"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("maru_vllm"):
            for a in node.names:  # a submodule where the name is one, else the module itself
                sub = f"{node.module}.{a.name}"
                out.add(sub if _exists(sub) else node.module)
    return out


def _exists(module: str) -> bool:
    path = ROOT.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _graph(package: str) -> dict[str, set[str]]:
    folder = ROOT.joinpath(*package.split(".")[1:])
    mods = {_module(p): _imports(p) for p in folder.rglob("*.py")}
    return {m: {i for i in deps if i in mods and i != m} for m, deps in mods.items()}


def test_the_connector_never_imports_the_event_relay() -> None:
    offenders = {
        m: sorted(i for i in deps if i.startswith("maru_vllm.events"))
        for m, deps in ((_module(p), _imports(p)) for p in (ROOT / "connector").rglob("*.py"))
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_no_two_pool_modules_import_each_other() -> None:
    graph = _graph("maru_vllm.pool")
    circles = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, set())})
    assert circles == []


def test_the_checks_see_imports() -> None:
    """The two checks above would see the import they forbid (a check that sees nothing passes)."""
    graph = _graph("maru_vllm.pool")
    assert "maru_vllm.pool.messages" in graph["maru_vllm.pool.chunk_codec"]
    assert any(i.startswith("maru_vllm.pool") for i in _imports(ROOT / "connector" / "chunks.py"))


# ---- the engine side never depends on the Dynamo side ------------------------------------------
# What the Dynamo side is installed as, and its source folders' names (never importable as such).
DYNAMO_SIDE = ("maru_dynamo", "components", "graphs")
NAMED_IN_STRING = re.compile(r"\bmaru_dynamo\b")


def dynamo_side_references(source: str) -> list[tuple[int, str]]:
    """(line, what) for every import of the Dynamo side in `source` and every string naming it."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if NAMED_IN_STRING.search(node.value):
                found.append((node.lineno, f"string {node.value[:80]!r}"))
            continue
        else:
            continue
        found += [(node.lineno, f"import {name}") for name in names if name.split(".")[0] in DYNAMO_SIDE]
    return found


def test_maru_vllm_never_imports_or_names_the_dynamo_side() -> None:
    sources = sorted(ROOT.rglob("*.py"))
    assert len(sources) > 50  # the walk reads the package, not an empty folder
    offences = [
        f"{path.relative_to(ROOT.parent)}:{line}: {what}"
        for path in sources
        for line, what in dynamo_side_references(path.read_text(encoding="utf-8"))
    ]
    assert offences == [], "maru_vllm must not depend on maru_dynamo:\n" + "\n".join(offences)


# ---- the engine side stands without Dynamo ------------------------------------------------------
# What hooks into or drives Dynamo lives on the Dynamo side: no module of maru_vllm imports it.


def dynamo_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) for every import of Dynamo's own packages (`dynamo`, `dynamo.*`) in `source`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "dynamo"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "dynamo":
            found.append((node.lineno, str(node.module)))
    return found


def test_maru_vllm_imports_no_dynamo() -> None:
    offences = sorted(
        f"{path.relative_to(ROOT.parent)}:{line}: import {module}"
        for path in ROOT.rglob("*.py")
        for line, module in dynamo_imports(path.read_text(encoding="utf-8"))
    )
    assert offences == [], "the engine side must stand without Dynamo:\n" + "\n".join(offences)
    # the check sees what it forbids
    assert dynamo_imports("import dynamo.vllm.main as dm\nfrom dynamo.llm import KvRouter\n") == [
        (1, "dynamo.vllm.main"),
        (2, "dynamo.llm"),
    ]


def test_the_check_sees_every_way_of_naming_the_dynamo_side() -> None:
    source = """
import maru_dynamo.graphs
from maru_dynamo.components import cli
import graphs.run as run
from components import pool

def lazy(name):
    import importlib
    importlib.import_module("maru_dynamo.graphs.cli")
    return ["-m", f"maru_dynamo.components.{name}"]
"""
    assert [line for line, _ in dynamo_side_references(source)] == [2, 3, 4, 5, 9, 10]
    clean = '''
"""The pool; `maru-dynamo pool serve` runs it (names of the CLI are not modules)."""
from maru_vllm.pool import PoolClient
from . import sibling
import dynamo.vllm
PROG = "maru-dynamo"
'''
    assert dynamo_side_references(clean) == []
