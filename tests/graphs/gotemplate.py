"""A small renderer for the subset of Helm's Go templates that deploy/k8s uses.

`helm` is not installable here (not in Debian or PyPI), so the chart is checked by rendering it
with this instead and comparing the objects with `maru-dynamo graph render`. It is strict where
Helm is lenient: a missing value key, an unknown function or an unsupported action raises, so
the chart cannot drift into syntax that this check silently misreads. Supported: text with
``{{- -}}`` trimming, comments, ``define``/``include``, ``if``/``else if``/``else``, ``range``
over lists and maps (with ``$v :=`` / ``$k, $v :=``), variables (``:=``, ``=``), pipelines,
parentheses and the functions in `FUNCS`.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"|\(|\)|\||:=|=|,|[^\s()|,]+)')


class TemplateError(Exception):
    pass


def _tokens(expr: str) -> list[str]:
    out, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise TemplateError(f"cannot tokenize {expr!r}")
        out.append(m.group(1))
        pos = m.end()
    return out


def _lex(source: str) -> list[tuple[str, str]]:
    """[(kind, value)] with kind 'text' or 'action', trim markers applied."""
    out: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(source):
        text = source[pos:m.start()]
        if trim_next:
            text = text.lstrip()
        if m.group(1):
            text = text.rstrip()
        out.append(("text", text))
        out.append(("action", m.group(2).strip()))
        trim_next = bool(m.group(3))
        pos = m.end()
    tail = source[pos:]
    out.append(("text", tail.lstrip() if trim_next else tail))
    return out


def _tree(lexed: list[tuple[str, str]], i: int, stop: tuple[str, ...]) -> tuple[list[Any], int, str]:
    nodes: list[Any] = []
    while i < len(lexed):
        kind, value = lexed[i]
        i += 1
        if kind == "text":
            nodes.append(value)
            continue
        if value.startswith("/*"):
            continue
        word = value.split(None, 1)[0] if value else ""
        if word in stop or (word == "else" and "else" in stop):
            return nodes, i, value
        if word == "if":
            branches, other = [], None
            cond = value[2:].strip()
            while True:
                body, i, ended = _tree(lexed, i, ("else", "end"))
                branches.append((cond, body))
                if ended == "end":
                    break
                if ended.startswith("else if "):
                    cond = ended[len("else if "):].strip()
                    continue
                other, i, ended = _tree(lexed, i, ("end",))
                break
            nodes.append(("if", branches, other))
        elif word == "range":
            body, i, _ = _tree(lexed, i, ("end",))
            nodes.append(("range", value[5:].strip(), body))
        elif word == "define":
            body, i, _ = _tree(lexed, i, ("end",))
            nodes.append(("define", json.loads(value[6:].strip()), body))
        elif word in ("with", "template", "block", "tpl"):
            raise TemplateError(f"unsupported action {{{{ {value} }}}}")
        else:
            nodes.append(("expr", value))
    if stop:
        raise TemplateError(f"missing {{{{ end }}}} (expected one of {stop})")
    return nodes, i, ""


def _go_str(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _truthy(v: Any) -> bool:
    return bool(v) if v is not None else False


def _required(msg: str, v: Any) -> Any:
    if v is None or v == "":
        raise TemplateError(f"required: {msg}")
    return v


def _printf(fmt: str, *args: Any) -> str:
    conv = iter(args)
    return re.sub(r"%([sqdv])", lambda m: json.dumps(_go_str(next(conv))) if m.group(1) == "q"
                  else _go_str(next(conv)), fmt)


def _fail(msg: str) -> None:
    raise TemplateError(f"fail: {msg}")


FUNCS: dict[str, Callable[..., Any]] = {
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "not": lambda a: not _truthy(a),
    "and": lambda *a: all(_truthy(x) for x in a), "or": lambda *a: any(_truthy(x) for x in a),
    "list": lambda *a: list(a), "index": lambda c, k: c[k], "quote": lambda v: json.dumps(_go_str(v)),
    "dir": posixpath.dirname, "required": _required, "printf": _printf, "fail": _fail,
    "default": lambda d, v=None: v if _truthy(v) else d,
    "toYaml": lambda v: yaml.safe_dump(v, default_flow_style=False).rstrip("\n"),
    "nindent": lambda n, s: "\n" + "\n".join(" " * n + line if line else line for line in s.split("\n")),
    "indent": lambda n, s: "\n".join(" " * n + line if line else line for line in s.split("\n")),
}


class Renderer:
    def __init__(self, chart: Path, values: dict[str, Any], release: dict[str, Any]) -> None:
        meta = yaml.safe_load((chart / "Chart.yaml").read_text())
        self.root = {"Values": values, "Release": release, "Chart": {"Name": meta["name"], "Version": meta["version"]}}
        self.defines: dict[str, list[Any]] = {}
        self.chart = chart

    def render_all(self) -> dict[str, str]:
        files = sorted((self.chart / "templates").glob("*"))
        trees = {f.name: _tree(_lex(f.read_text()), 0, ())[0] for f in files}
        for tree in trees.values():
            self._collect_defines(tree)
        return {name: self._render(tree, self.root, {"$": self.root}) for name, tree in trees.items()
                if not name.startswith("_")}

    def _collect_defines(self, nodes: list[Any]) -> None:
        for n in nodes:
            if isinstance(n, tuple) and n[0] == "define":
                self.defines[n[1]] = n[2]

    def _render(self, nodes: list[Any], dot: Any, scope: dict[str, Any]) -> str:
        out: list[str] = []
        for n in nodes:
            if isinstance(n, str):
                out.append(n)
            elif n[0] == "define":
                continue
            elif n[0] == "expr":
                toks = _tokens(n[1])
                if len(toks) > 2 and toks[0].startswith("$") and toks[1] in (":=", "="):
                    if toks[1] == "=" and toks[0] not in scope:
                        raise TemplateError(f"assignment to undeclared {toks[0]}")
                    scope[toks[0]] = self._pipeline(toks[2:], dot, scope)
                else:
                    out.append(_go_str(self._pipeline(toks, dot, scope)))
            elif n[0] == "if":
                for cond, body in n[1]:
                    if _truthy(self._pipeline(_tokens(cond), dot, scope)):
                        out.append(self._render(body, dot, scope))
                        break
                else:
                    if n[2] is not None:
                        out.append(self._render(n[2], dot, scope))
            elif n[0] == "range":
                out.append(self._range(n[1], n[2], dot, scope))
        return "".join(out)

    def _range(self, header: str, body: list[Any], dot: Any, scope: dict[str, Any]) -> str:
        toks = _tokens(header)
        names: list[str] = []
        if ":=" in toks:
            split = toks.index(":=")
            names = [t for t in toks[:split] if t != ","]
            toks = toks[split + 1:]
        coll = self._pipeline(toks, dot, scope)
        pairs = sorted(coll.items()) if isinstance(coll, dict) else list(enumerate(coll or []))
        out = []
        for key, value in pairs:
            inner = dict(scope)
            if len(names) == 1:
                inner[names[0]] = value
            elif len(names) == 2:
                inner[names[0]], inner[names[1]] = key, value
            out.append(self._render(body, value, inner))
        return "".join(out)

    def _pipeline(self, toks: list[str], dot: Any, scope: dict[str, Any]) -> Any:
        cmds: list[list[str]] = [[]]
        depth = 0
        for t in toks:
            depth += (t == "(") - (t == ")")
            if t == "|" and depth == 0:
                cmds.append([])
            else:
                cmds[-1].append(t)
        value: Any = _NOTHING
        for cmd in cmds:
            value = self._command(cmd, dot, scope, value)
        return value

    def _command(self, toks: list[str], dot: Any, scope: dict[str, Any], piped: Any) -> Any:
        args: list[Any] = []
        i = 0
        head = toks[0]
        is_call = head in FUNCS or head == "include"
        if head not in FUNCS and head != "include" and re.match(r"^[A-Za-z]", head):
            raise TemplateError(f"unknown function {head!r}")
        i = 1 if is_call else 0
        while i < len(toks):
            t = toks[i]
            if t == "(":
                depth, j = 1, i + 1
                while depth:
                    depth += (toks[j] == "(") - (toks[j] == ")")
                    j += 1
                args.append(self._pipeline(toks[i + 1:j - 1], dot, scope))
                i = j
                continue
            args.append(self._operand(t, dot, scope))
            i += 1
        if piped is not _NOTHING:
            args.append(piped)
        if head == "include":
            return self._render(self.defines[args[0]], args[1], {"$": self.root}).strip("\n")
        if is_call:
            return FUNCS[head](*args)
        if len(args) != 1:
            raise TemplateError(f"cannot evaluate {' '.join(toks)!r}")
        return args[0]

    def _operand(self, t: str, dot: Any, scope: dict[str, Any]) -> Any:
        if t.startswith('"'):
            return json.loads(t)
        if re.fullmatch(r"-?\d+", t):
            return int(t)
        if t in ("true", "false"):
            return t == "true"
        if t == ".":
            return dot
        if t.startswith("$"):
            name, _, path = t.partition(".")
            if name not in scope:
                raise TemplateError(f"undefined variable {name}")
            return self._lookup(scope[name], path, t)
        if t.startswith("."):
            return self._lookup(dot, t[1:], t)
        raise TemplateError(f"cannot evaluate operand {t!r}")

    @staticmethod
    def _lookup(value: Any, path: str, full: str) -> Any:
        for key in filter(None, path.split(".")):
            if not isinstance(value, dict) or key not in value:
                raise TemplateError(f"{full}: no key {key!r} (strict: every value the chart reads must exist)")
            value = value[key]
        return value


_NOTHING = object()


def render_chart(chart: Path, values: dict[str, Any], *, name: str, namespace: str) -> list[dict[str, Any]]:
    """Every object the chart renders with `values`, parsed from YAML."""
    release = {"Name": name, "Namespace": namespace, "Service": "Helm"}
    docs: list[dict[str, Any]] = []
    for text in Renderer(chart, values, release).render_all().values():
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs
