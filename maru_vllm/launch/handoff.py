"""Handing this process over to a Dynamo entry point (`dynamo.frontend`, `dynamo.vllm`).

The Maru components prepare a process (argument defaults, import stand-ins, the event relay
hook) and then run Dynamo's own `__main__` in it, exactly as `python -m MODULE ARGS` would.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence


def run_module_as_main(module: str, argv: Sequence[str]) -> None:
    """Run `module` as `__main__` with `sys.argv` = [this program, *argv]."""
    sys.argv = [sys.argv[0], *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
