"""`graph run` keeps a graph serving through crashes, with its default settings.

One real graph (nats-server, the pool, two vLLM workers, the frontend; ~1 min to start) and a
stream of completions of a known length through it while:

1. worker-0's whole process tree is SIGKILLed with requests in flight on it: every request
   still completes in full (the frontend migrates the cut ones), the worker is started again and
   serves again, and the /dev/shm segments its dead tree held are gone;
2. nats-server is SIGKILLed: it is started again on the same port and the graph serves;
3. nats-server is killed with its port taken, so that it keeps crashing: the runner gives up on
   it in one line naming its log, and stops the graph (exit code 1, nothing left running, no
   /dev/shm segment of the graph's processes left).
"""

from __future__ import annotations

import errno
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import completion
from maru_vllm.launch.engine_metrics import read_counters, running_requests
from maru_vllm.launch.supervisor import session_members, shm_inodes_of, shm_paths_of
from tests.e2e.conftest import token_prompt
from tests.e2e.streaming_load import Load
from tests.e2e.test_graph_run import alive, cmdline, descendants
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 32
PROMPT_TOKENS = 600

pytestmark = pytest.mark.e2e


class GraphRun:
    """`maru-dynamo graph run GRAPH` as a user starts it, with its output collected."""

    def __init__(self, graph: str = "graphs/agg.yaml") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "maru_dynamo.components.main", "graph", "run", graph, "--keep-logs"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.output.append(line)
            self._lines.put(line)

    def text(self) -> str:
        return "".join(self.output)

    def stop(
        self, work: Path | None, *, keep_logs: bool = False, seen: Iterable[int] = (), timeout: float = 120
    ) -> None:
        """Stop the graph as a user does (Ctrl-C; SIGKILL after `timeout`), then SIGKILL every
        process of it still alive - its descendants now and `seen` (processes seen earlier, which a
        dead runner no longer parents) - and remove its work dir `work`, unless `keep_logs`."""
        members = set(seen) | descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in members:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if work is not None and keep_logs:
            print(f"[e2e] logs kept in {work / 'logs'}")
        elif work is not None:
            shutil.rmtree(work, ignore_errors=True)

    def wait_line(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first line (from the start of the output) matching `pattern`."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.output):
                if m := regex.search(line):
                    return m
            assert time.monotonic() < deadline, f"no line /{pattern}/ within {timeout:.0f} s:\n" + self.text()
            try:
                self._lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None or regex.search(self.text()), "graph run exited:\n" + self.text()


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def worker_leaders(run_pid: int) -> dict[str, int]:
    """worker:worker-N -> the pid of its leader process (identified by its engine's core binding)."""
    leaders = {}
    for pid in descendants(run_pid):
        if "maru_dynamo.components.maru_worker" in cmdline(pid) and os.getpgid(pid) == pid:
            leaders[f"worker:worker-{environ_of(pid)['VLLM_CPU_OMP_THREADS_BIND']}"] = pid
    return leaders


def migrations(url: str) -> float:
    """The frontend's count of requests moved off a worker that died in the middle of them: before
    their first token (`new_request`) or while streaming (`ongoing_request`)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if "model_migration_total{" in line and re.search(r'migration_type="(new|ongoing)_request"', line)
    )


def _nats_pids(graph_pid: int) -> list[int]:
    return [pid for pid in descendants(graph_pid) if cmdline(pid).startswith("nats-server ")]


def _take_port_from_nats(graph_pid: int, blocker: socket.socket, port: int) -> None:
    """Kill the graph's nats-server and bind its port. The graph may restart nats-server before
    the bind (it then holds the port again): kill that one too and bind again, a few times."""
    for _ in range(3):
        wait_until(lambda: len(_nats_pids(graph_pid)) == 1, timeout=60, what="one nats-server running")
        (nats,) = _nats_pids(graph_pid)
        os.kill(nats, signal.SIGKILL)
        # bind in a tight loop from the kill on: the port frees as the process dies, and the
        # graph may restart nats-server within milliseconds of reaping it
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                blocker.bind(("127.0.0.1", port))
                return
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
            if not alive(nats) and len(_nats_pids(graph_pid)) == 1:
                break  # a restarted nats-server holds the port again: kill that one
            time.sleep(0.001)
    raise AssertionError(f"port {port}: the graph's restarted nats-server took it every time")


def test_graph_run_restarts_what_dies_and_loses_no_request(tiny_model: Path) -> None:
    run = GraphRun()
    work: Path | None = None
    children: set[int] = set()
    blocker: socket.socket | None = None
    try:
        work = Path(run.wait_line(r"logs in (/\S+)/logs", timeout=60).group(1))
        url = run.wait_line(r"\[graph\] ready: (http://127\.0\.0\.1:\d+) \(2 workers\)", timeout=600).group(1)
        model = str(tiny_model)
        leaders = worker_leaders(run.proc.pid)
        assert set(leaders) == {"worker:worker-0", "worker:worker-1"}, leaders
        victim = leaders["worker:worker-0"]
        metrics = f"http://127.0.0.1:{environ_of(victim)['DYN_SYSTEM_PORT']}/metrics"
        # What the worker's tree holds in /dev/shm now: vLLM's shared-memory queues (and the pool's region).
        region = Path(f"/dev/shm/maru-kv-{work.name}")
        held = set().union(*(shm_paths_of(pid) for pid in session_members(victim)))
        assert region in held and any(p.name.startswith("psm_") for p in held), held
        # By inode: the tree also holds files whose mapped name is gone (glibc's named semaphores).
        inodes = set().union(*(shm_inodes_of(pid) for pid in session_members(victim))) - {region.stat().st_ino}

        # 1. SIGKILL worker-0's tree with requests running on it.
        load = Load(url, model, lambda i: token_prompt(1000 + i, PROMPT_TOKENS), MAX_TOKENS, threads=3).start()
        wait_until(lambda: running_requests(metrics) > 0, timeout=120, what="a request running on worker-0")
        os.killpg(victim, signal.SIGKILL)
        run.wait_line(r"\[graph\] worker:worker-0 exited with code -9; restarting it in \d+ s", timeout=60)
        run.wait_line(r"\[graph\] worker:worker-0 restarted \(pid \d+, restart 1\)", timeout=60)
        left = shm_files(inodes)
        assert not left, f"the dead worker's /dev/shm segments are still there: {left}"
        # The new worker comes up and takes requests again (its engine counts prompts).
        wait_until(lambda: _prompt_tokens(metrics) > 0, timeout=300, interval=1, what="worker-0 serving again")
        results = load.stop()
        bad = [r for r in results if not r.complete(MAX_TOKENS)]
        assert not bad, f"{len(bad)} of {len(results)} requests not complete: {bad[:5]}\n{run.text()}"
        assert len(results) >= 6
        assert migrations(url) >= 1, "no request was in flight on the killed worker (nothing was migrated)"
        print(f"\n[e2e] {len(results)} streaming requests complete, {migrations(url):.0f} migrated off the dead worker")
        assert region.exists(), "the pool's region went away with the worker"

        # 2. nats-server: started again on the same port; the graph serves on.
        children = descendants(run.proc.pid)
        graph_inodes = set().union(*(shm_inodes_of(pid) for pid in children))  # the restarted worker's too
        (nats,) = [pid for pid in children if cmdline(pid).startswith("nats-server ")]
        port = int(re.search(r"-p (\d+)", cmdline(nats)).group(1))
        os.kill(nats, signal.SIGKILL)
        run.wait_line(r"\[graph\] nats-server restarted \(pid \d+, restart 1\)", timeout=60)
        wait_until(lambda: _accepts(port), timeout=30, what=f"nats-server listening on {port} again")
        out = completion(url, model, token_prompt(7, 300), max_tokens=MAX_TOKENS, ignore_eos=True)
        assert out["usage"]["completion_tokens"] == MAX_TOKENS

        # 3. nats-server keeps crashing (its port is taken): given up on in one line, the graph stops.
        children = descendants(run.proc.pid)
        blocker = socket.socket()
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _take_port_from_nats(run.proc.pid, blocker, port)
        blocker.listen()
        code = run.proc.wait(timeout=180)
        text = run.text()
        give_up = [line for line in text.splitlines() if "giving up on" in line]
        assert len(give_up) == 1, text
        assert re.fullmatch(
            r"\[graph\] giving up on nats-server: it exited 5 times within 300 s \(last exit code 1\); "
            rf"log: {re.escape(str(work))}/logs/nats-server\.log",
            give_up[0],
        ), give_up[0]
        assert code == 1 and "[graph] error: nats-server is given up on; stopping the graph" in text, text
        time.sleep(0.5)
        left = sorted(pid for pid in children if alive(pid))
        assert not left, f"processes left after the graph stopped: {left}\n{text}"
        assert not region.exists(), "the pool's region was not removed"
        left = shm_files(graph_inodes)
        assert not left, f"the graph left /dev/shm segments behind: {left}"
    finally:
        if blocker is not None:
            blocker.close()
        run.stop(work, seen=children)


def shm_files(inodes: set[int]) -> list[Path]:
    """The files in /dev/shm that are one of `inodes`."""
    found = []
    for path in Path("/dev/shm").iterdir():
        try:
            if path.lstat().st_ino in inodes:
                found.append(path)
        except OSError:
            continue
    return found


def _prompt_tokens(metrics: str) -> int:
    try:
        return read_counters(metrics, timeout=5).prompt_tokens
    except OSError:
        return 0


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True
