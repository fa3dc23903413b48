"""Handing this process over to a Dynamo entry point (`dynamo.frontend`, `dynamo.vllm`).

The Maru components prepare a process (argument defaults, import stand-ins, the event relay
hook) and then run Dynamo's own `__main__` in it, exactly as `python -m MODULE ARGS` would.

`run_module_then_exit` also ends the process once the module is done, without finalizing the
interpreter. Dynamo's runtime keeps threads of its own (its Rust runtime's) that hold Python
objects - a response stream a stand-in passed on, an endpoint's handler - and drop them when they
finish; one that does so while the interpreter finalizes aborts the process ("FATAL: exception
not rethrown", exit code -6), after a drain that had finished every request. So the exit
handlers run, logs and standard streams are flushed, and the process ends there.
"""

from __future__ import annotations

import atexit
import logging
import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn


def run_module_as_main(module: str, argv: Sequence[str]) -> None:
    """Run `module` as `__main__` with `sys.argv` = [this program, *argv]."""
    sys.argv = [sys.argv[0], *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_module_then_exit(module: str, argv: Sequence[str]) -> NoReturn:
    """`run_module_as_main`, then end the process with the module's exit status (see the module
    docstring): 0 when it returns, its `SystemExit` code, 1 after any other exception (printed)."""
    try:
        run_module_as_main(module, argv)
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:  # printed, then the process ends with status 1
        traceback.print_exc()
        code = 1
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """End the process with `code` after the exit handlers ran and output was flushed, skipping
    the interpreter's finalization."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed or gone: nothing left to flush
    os._exit(code)


def _exit_status(code: object) -> int:
    """`SystemExit.code` as `sys.exit` turns it into a status (a message is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
