"""Released sources of the upstream packages, fetched by name from the package index and cached.

`release_source("vllm", "0.34.0")` returns a directory holding that release's unpacked source
tree (its `vllm/` package at the top). Nothing is vendored: the first call downloads the release's
sdist with pip (the same index `make setup` uses) and unpacks it into the cache, later calls find
it there. A release without an sdist is taken from its wheel instead (unpacked, never installed).

pip cannot finish `pip download` of these sdists (preparing their metadata needs their build
toolchain: CUDA, a Rust compiler), so the download runs with `--no-clean` in a temporary directory
of our own and the tree pip unpacked is moved into the cache before the error is reported.

Cache: `$MARU_COMPAT_CACHE`, default `<repo>/.compat-cache` (ignored by git).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    return Path(os.environ.get("MARU_COMPAT_CACHE") or REPO / ".compat-cache")


class SourceUnavailable(RuntimeError):
    """The release could not be fetched (no network, unknown version): one line says which."""


def release_source(dist: str, version: str) -> Path:
    """The unpacked source tree of `dist==version`, fetched once and cached."""
    target = cache_dir() / "src" / f"{dist}-{version}"
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"compat-{dist}-", dir=target.parent) as tmp:
        tree = _fetch_sdist(dist, version, Path(tmp)) or _fetch_wheel(dist, version, Path(tmp))
        if tree is None:
            raise SourceUnavailable(f"{dist}=={version}: neither an sdist nor a wheel could be downloaded")
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(tree), str(target))
    (target / ".complete").write_text(f"{dist}=={version}\n")
    return target


def _pip(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TMPDIR=str(tmp), PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _fetch_sdist(dist: str, version: str, tmp: Path) -> Path | None:
    saved = tmp / "saved"
    _pip("--no-binary", ":all:", "--no-build-isolation", "--no-clean", "-d", str(saved), f"{dist}=={version}", tmp=tmp)
    # Metadata preparation failed (the usual case): the tree pip unpacked is still in its temp dir.
    for parent in sorted(tmp.glob("pip-download-*")):
        for tree in parent.iterdir():
            if tree.is_dir() and (tree / "PKG-INFO").exists():
                return tree
    # It succeeded: unpack the saved sdist ourselves.
    for archive in sorted(saved.glob("*.tar.gz")) if saved.exists() else []:
        out = tmp / "unpacked"
        with tarfile.open(archive) as tar:
            tar.extractall(out, filter="data")
        roots = [p for p in out.iterdir() if p.is_dir()]
        if len(roots) == 1:
            return roots[0]
    return None


def _fetch_wheel(dist: str, version: str, tmp: Path) -> Path | None:
    saved = tmp / "wheels"
    _pip("--only-binary", ":all:", "-d", str(saved), f"{dist}=={version}", tmp=tmp)
    wheels = sorted(saved.glob("*.whl")) if saved.exists() else []
    if not wheels:
        return None
    out = tmp / "wheel-tree"
    with zipfile.ZipFile(wheels[0]) as whl:
        whl.extractall(out)
    return out


if __name__ == "__main__":  # python scripts/compat/sources.py vllm 0.34.0
    print(release_source(sys.argv[1], sys.argv[2]))
