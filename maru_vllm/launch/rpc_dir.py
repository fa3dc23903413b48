"""A private directory for a vLLM engine's ZeroMQ IPC sockets, removed when the engine is done.

vLLM binds several `ipc://` sockets per engine (the engine core's handshake, input and output,
the workers' broadcast queue), each a file named by a fresh UUID under `VLLM_RPC_BASE_PATH`
(default: the temp dir). Its shutdown ends the engine core with SIGKILL, and a crashed or
SIGKILLed worker closes nothing, so the files stay: on this project's machines about seven per
engine start, thousands in `/tmp` over weeks of restarts.

`use_private_rpc_dir()` (called by a worker component before vLLM is imported) points
`VLLM_RPC_BASE_PATH` at `<temp dir>/maru-rpc-<pid>` for this process and every engine process it
starts, removes that directory when the process exits, and removes the directories of workers
that died without doing so (their pid no longer runs) - so a crash loop heals on the next start,
with no operator. A `VLLM_RPC_BASE_PATH` set by the user is left alone.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "VLLM_RPC_BASE_PATH"
PREFIX = "maru-rpc-"
_NAME = re.compile(rf"^{PREFIX}(\d+)$")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_dirs(base: Path) -> list[Path]:
    """Remove every `maru-rpc-<pid>` directory under `base` whose pid no longer runs; return them."""
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for path in entries:
        m = _NAME.match(path.name)
        if m is None or _running(int(m.group(1))) or not path.is_dir() or path.is_symlink():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def use_private_rpc_dir(base: Path | None = None) -> Path | None:
    """Point this process's (and its children's) vLLM IPC sockets at a directory of its own,
    removed at exit; first remove the directories of dead workers. None when the user set
    `VLLM_RPC_BASE_PATH` (then nothing changes)."""
    if os.environ.get(ENV):
        return None
    base = Path(base or tempfile.gettempdir())
    removed = remove_dead_dirs(base)
    if removed:
        logger.info("removed %d IPC socket dir(s) of dead workers under %s", len(removed), base)
    own = base / f"{PREFIX}{os.getpid()}"
    shutil.rmtree(own, ignore_errors=True)  # a dead process's, with this pid before
    own.mkdir(mode=0o700)
    os.environ[ENV] = str(own)
    atexit.register(_remove, own, os.getpid())
    return own


def _remove(path: Path, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child, which inherits the handler
        shutil.rmtree(path, ignore_errors=True)
