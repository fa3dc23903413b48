"""Print the requirements an installed distribution declares, for `pip install -r`.

`make setup` installs a few wheels with `--no-deps` (their declared dependency sets cannot be
installed here as a whole) and then uses this to install the rest of what they declare, so
that no hand-written copy of a wheel's requirement list goes stale. Environment markers are
evaluated for this interpreter; extras are never included.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def read_pins(path: Path) -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """Parse stack-pins.txt into (skips per dist, cpu-runtime requirements per dist)."""
    skips: dict[str, set[str]] = {}
    cpu_runtime: dict[str, list[str]] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3 or parts[0] not in ("skip", "cpu-runtime"):
            raise SystemExit(f"{path}:{lineno}: expected 'skip|cpu-runtime <dist> <requirement>', got {raw!r}")
        kind, dist, req = parts
        if kind == "skip":
            skips.setdefault(canonicalize_name(dist), set()).add(canonicalize_name(req))
        else:
            cpu_runtime.setdefault(canonicalize_name(dist), []).append(req)
    return skips, cpu_runtime


def declared_requirements(dist: str, skip: set[str]) -> list[str]:
    """The dist's requirements that apply to this interpreter, without extras or skipped ones."""
    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name) in skip:
            continue
        req.marker = None
        out.append(str(req))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dist", help="installed distribution name, e.g. ai-dynamo")
    parser.add_argument("--pins", type=Path, required=True, help="path to scripts/stack-pins.txt")
    parser.add_argument(
        "--only-cpu-runtime",
        action="store_true",
        help="print only the dist's 'cpu-runtime' entries from the pins file",
    )
    args = parser.parse_args(argv)
    try:
        metadata.version(args.dist)
    except metadata.PackageNotFoundError:
        print(f"{args.dist} is not installed in {sys.prefix}", file=sys.stderr)
        return 2
    skips, cpu_runtime = read_pins(args.pins)
    key = canonicalize_name(args.dist)
    reqs = (
        cpu_runtime.get(key, []) if args.only_cpu_runtime else declared_requirements(args.dist, skips.get(key, set()))
    )
    print("\n".join(reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
