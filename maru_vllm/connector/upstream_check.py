"""At start-up: does the installed vLLM still have what the connector relies on?

`maru_vllm.upstream_contracts` declares the vLLM fields, methods and names the connector reads
beyond its imports. The compatibility matrix checks them against every supported release's
sources; this module checks them once against the vLLM the engine runs, so that a release which
moved one of them is named in one line at start-up, and the connector stands aside on it (a
miss on every request), instead of failing in the middle of serving.

A contract is checked the way the code uses it: a module-level name, a class attribute, method,
property or dataclass field (declared anywhere in the class's MRO), and for `name(a, b)` the
leading parameters of the method. `name?` entries and optional contracts are read with a
fallback by our code and are not checked. Only modules vLLM has already imported, or can import,
are read; a module that fails to import is a moved contract too.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from maru_vllm.upstream_contracts import VLLM_CONTRACTS, Contract


def moved_contracts(contracts: tuple[Contract, ...] = VLLM_CONTRACTS) -> list[str]:
    """`module:qualname.attr` of every required contract the installed release lacks."""
    moved: list[str] = []
    for contract in contracts:
        if contract.optional:
            continue
        where = f"{contract.module}:{contract.qualname}" if contract.qualname else contract.module
        try:
            owner: Any = importlib.import_module(contract.module)
        except ImportError:
            moved.append(contract.module)
            continue
        if contract.qualname:
            owner = _resolve(owner, contract.qualname)
            if owner is None:
                moved.append(where)
                continue
        for attr in contract.attrs:
            if attr.endswith("?"):
                continue
            name, _, params = attr.partition("(")
            if not _has(owner, name):
                moved.append(f"{where}.{name}")
            elif params and not _takes(getattr(owner, name), params.rstrip(")")):
                moved.append(f"{where}.{attr}")
    return moved


def _resolve(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _has(owner: Any, name: str) -> bool:
    if hasattr(owner, name):
        return True
    if inspect.isclass(owner):  # dataclass fields without a default, annotations, instance attributes
        return any(
            name in getattr(klass, "__dataclass_fields__", {})
            or name in vars(klass).get("__annotations__", {})
            or _assigns_self(klass, name)
            for klass in owner.__mro__
        )
    return False


def _assigns_self(klass: type, name: str) -> bool:
    """Whether the class's own source assigns `self.<name>` (an attribute set in `__init__`)."""
    try:
        source = inspect.getsource(klass)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)", source) is not None


def _takes(fn: Any, params: str) -> bool:
    """Whether `fn` accepts the declared parameters: leading positional ones, or `*, a, b` by keyword."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True  # a builtin without a signature: nothing to compare
    names = [p.name for p in signature.parameters.values() if p.name not in ("self", "cls")]
    kinds = {p.name: p.kind for p in signature.parameters.values()}
    declared = [p.strip() for p in params.split(",") if p.strip()]
    if declared and declared[0] == "*":
        return all(n in kinds or inspect.Parameter.VAR_KEYWORD in kinds.values() for n in declared[1:])
    return names[: len(declared)] == declared
