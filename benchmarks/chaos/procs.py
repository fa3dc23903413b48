"""Process trees from /proc: who descends from whom, what each uses (RSS) and maps in /dev/shm.

A graph process (a Maru worker, the pool) is a tree: `dynamo.vllm` starts vLLM's engine core,
which starts its own helpers, some in sessions of their own. A crash as the chaos soak simulates
it kills every process of the tree at once; the samplers read every process of it. All reads
tolerate a process that exits between two reads (it is then simply absent).
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")
SHM = "/dev/shm/"


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def parents() -> dict[int, int]:
    """pid -> parent pid of every process now (one walk of /proc, for several `tree` calls)."""
    return _parents()


def tree(pid: int, parents: dict[int, int] | None = None) -> list[int]:
    """`pid` and every live process below it (parents first), from `parents` or a fresh walk."""
    parents = _parents() if parents is None else parents
    if pid not in parents:
        return []
    found, frontier = [pid], {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - set(found)
        found.extend(sorted(frontier))
    return found


def signal_tree(pid: int, sig: signal.Signals) -> list[int]:
    """Send `sig` to `pid` and every process below it; returns the pids signalled.

    For SIGKILL the tree is frozen first (SIGSTOP), so that no process can start a child or be
    reaped and reparented between the walk and the kill."""
    pids = tree(pid)
    if sig == signal.SIGKILL:
        _send(pids, signal.SIGSTOP)
        pids = list(dict.fromkeys(pids + [p for q in pids for p in tree(q)]))
    _send(pids, sig)
    return pids


def _send(pids: Iterable[int], sig: signal.Signals) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def alive(pid: int) -> bool:
    """Running (a zombie is dead: it only waits to be reaped)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclasses.dataclass(frozen=True)
class Usage:
    """One process's memory at one moment, in KiB (from /proc/PID/status)."""

    pid: int
    comm: str
    rss_kib: int
    anon_kib: int


def usage(pid: int) -> Usage | None:
    try:
        text = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def kib(key: str) -> int:
        value = fields.get(key, "0 kB").split()
        return int(value[0]) if value else 0

    return Usage(pid, fields.get("Name", "?").strip(), kib("VmRSS"), kib("RssAnon"))


def shm_mappings(pid: int) -> set[str]:
    """Names of the /dev/shm files `pid` maps (a deleted file's name ends in ' (deleted)': skipped)."""
    try:
        text = (PROC / str(pid) / "maps").read_text()
    except OSError:
        return set()
    names = set()
    for line in text.splitlines():
        where = line.find(SHM)
        if where >= 0 and not line.endswith("(deleted)"):
            names.add(line[where + len(SHM) :].strip())
    return names


def shm_fds(pid: int) -> set[str]:
    """Names of the /dev/shm files `pid` holds open (a segment may be open before it is mapped)."""
    names: set[str] = set()
    try:
        fds = list((PROC / str(pid) / "fd").iterdir())
    except OSError:
        return names
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(SHM) and not target.endswith("(deleted)"):
            names.add(target[len(SHM) :])
    return names
