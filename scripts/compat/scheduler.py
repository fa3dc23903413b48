"""The scheduler level of the compatibility matrix: the connector under each vLLM release's scheduler.

For a release, the connector's scheduler tests (vLLM's real v1 `Scheduler` creates the connector
from a real `VllmConfig` and drives it step by step, no model) and the configuration checks of
`tests/compat/test_sleep_mode.py` run in a subprocess of `.venv` whose `vllm` is that release's
own sources (`shadow.py`): the connector meets the release's scheduler, request, output and
config classes exactly as an engine of that release would hand them over.

    python scripts/compat/scheduler.py              # every supported release
    python scripts/compat/scheduler.py 0.34.0 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for `scripts.compat`
from scripts.compat.shadow import ENV_IDENTITY, shadow_env
from scripts.compat.sources import REPO, SourceUnavailable

TESTS = (
    "tests/connector/test_scheduler_real.py",
    "tests/connector/test_hybrid_scheduler.py",
    "tests/compat/test_sleep_mode.py",
)


@dataclasses.dataclass
class LevelResult:
    version: str  # the release asked for
    passed: int = 0
    failed: int = 0  # failures and errors
    skipped: int = 0
    failing: list[str] = dataclasses.field(default_factory=list)  # test ids
    first_error: str = ""  # the first failure's first line, or why nothing ran
    imported: str = ""  # vllm.__version__ as the tests saw it
    waived: list[str] = dataclasses.field(default_factory=list)
    skip_reasons: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.passed > 0 and not self.first_error

    def summary(self) -> str:
        head = f"vllm {self.version}: {'pass' if self.ok else 'FAIL'} {self.passed} passed, {self.failed} failed"
        if self.skipped:
            head += f", {self.skipped} skipped"
        head += f" ({self.seconds:.0f}s)"
        return head if not self.first_error else f"{head}: {self.first_error}"

    def as_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "ok": self.ok}


def _python() -> str:
    """This interpreter when it runs in a virtual environment (`make setup`'s), else `.venv`'s."""
    venv = REPO / ".venv" / "bin" / "python"
    return sys.executable if sys.prefix != sys.base_prefix or not venv.exists() else str(venv)


def _test_id(case: ET.Element) -> str:
    module = case.get("classname", "")
    parts = module.split(".")
    # pytest's junit classname is module[.Class]; the file is the module part that exists.
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if (REPO / path).exists():
            return "::".join([path.as_posix(), *parts[cut:], case.get("name", "")])
    return f"{module}::{case.get('name', '')}"


def read_junit(path: Path, result: LevelResult) -> None:
    for case in ET.parse(path).getroot().iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            result.failed += 1
            result.failing.append(_test_id(case))
            if not result.first_error:
                text = bad.get("message") or (bad.text or "")
                result.first_error = next((ln.strip() for ln in text.splitlines() if ln.strip()), "failed")
        elif skip is not None:
            result.skipped += 1
            reason = skip.get("message", "")
            if reason and reason not in result.skip_reasons:
                result.skip_reasons.append(reason)
        else:
            result.passed += 1


def run_scheduler_level(version: str, timeout: float = 900.0, pytest_args: tuple[str, ...] = ()) -> LevelResult:
    """Run the scheduler level against `vllm==version`'s sources; never raises for a failing run."""
    result = LevelResult(version)
    start = time.monotonic()
    try:
        env = shadow_env(version)
    except SourceUnavailable as exc:
        result.first_error = f"sources unavailable: {exc}"
        return result
    with tempfile.TemporaryDirectory(prefix="compat-sched-") as tmp:
        junit, identity = Path(tmp) / "junit.xml", Path(tmp) / "identity.json"
        env[ENV_IDENTITY] = str(identity)
        env.setdefault("HF_HUB_OFFLINE", "1")
        cmd = [_python(), "-m", "pytest", "-q", "-p", "scripts.compat.shadow", "-p", "no:cacheprovider"]
        cmd += [f"--junitxml={junit}", *pytest_args, *TESTS]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            result.first_error = f"timed out after {timeout:.0f}s"
            output = ""
        result.seconds = round(time.monotonic() - start, 1)
        if identity.exists():
            found = json.loads(identity.read_text())
            result.imported, result.waived = found["version"], found["waived"]
            if found["version"].split("+")[0] != version:
                result.first_error = f"vllm {found['version']} was imported, not {version}"
        elif not result.first_error:
            result.first_error = "the tests did not start against the release: " + last_error(output)
        if junit.exists():
            read_junit(junit, result)
        if not result.first_error and result.passed == 0:
            result.first_error = "no test ran: " + last_error(output)
    return result


def last_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line
    return lines[-1] if lines else "no output"


def main(argv: list[str] | None = None) -> int:
    from maru_vllm.versions import VLLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", help=f"vLLM releases (default: {' '.join(VLLM.releases)})")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    results = []
    for version in args.versions or VLLM.releases:
        if not args.json:
            print(f"[compat] scheduler level, vllm {version} ...", flush=True)
        res = run_scheduler_level(version)
        results.append(res)
        if not args.json:
            print(f"[compat] {res.summary()}", flush=True)
            for test_id in res.failing:
                print(f"[compat]     failed: {test_id}")
            for reason in res.skip_reasons:
                print(f"[compat]     skipped: {reason}")
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
