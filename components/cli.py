"""`maru-dynamo frontend ...` and `maru-dynamo worker ...`: the graph components from the CLI.

Both pass every argument through unchanged (``--help`` included, so ``maru-dynamo frontend
--help`` shows Dynamo's own options). The components are imported only when their command
runs: `maru-dynamo --help` must stay cheap and work while a component is not installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any


def register(subparsers: Any) -> None:
    frontend = subparsers.add_parser(
        "frontend",
        add_help=False,
        help="Dynamo's frontend with the KV router and the pool-tier weight (args go to dynamo.frontend)",
    )
    frontend.set_defaults(func=_run_frontend, accepts_extra=True)
    worker = subparsers.add_parser(
        "worker",
        add_help=False,
        help="a dynamo.vllm worker on the Maru pool (--maru-* options, the rest go to dynamo.vllm)",
    )
    worker.set_defaults(func=_run_worker, accepts_extra=True)


def _component(name: str) -> Any:
    module = f"maru_dynamo.components.{name}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            sys.exit(f"maru-dynamo: the {name} component ({module}) is not installed in this environment")
        raise


def _run_frontend(args: argparse.Namespace) -> int:
    _component("frontend").main(list(args.extra))
    return 0


def _run_worker(args: argparse.Namespace) -> int:
    _component("maru_worker").main(list(args.extra))
    return 0
