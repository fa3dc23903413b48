"""A released source tree, read and never imported: which modules, names and class attributes it has.

`SourceTree(roots).find(module, path)` says whether `module` (a `.py`, a package `__init__`, a
`.pyi` stub, a namespace package, or a pybind11 module declared in the tree's `csrc/` C++
sources) binds `path` (`("Engine", "step")`): at module level a def, class, assignment, re-export,
star-imported name, submodule, or a name a module `__getattr__` serves (lazy export, known by its
string in the module); in a class a method, property, class-level or `self.` assignment,
dataclass field (and the `__init__` a dataclass decorator writes), or the same in a base class
defined in the tree. Attribute specs: `name`, `name?` (optional), `name(a, b)` (leading
parameters), `name(*, a, b)` (keyword parameters), `a|b+c` (a, or both b and c). A compiled
module that only exists as a shared object (no stub, no pybind source) is present and its names
are not checked. Used by `static.py`, the static level of the compatibility matrix.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path

# Top-level package -> the distribution that ships it.
PACKAGES = {"vllm": "vllm", "lmcache": "lmcache", "dynamo": "ai-dynamo"}

_PYBIND_MODULE = re.compile(r"PYBIND11_MODULE\(\s*(\w+)\s*,\s*(\w+)\s*\)")
_BINDING = r"(?:\b{v}\s*\.\s*(?:def|attr)\s*\(\s*\"(\w+)\"|py::(?:enum_|class_)<[^;]*?>\s*\(\s*{v}\s*,\s*\"(\w+)\")"


@dataclasses.dataclass
class _Names:
    defined: dict[str, ast.AST | None]  # name -> its def/class node (None: an assignment)
    reexports: dict[str, tuple[str, str]]  # name -> (module, name) it was imported from
    stars: list[str]
    lazy: bool
    strings: set[str]
    members: dict[str, set[str]]  # compiled modules: class/enum -> its members


class SourceTree:
    """One release's sources (several roots for companion distributions), read, never imported."""

    def __init__(self, roots: Sequence[Path]) -> None:
        self.roots = [Path(r) for r in roots]
        self.compiled_only: set[str] = set()

    def _file(self, module: str) -> Path | None:
        rel = Path(*module.split("."))
        for root in self.roots:
            for cand in (rel.with_suffix(".py"), rel / "__init__.py", rel.with_suffix(".pyi"), rel / "__init__.pyi"):
                if (root / cand).is_file():
                    return root / cand
        return None

    @cache  # noqa: B019 - one tree per release, kept for the run
    def _pybind(self) -> dict[str, _Names]:
        found: dict[str, _Names] = {}
        for root in self.roots:
            csrc = root / "csrc"
            files = [p for ext in ("cpp", "cc", "cu") for p in csrc.rglob(f"*.{ext}")] if csrc.is_dir() else []
            for path in files:
                text = path.read_text(encoding="utf-8", errors="replace")
                for m in _PYBIND_MODULE.finditer(text):
                    top = next((p for p, d in PACKAGES.items() if (root / p).is_dir()), "")
                    names = found.setdefault(f"{top}.{m.group(1)}", _Names({}, {}, [], False, set(), {}))
                    binding = re.compile(_BINDING.format(v=re.escape(m.group(2))), re.S)
                    for b in binding.finditer(text):
                        names.defined[b.group(1) or b.group(2)] = None
                        if b.group(2):
                            end = text.find(";", b.end())
                            values = re.findall(
                                r"\.(?:value|def_readwrite|def_readonly|def_property)\(\s*\"(\w+)\"",
                                text[b.end() : end],
                            )
                            names.members.setdefault(b.group(2), set()).update(values)
        return found

    def is_module(self, module: str) -> bool:
        if self._file(module) is not None or module in self._pybind():
            return True
        rel = Path(*module.split("."))
        for root in self.roots:
            if (root / rel).is_dir() and any((root / rel).glob("*.py")):
                return True  # a namespace package
            if any((root / rel).parent.glob(f"{rel.name}.*.so")) or (root / rel).with_suffix(".so").exists():
                self.compiled_only.add(module)
                return True
        return False

    @cache  # noqa: B019
    def names(self, module: str) -> _Names:
        if module in self._pybind():
            return self._pybind()[module]
        out = _Names({}, {}, [], False, set(), {})
        path = self._file(module)
        if path is None:
            return out
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        stack: list[ast.stmt] = list(tree.body)
        while stack:
            stmt = stack.pop()
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.defined[stmt.name] = stmt
                out.lazy |= stmt.name == "__getattr__"
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            out.defined[n.id] = None
            elif isinstance(stmt, ast.Import):
                for a in stmt.names:
                    out.defined[a.asname or a.name.split(".")[0]] = None
            elif isinstance(stmt, ast.ImportFrom):
                base = _absolute(stmt, package)
                for a in stmt.names:
                    if a.name == "*":
                        out.stars.append(base)
                    else:
                        out.reexports[a.asname or a.name] = (base, a.name)
            for field in ("body", "orelse", "finalbody", "handlers"):
                if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    stack += [s for s in getattr(stmt, field, []) if isinstance(s, ast.stmt)]
                    for h in getattr(stmt, field, []):
                        if isinstance(h, ast.ExceptHandler):
                            stack += h.body
        if out.lazy:
            out.strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        return out

    def find(self, module: str, path: Sequence[str], depth: int = 0) -> str | None:
        """None when `module` has `path`; else what is missing (e.g. "no module x", "no B.attr")."""
        if not self.is_module(module):
            return f"no module {module}"
        if not path or module in self.compiled_only or depth > 8:
            return None
        spec, rest = path[0], list(path[1:])
        name, params = split_attr(spec)
        ns = self.names(module)
        if name in ns.defined:
            node = ns.defined[name]
            if params is not None and not rest and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return _params_differ(f"{module}.{name}", node, params)
            if not rest or node is None:
                if rest and name in ns.members:
                    return None if rest[0] in ns.members[name] else f"no {name}.{rest[0]}"
                return None
            if isinstance(node, ast.ClassDef):
                return self._class_find(module, node, rest, depth)
            return None
        if name in ns.reexports:
            src, src_name = ns.reexports[name]
            if src.split(".")[0] not in PACKAGES or not self.is_module(src):
                return None  # re-exported from elsewhere: present, its attributes unchecked
            if self.is_module(f"{src}.{src_name}") and src_name not in self.names(src).defined:
                return self.find(f"{src}.{src_name}", rest, depth + 1)
            return self.find(src, [spec.replace(name, src_name, 1), *rest], depth + 1)
        if self.is_module(f"{module}.{name}"):
            return self.find(f"{module}.{name}", rest, depth + 1)
        for star in ns.stars:
            if self.is_module(star) and self.find(star, [name], depth + 1) is None:
                return self.find(star, path, depth + 1)
        if ns.lazy and name in ns.strings:
            return None  # served by the module's __getattr__
        return f"no {module}.{name}"

    def _class_find(self, module: str, cls: ast.ClassDef, rest: list[str], depth: int) -> str | None:
        attr, params = split_attr(rest[0])
        hit = _class_member(cls, attr)
        if hit is None and attr == "__init__" and _is_dataclass(cls):
            hit = _dataclass_init(cls)
        if hit is not None:
            if params is None or not isinstance(hit, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return None
            return _params_differ(f"{cls.name}.{attr}", hit, params)
        for base in cls.bases:
            base_name = base.id if isinstance(base, ast.Name) else None
            if base_name is None or depth > 8:
                continue
            where = self._class_home(module, base_name)
            if where is not None:
                home, node = where
                if self._class_find(home, node, rest, depth + 1) is None:
                    return None
        return f"no {cls.name}.{attr}"

    def _class_home(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        ns = self.names(module)
        node = ns.defined.get(name)
        if isinstance(node, ast.ClassDef):
            return module, node
        if name in ns.reexports and depth < 8:
            src, src_name = ns.reexports[name]
            if src.split(".")[0] in PACKAGES and self.is_module(src):
                return self._class_home(src, src_name, depth + 1)
        return None

    def lookup_attr(self, module: str, qualname: str, spec: str) -> str | None:
        """None when `module.qualname` has `spec`: `name`, `name?`, `name(a, b)`, `a|b+c` (a, or b and c)."""
        why = None
        for choice in spec.rstrip("?").split("|"):
            whys = [self.find(module, [*qualname.split("."), one] if qualname else [one]) for one in choice.split("+")]
            why = next((w for w in whys if w is not None), None)
            if why is None:
                return None
        return why


def _absolute(stmt: ast.ImportFrom, package: str) -> str:
    if not stmt.level:
        return stmt.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - stmt.level + 1]
    return ".".join([*base, stmt.module] if stmt.module else base)


def split_attr(spec: str) -> tuple[str, list[str] | None]:
    """`name(a, b)` -> ("name", ["a", "b"]); `name?` and `name` -> ("name", None)."""
    spec = spec.rstrip("?")
    if "(" not in spec:
        return spec, None
    name, _, inner = spec.partition("(")
    return name.strip(), [p.strip() for p in inner.rstrip(")").split(",") if p.strip()]


def _class_member(cls: ast.ClassDef, attr: str) -> ast.AST | None:
    """What binds `attr` in `cls`: a def or class-level assignment in its body, or `self.attr = ...`."""
    body = list(cls.body)
    while body:
        stmt = body.pop()
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == attr:
            return stmt
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(n, ast.Name) and n.id == attr for t in targets for n in ast.walk(t)):
                return stmt
        if isinstance(stmt, (ast.If, ast.Try)):
            body += [*stmt.body, *stmt.orelse, *getattr(stmt, "finalbody", [])]
    for node in ast.walk(cls):  # instance attributes, set in any method
        stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        if stored and node.attr == attr and _is_self(node.value):  # type: ignore[attr-defined]
            return node
    return None


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _is_dataclass(cls: ast.ClassDef) -> bool:
    names = {ast.unparse(d.func if isinstance(d, ast.Call) else d).rpartition(".")[2] for d in cls.decorator_list}
    return bool(names & {"dataclass", "define", "frozen", "config"})


def _dataclass_init(cls: ast.ClassDef) -> ast.FunctionDef:
    """The `__init__` a dataclass decorator writes: its fields, in order (own fields only)."""
    fields = [
        s.target.id
        for s in cls.body
        if isinstance(s, ast.AnnAssign)
        and isinstance(s.target, ast.Name)
        and "ClassVar" not in ast.unparse(s.annotation)
    ]
    args = ast.arguments(
        posonlyargs=[],
        args=[ast.arg("self"), *(ast.arg(f) for f in fields)],
        kwonlyargs=[],
        kw_defaults=[],
        defaults=[],
    )
    return ast.FunctionDef(name="__init__", args=args, body=[], decorator_list=[])


def _params_differ(what: str, fn: ast.FunctionDef | ast.AsyncFunctionDef, want: list[str]) -> str | None:
    """`want` = the leading parameters (after self/cls), or `*, a, b`: parameters taken by name."""
    a = fn.args
    positional = [p.arg for p in (*a.posonlyargs, *a.args)]
    if positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    if want and want[0] == "*":
        have = set(positional) | {p.arg for p in a.kwonlyargs}
        gone = [w for w in want[1:] if w not in have]
        return None if not gone or a.kwarg is not None else f"{what} takes no {', '.join(gone)}"
    if positional[: len(want)] == want:
        return None
    return f"{what} takes ({', '.join(positional)}), we rely on ({', '.join(want)})"
