"""The /dev/shm files (and vLLM file stores) a process tree leaves behind when it is killed.

vLLM engines create shared-memory message queues (`psm_*`) and named semaphores (`sem.mp-*`)
at start and remove them on a clean exit; a SIGKILLed engine leaves them. Its torch.distributed
file store (`$TMPDIR/vllm_dist_*`) is never removed. `ShmSegments` remembers, by inode, what a
tree had mapped or open while it lived and removes, once it is dead, what no live process holds;
the supervisor and `ManagedProcess.stop` use it. A tree can die between two looks at it (an
engine that crashes within a second or two of its start): what vLLM names its files that this
user created while the tree lived (`since_ns`) and that no live process holds goes too - every
live vLLM process holds the queues and semaphores it made open or mapped, so such a file can
only be left over.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections.abc import Collection
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# What vLLM's engines create there (its shm message queues, multiprocessing's named semaphores,
# the CPU tensor-parallel communicator's `vllm_dist_*` buffers):
# all `ManagedProcess.stop` removes, since any other file a tree maps may be somebody's (a pool's
# region outlives every engine that maps it).
VLLM_SHM_PREFIXES = ("psm_", "sem.mp-", "vllm_dist_")
_CTIME_SLACK_NS = 100_000_000  # tmpfs timestamps are coarse (a clock tick)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def session_members(session: int) -> list[int]:
    """Live (not zombie) processes of session `session`; a managed process's tree, orphans included."""
    members = []
    for pid in _pids():
        fields = _stat_fields(pid)
        if fields is not None and fields[0] != "Z" and int(fields[3]) == session:
            members.append(pid)
    return members


def shm_inodes_of(pid: int, shm_dir: Path = SHM_DIR) -> dict[int, Path | None]:
    """The files under `shm_dir` that `pid` has mapped or open: inode -> path (None once unlinked).

    By inode, because a name is not always what a process holds: glibc's `sem_open` maps a
    temporary file and links it to the semaphore's name (`sem.mp-*` of Python's multiprocessing
    locks) before unlinking the temporary one, so the maps show a deleted path for a file that is
    still in `shm_dir` under another name.
    """
    prefix = str(shm_dir).rstrip("/") + "/"
    found: dict[int, Path | None] = {}

    def add(inode: int, name: str) -> None:
        path = None if name.endswith(" (deleted)") else Path(name)
        if found.get(inode) is None:
            found[inode] = path

    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.rstrip("\n").split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(prefix) and parts[4].isdigit():
                    add(int(parts[4]), parts[5])
    except OSError:
        pass
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(prefix):
                add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino, target)
        except OSError:
            continue
    return found


def shm_paths_of(pid: int, shm_dir: Path = SHM_DIR) -> set[Path]:
    """The files under `shm_dir` that `pid` has mapped or open, by name (unlinked ones left out)."""
    return {path for path in shm_inodes_of(pid, shm_dir).values() if path is not None}


class ShmSegments:
    """The /dev/shm files one process tree held while it lived, to remove once it is dead.

    `scan(session)` adds whatever the session's processes have mapped or open now, by inode (call
    it while the tree lives; vLLM creates its segments at engine start and holds them until exit).
    `release()`, after the tree is dead, removes the files of `shm_dir` with one of those inodes
    that no live process holds and that are not in `protect`; a file somebody else still maps
    (the pool's region, a neighbour's queue) stays, and so does every file the tree never held.
    """

    def __init__(self, shm_dir: Path = SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self.seen: set[int] = set()  # inodes

    def scan(self, session: int) -> None:
        for pid in session_members(session):
            self.seen |= set(shm_inodes_of(pid, self.shm_dir))

    def release(
        self, protect: Collection[Path] = (), only: tuple[str, ...] | None = None, since_ns: int | None = None
    ) -> list[Path]:
        """Remove the seen segments nobody holds now (with `only`: just those whose name starts
        with one of its prefixes); with `since_ns` (the tree's start, wall clock) also the files
        named as vLLM names its own (`VLLM_SHM_PREFIXES`, within `only`) that this user created
        since and nobody holds. Returns the removed paths. Forgets all seen."""
        seen, self.seen = self.seen, set()
        if not seen and since_ns is None:
            return []
        born_after = None if since_ns is None else since_ns - _CTIME_SLACK_NS
        me = os.geteuid()
        keep = set(protect)
        candidates: dict[Path, int] = {}
        try:
            entries = list(self.shm_dir.iterdir())
        except OSError:
            return []
        for path in entries:
            try:
                st = path.lstat()
            except OSError:
                continue
            if only is not None and not path.name.startswith(only):
                continue
            if not stat.S_ISREG(st.st_mode) or path in keep:
                continue
            if st.st_ino in seen or (
                born_after is not None
                and path.name.startswith(VLLM_SHM_PREFIXES)
                and st.st_uid == me
                and st.st_ctime_ns >= born_after
            ):
                candidates[path] = st.st_ino
        if not candidates:
            return []
        held: set[int] = set()
        for pid in _pids():
            held |= set(shm_inodes_of(pid, self.shm_dir))
        removed = []
        for path, inode in sorted(candidates.items()):
            if inode in held:
                continue
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning("cannot remove %s: %s", path, exc)
                continue
            removed.append(path)
        return removed


def wait_session_gone(session: int, timeout_s: float = 10.0) -> bool:
    """Until no live process of `session` is left (after a SIGKILL of its group)."""
    deadline = time.monotonic() + timeout_s
    while session_members(session):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# vLLM's file store for torch.distributed (`file://$TMPDIR/vllm_dist_<uuid>`): nobody holds it
# open between operations and vLLM never removes it, but each engine logs its own.
DIST_STORE_LOG = re.compile(r"distributed_init_method=file://(/\S*/vllm_dist_[0-9a-f]+)\b")


def remove_dist_stores(log_text: str) -> list[Path]:
    """Remove the vLLM file stores named in one start's log (its tree is dead); returns them."""
    removed = []
    for name in sorted(set(DIST_STORE_LOG.findall(log_text))):
        path = Path(name)
        try:
            if stat.S_ISREG(path.lstat().st_mode):
                path.unlink()
                removed.append(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("cannot remove %s: %s", path, exc)
    return removed
