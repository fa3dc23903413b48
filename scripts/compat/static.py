"""The static level of the compatibility matrix: every upstream symbol we touch, in every release.

Two sources of symbols, both checked against each supported release's *source tree* (fetched by
`sources.release_source`, never imported, never installed; Dynamo's tree is the `ai-dynamo` wheel
plus the `ai-dynamo-runtime` wheel of the same version, which together make the `dynamo` package):

* the import scan (`collect_uses`): every `import`/`from ... import` of vLLM, LMCache and Dynamo in
  our sources (`maru_vllm/`, `components/`, `graphs/`), at any depth (functions, `try` blocks,
  `TYPE_CHECKING`); every string that is an upstream module's dotted name (what
  `importlib.import_module` and `runpy` get, directly or through a module-level constant) and every
  `("module", "name")` pair; and every literal attribute read on a name an upstream import bound
  (`dm.register_vllm_model`, `getattr(dm, "create_runtime", None)`);
* the declared contracts of `maru_vllm.upstream_contracts`: fields, methods and parameters our
  code relies on in upstream objects, which no import shows.

How a release's tree is read is `source_tree.SourceTree`'s docstring. A compiled module is checked
through its `.pyi` stub or its pybind11 bindings in the sdist's `csrc/` (`PYBIND11_MODULE`,
`m.def("name"`, `py::enum_`/`py::class_` with their values and fields).

An absence is *handled* when our code expects it: the use sits in a `try` that catches the
`ImportError`, reads the attribute with a `getattr` default or `hasattr`, or is a name our code
looks up at run time that a contract declares optional or moved (found at one of its
alternatives). Anything else is *missing*: the report names the symbol, our use sites, the first
supported release lacking it and its history across releases.

    python scripts/compat/static.py            # every supported release of vLLM, LMCache, Dynamo
    python scripts/compat/static.py --dist lmcache --json
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from maru_vllm.upstream_contracts import CONTRACTS, Contract  # noqa: E402
from maru_vllm.versions import DYNAMO, LMCACHE, VLLM  # noqa: E402
from scripts.compat.source_tree import PACKAGES, SourceTree, split_attr  # noqa: E402

# Distributions installed at the same version into the same namespace (checked as one tree).
COMPANIONS = {"ai-dynamo": ("ai-dynamo-runtime",)}
OUR_SOURCES = ("maru_vllm", "components", "graphs")
# Checked as contracts, not scanned: the contracts module names every module it declares.
NOT_SCANNED = ("maru_vllm/upstream_contracts.py",)
# Strings of our sources shaped like module names that are not (checked for, never resolved).
NOT_MODULES = {"dynamo.backend.generate": "a Dynamo endpoint path, namespace.component.endpoint"}
HANDLING_ERRORS = {"ImportError", "ModuleNotFoundError", "AttributeError", "Exception", "BaseException"}
_DOTTED = re.compile(r"^(?:{})(?:\.[A-Za-z_]\w*)+$".format("|".join(PACKAGES)))


# ---------------------------------------------------------------- what our sources use


@dataclasses.dataclass(frozen=True, order=True)
class Use:
    """One upstream symbol our code names: `module` (+ `path`, names looked up in it), at `site`."""

    module: str
    path: tuple[str, ...]
    site: str  # "maru_vllm/connector/kernels.py:154"
    guard: str = ""  # why an absence is expected right there ("" when it is not)
    kind: str = "import"  # import | string | attribute

    @property
    def dist(self) -> str:
        return PACKAGES[self.module.split(".")[0]]

    @property
    def symbol(self) -> str:
        return self.module + (":" + ".".join(self.path) if self.path else "")


def _is_upstream(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in PACKAGES  # type: ignore[union-attr]


class _Collector(ast.NodeVisitor):
    def __init__(self, rel: str, tree: ast.Module) -> None:
        self.rel = rel
        self.uses: list[Use] = []
        self.guards = [""]
        self.bound: dict[str, tuple[str, tuple[str, ...]]] = {}
        self.consts: dict[str, str] = {}
        for node in ast.walk(tree):  # bindings first: a function may use a name imported below it
            if isinstance(node, ast.Import):
                for a in node.names:
                    if _is_upstream(a.name) and a.asname:
                        self.bound[a.asname] = (a.name, ())
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_upstream(node.module):
                for a in node.names:
                    if a.name != "*":
                        self.bound[a.asname or a.name] = (node.module, (a.name,))  # type: ignore[assignment]
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
                for t in stmt.targets:
                    if isinstance(t, ast.Name) and isinstance(stmt.value.value, str):
                        self.consts[t.id] = stmt.value.value

    def _add(self, node: ast.AST, module: str, path: tuple[str, ...], kind: str, guard: str = "") -> None:
        site = f"{self.rel}:{getattr(node, 'lineno', 0)}"
        self.uses.append(Use(module, path, site, guard or self.guards[-1], kind))

    def visit_Try(self, node: ast.Try) -> None:
        caught = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for h in node.handlers for n in _types(h)}
        hit = sorted(caught & HANDLING_ERRORS)
        self.guards.append(f"try/except {hit[0]}" if hit else self.guards[-1])
        for stmt in node.body:
            self.visit(stmt)
        self.guards.pop()
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    visit_TryStar = visit_Try  # type: ignore[assignment]

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if _is_upstream(a.name):
                self._add(node, a.name, (), "import")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and _is_upstream(node.module):
            for a in node.names:
                self._add(node, node.module, () if a.name == "*" else (a.name,), "import")  # type: ignore[arg-type]

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return  # an f-string's pieces are not names

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and _DOTTED.match(node.value) and node.value not in NOT_MODULES:
            self._add(node, node.value, (), "string")

    def visit_Tuple(self, node: ast.Tuple) -> None:
        """`("lmcache.x.y", "name")` or `(MODULE_CONSTANT, "name")`: a name looked up in a module."""
        if len(node.elts) == 2 and isinstance(node.elts[1], ast.Constant) and isinstance(node.elts[1].value, str):
            first = node.elts[0]
            module = first.value if isinstance(first, ast.Constant) else self.consts.get(getattr(first, "id", ""))
            if isinstance(module, str) and _DOTTED.match(module) and node.elts[1].value.isidentifier():
                self._add(node, module, (node.elts[1].value,), "string")
                return  # the pair names the module too
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        args = node.args
        if name == "import_module" and args and isinstance(args[0], ast.Name) and args[0].id in self.consts:
            value = self.consts[args[0].id]
            if _DOTTED.match(value):
                self._add(node, value, (), "string")
        if name in ("getattr", "hasattr") and len(args) >= 2 and isinstance(args[0], ast.Name):
            target = self.bound.get(args[0].id)
            if target and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
                guard = "hasattr" if name == "hasattr" else ("getattr default" if len(args) > 2 else "")
                self._add(node, target[0], (*target[1], args[1].value), "attribute", guard)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: list[str] = []
        cur: ast.expr = node
        while isinstance(cur, ast.Attribute):
            chain.insert(0, cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id in self.bound:
            keep = []
            for attr in chain[:2]:
                if attr.startswith("__"):
                    break
                keep.append(attr)
            if keep:
                module, path = self.bound[cur.id]
                self._add(node, module, (*path, *keep), "attribute")
            return
        self.generic_visit(node)


def _types(handler: ast.ExceptHandler) -> list[ast.expr]:
    if handler.type is None:
        return [ast.Name("BaseException")]
    return list(handler.type.elts) if isinstance(handler.type, ast.Tuple) else [handler.type]


def collect_source(source: str, rel: str) -> list[Use]:
    """The upstream uses in one file's source (`rel` names it in the sites)."""
    tree = ast.parse(source)
    collector = _Collector(rel, tree)
    collector.visit(tree)
    return sorted(set(collector.uses))


def collect_uses(root: Path = REPO, folders: Sequence[str] = OUR_SOURCES) -> list[Use]:
    """Every upstream use in our sources under `root` (tests and benchmarks are not the product)."""
    uses: list[Use] = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            if str(path.relative_to(root)) in NOT_SCANNED:
                continue
            uses += collect_source(path.read_text(encoding="utf-8"), str(path.relative_to(root)))
    return uses


# ---------------------------------------------------------------- the check


@dataclasses.dataclass
class Finding:
    symbol: str
    sites: list[str]
    state: str  # present | handled | missing
    detail: str = ""


@cache
def _site(rel: str, spec: str) -> str:
    """`rel:line` of the first line of our file `rel` naming the attribute of `spec`."""
    word = split_attr(spec)[0].split("|")[0] if spec else ""
    path = REPO / rel
    if word and path.is_file():
        pattern = re.compile(rf"\b{re.escape(word)}\b")
        lines = path.read_text(encoding="utf-8").splitlines()
        code = next((n for n, line in enumerate(lines) if line.startswith(("import ", "from "))), 0)
        for n, line in enumerate(lines[code:], code + 1):  # past the module docstring
            if pattern.search(line):
                return f"{rel}:{n}"
    return rel


def _contract_findings(tree: SourceTree, c: Contract) -> list[Finding]:
    def sites(spec: str = "") -> list[str]:
        return [_site(f, spec or (c.qualname or c.module).split(".")[-1]) for f in c.used_in]

    targets = [(c.module, c.qualname)] + [tuple(a.split(":", 1)) if ":" in a else (a, "") for a in c.alternatives]

    def gaps(module: str, qualname: str) -> dict[str, str]:
        out: dict[str, str] = {}
        base = tree.find(module, qualname.split(".") if qualname else [])
        if base is not None:
            return {"": base}
        for spec in c.attrs:
            why = tree.lookup_attr(module, qualname, spec)
            if why is not None:
                out[spec] = why
        return out

    own = c.module + (":" + c.qualname if c.qualname else "")
    primary = gaps(c.module, c.qualname)
    required = {k: v for k, v in primary.items() if not k.endswith("?")}

    def name(spec: str) -> str:
        return f"{own}.{split_attr(spec)[0]}" if spec else own

    found = [Finding(name(k), sites(k), "handled", f"optional: {v}") for k, v in primary.items() if k.endswith("?")]
    present = [Finding(name(a), sites(a), "present") for a in c.attrs if a not in primary]
    if not required:
        return [Finding(own, sites(), "present"), *present, *found]
    alt = next(
        (f"{m}:{q}" if q else m for m, q in targets[1:] if not {k for k in gaps(m, q) if not k.endswith("?")}), None
    )
    state = "handled" if alt or c.optional else "missing"
    how = f"moved: {alt} has it" if alt else ("optional: " + c.why if c.optional else "")
    for k, why in required.items():
        found.append(Finding(name(k), sites(k), state, f"{why}; {how}".strip("; ")))
    return [*present, *found]


def check_release(tree: SourceTree, dist: str, uses: Iterable[Use], contracts: Iterable[Contract]) -> list[Finding]:
    """Every symbol of `dist` that we use, found or not in this release's `tree`."""
    findings: dict[str, Finding] = {}
    covered: dict[tuple[str, str], str] = {}  # (our file, upstream module) -> the contract's verdict
    for c in contracts:
        if c.dist != dist:
            continue
        results = _contract_findings(tree, c)
        verdict = "missing" if any(f.state == "missing" for f in results) else "handled"
        for target in (c.module, *(a.split(":", 1)[0] for a in c.alternatives)):
            for ours in c.used_in:
                covered[(ours, target)] = verdict
        for result in results:
            prev = findings.get(result.symbol)
            if prev is None or prev.state == "present":
                findings[result.symbol] = result
    for u in uses:
        if u.dist != dist:
            continue
        module, path = u.module, u.path
        if u.kind == "string":
            module, path = _split_dotted(tree, u.module)
        why: str | None = tree.find(module, list(path))
        sym = u.symbol  # as our code names it: the same symbol in every release
        state, detail = "present", ""
        if why is not None:
            # A contract can only cover a name our code looks up at run time (a string): an
            # import statement cannot follow the contract's alternatives.
            covering = covered.get((u.site.split(":")[0], u.module)) if u.kind == "string" else None
            if u.guard or covering == "handled":
                state, detail = "handled", f"{why}; {u.guard or 'a contract covers it'}"
            else:
                state, detail = "missing", why
        f = findings.setdefault(sym, Finding(sym, [], state, detail))
        f.sites.append(u.site)
        if state == "missing" or (state == "handled" and f.state == "present"):
            f.state, f.detail = state, detail
    return sorted(findings.values(), key=lambda f: f.symbol)


def _split_dotted(tree: SourceTree, dotted: str) -> tuple[str, tuple[str, ...]]:
    """`dynamo.vllm.main.install_signal_handlers` -> ("dynamo.vllm.main", ("install_signal_handlers",))."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if tree.is_module(".".join(parts[:i])):
            return ".".join(parts[:i]), tuple(parts[i:])
    return dotted, ()


def supported_releases() -> dict[str, tuple[str, ...]]:
    return {s.dist: s.releases for s in (VLLM, LMCACHE, DYNAMO)}


def _default_roots(dist: str, version: str) -> list[Path]:
    from scripts.compat.sources import release_source

    return [release_source(d, version) for d in (dist, *COMPANIONS.get(dist, ()))]


def run_static_level(
    releases: Mapping[str, Sequence[str]] | None = None,
    *,
    roots: Callable[[str, str], Sequence[Path]] = _default_roots,
    uses: Sequence[Use] | None = None,
    contracts: Sequence[Contract] = CONTRACTS,
) -> dict:
    """Check every symbol against every release; the report, per `dist==version`.

    Each release: `checked` (symbols), `missing` / `handled` (symbol, our sites, detail,
    `first_missing`: the first release of that distribution lacking it), `verdict`. `ok` is True
    when nothing is missing anywhere."""
    releases = dict(releases or supported_releases())
    uses = collect_uses() if uses is None else uses
    report: dict = {"uses": len(uses), "releases": {}, "ok": True}
    for dist, versions in releases.items():
        first: dict[str, str] = {}
        states: dict[str, dict[str, str]] = {}
        per: list[tuple[str, list[Finding]]] = []
        for version in versions:
            findings = check_release(SourceTree(roots(dist, version)), dist, uses, contracts)
            for f in findings:
                states.setdefault(f.symbol, {})[version] = "present" if f.state == "present" else "absent"
                if f.state != "present":
                    first.setdefault(f.symbol, version)
            per.append((version, findings))
        for version, findings in per:
            rows = {
                state: [
                    {
                        "symbol": f.symbol,
                        "sites": sorted(set(f.sites)),
                        "detail": f.detail,
                        "first_missing": first[f.symbol],
                        "history": _history(versions, states[f.symbol]),
                    }
                    for f in findings
                    if f.state == state
                ]
                for state in ("missing", "handled")
            }
            n_miss, n_handled = len(rows["missing"]), len(rows["handled"])
            verdict = f"{dist}=={version}: " + (
                f"{n_miss} symbol(s) MISSING"
                if n_miss
                else f"ok ({len(findings)} symbols, {n_handled} moved/absent, handled)"
            )
            report["ok"] &= not n_miss
            report["releases"][f"{dist}=={version}"] = {
                "dist": dist,
                "version": version,
                "checked": len(findings),
                **rows,
                "verdict": verdict,
            }
    return report


def _history(versions: Sequence[str], states: Mapping[str, str]) -> str:
    """ "present 0.4.3-0.5.3; absent 0.5.4-0.5.6": where a symbol is, release after release."""
    runs: list[list[str]] = []
    for v in versions:
        state = states.get(v, "absent")
        if runs and runs[-1][0] == state:
            runs[-1][2] = v
        else:
            runs.append([state, v, v])
    return "; ".join(f"{s} {a}" + (f"-{b}" if b != a else "") for s, a, b in runs)


def format_report(report: dict) -> str:
    lines = [f"{'release':<22} {'checked':>7} {'handled':>7} {'missing':>7}"]
    for key, r in report["releases"].items():
        lines.append(f"{key:<22} {r['checked']:>7} {len(r['handled']):>7} {len(r['missing']):>7}")
    shown: set[tuple[str, str]] = set()
    for r in report["releases"].values():
        for state in ("missing", "handled"):
            for row in r[state]:
                seen = (state, row["symbol"])
                if seen in shown:
                    continue  # one line per symbol: its history names the releases
                shown.add(seen)
                lines.append(
                    f"{state.upper() if state == 'missing' else state}: {row['symbol']} [{row['history']}] "
                    f"{row['detail']} - used at {', '.join(row['sites'][:3])}"
                )
    lines += [r["verdict"] for r in report["releases"].values()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dist", action="append", help="vllm, lmcache or ai-dynamo (default: all)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    releases = {d: v for d, v in supported_releases().items() if not args.dist or d in args.dist}
    report = run_static_level(releases)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
