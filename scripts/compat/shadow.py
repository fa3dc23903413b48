"""Run code against a vLLM release's own sources instead of the installed vLLM.

`shadow_dir(version)` returns a directory holding only a `vllm` link to that release's package tree
(fetched by `sources.release_source`); with it first on `PYTHONPATH` a Python of `.venv` imports the
release's pure-Python vLLM over the installed one, with the installed dependencies (torch,
transformers, ...). The release's compiled extensions (`vllm._C`, ...) are absent: what runs this
way must not need them (vLLM's scheduler and config validation do not).

Loaded into pytest with `-p scripts.compat.shadow`, this module is also a plugin:
it refuses to run unless `vllm` really is the release's tree, names the release in the report
header and, on an x86 CPU without triton-cpu, waives the one check of vLLM's CPU platform that
needs triton-cpu to run models (from 0.34 on it raises instead of warning; no model runs here,
and triton-cpu is not published on the package index).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `scripts.compat`
from scripts.compat.sources import REPO, cache_dir, release_source

ENV_RELEASE = "MARU_COMPAT_VLLM_TREE"  # the release's package tree the plugin expects
ENV_IDENTITY = "MARU_COMPAT_IDENTITY"  # where the plugin writes what it ran against (JSON)


def shadow_dir(version: str) -> Path:
    """A directory whose only entry is `vllm`, linked to `vllm==version`'s package tree."""
    tree = release_source("vllm", version) / "vllm"
    out = cache_dir() / "shadow" / f"vllm-{version}"
    link = out / "vllm"
    if not (link.is_symlink() and link.resolve() == tree.resolve()):
        out.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(tree, target_is_directory=True)
    return out


def shadow_env(version: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a subprocess that imports `vllm==version`'s sources."""
    env = dict(os.environ if base is None else base)
    paths = [str(shadow_dir(version)), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env[ENV_RELEASE] = str((release_source("vllm", version) / "vllm").resolve())
    return env


# ---- pytest plugin (`-p scripts.compat.shadow`) -------------------------------------------------------------
WAIVED: list[str] = []


def pytest_configure(config: Any) -> None:
    import vllm

    expected = os.environ.get(ENV_RELEASE)
    actual = Path(vllm.__file__).resolve().parent
    if expected and actual != Path(expected):
        raise RuntimeError(f"vllm is imported from {actual}, not from the release tree {expected}")
    _waive_triton_cpu_check()
    identity = os.environ.get(ENV_IDENTITY)
    if identity:
        found = {"version": vllm.__version__, "tree": str(actual), "waived": WAIVED}
        Path(identity).write_text(json.dumps(found, indent=2) + "\n")


def pytest_report_header(config: Any) -> list[str]:
    import vllm

    lines = [f"vllm release under test: {vllm.__version__} ({Path(vllm.__file__).resolve().parent})"]
    lines += [f"waived: {w}" for w in WAIVED]
    return lines


def _waive_triton_cpu_check() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.triton_utils as triton_utils

    if triton_utils.HAS_TRITON:
        return
    platform_cls = type(current_platform)
    original = platform_cls.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        triton_utils.HAS_TRITON = True  # read by the check only, at call time
        try:
            original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    platform_cls.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[assignment]
    WAIVED.append("vLLM's CPU platform check for triton-cpu (not installed; no model runs at this level)")
