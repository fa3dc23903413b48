"""`maru-dynamo graph run graphs/agg.yaml`: the whole graph from one command, then a clean stop.

One test only: it starts nats-server, the pool, two vLLM workers, the frontend and (`--prometheus
PORT`) a Prometheus scraping them (~1 min and ~6 GB on this machine).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import completion
from maru_dynamo.graphs.prometheus import Prometheus
from maru_vllm.launch import free_port, rpc_dir, stack
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (ROOT / "components" / "maru_worker.py").exists(),
        reason="components/maru_worker.py (the Maru worker component) is not there yet",
    ),
]


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children run in their own sessions but keep their parent)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_graph_run_serves_and_stops_cleanly(tiny_model: Path) -> None:
    prometheus_port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "maru_dynamo.components.main",
            "graph",
            "run",
            "graphs/agg.yaml",
            "--prometheus",
            str(prometheus_port),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            output.append(line)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    children: set[int] = set()
    try:
        url = work = prometheus_url = None
        deadline = time.monotonic() + 600
        while url is None:
            assert proc.poll() is None, "graph run exited early:\n" + "".join(output)
            assert time.monotonic() < deadline, "graph not ready in 600 s:\n" + "".join(output)
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if m := re.search(r"logs in (/\S+)/logs", line):
                work = Path(m.group(1))
            if m := re.match(r"\[graph\] prometheus: (http://127\.0\.0\.1:\d+) ", line):
                prometheus_url = m.group(1)
            if m := re.match(r"\[graph\] ready: (http://127\.0\.0\.1:\d+) \(2 workers\)", line):
                url = m.group(1)
        assert work is not None
        out = completion(url, str(tiny_model), "Maru shares KV across workers. " * 8, max_tokens=8)
        assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["text"]
        # The Prometheus it printed (announced before ready) scrapes the pool, both workers and the frontend.
        assert prometheus_url == f"http://127.0.0.1:{prometheus_port}", "".join(output)
        prometheus = Prometheus(prometheus_url)
        everyone = {"pool", "worker:worker-0", "worker:worker-1", "frontend"}
        wait_until(lambda: prometheus.targets_up() == dict.fromkeys(everyone, True), 30, "every process scraped", 0.5)
        served = wait_until(lambda: prometheus.value("sum(vllm:prompt_tokens_total)"), 10, "the workers' counters")
        assert served >= out["usage"]["prompt_tokens"]

        children = descendants(proc.pid)
        # nats-server, the pool, 2 workers (each with its engine core), the frontend
        assert len(children) >= 5, children
        # Each worker's vLLM IPC socket files are in a directory of its own ...
        leaders = [p for p in children if "maru_dynamo.components.maru_worker" in cmdline(p) and os.getpgid(p) == p]
        rpc_dirs = [Path(tempfile.gettempdir()) / f"{rpc_dir.PREFIX}{pid}" for pid in leaders]
        assert len(rpc_dirs) == 2 and all(any(d.iterdir()) for d in rpc_dirs), rpc_dirs
        region = Path(f"/dev/shm/maru-kv-{work.name}")
        assert region.exists()
        if stack.worker_cpus(0, 2) is not None:
            # Pinned (CPU engines, fewer than two cores each): every process of worker i on core i.
            workers = [pid for pid in children if "maru_dynamo.components.maru_worker" in cmdline(pid)]
            assert len(workers) == 2, workers
            seen = set()
            for pid in workers:
                tree = {pid} | descendants(pid)
                assert len(tree) >= 3, tree  # API server, engine core, model runner
                cores = {frozenset(os.sched_getaffinity(p)) for p in tree if alive(p)}
                assert len(cores) == 1 and len(next(iter(cores))) == 1, cores
                seen |= cores
            assert seen == {frozenset({0}), frozenset({1})}, seen

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, "".join(output)
        time.sleep(0.5)
        left = sorted(pid for pid in children if alive(pid))
        assert not left, f"processes left after SIGINT: {left}\n" + "".join(output)
        assert "[graph] SIGINT: stopping" in "".join(output) and "[graph] stopped" in "".join(output)
        assert not region.exists(), "the pool's region was not removed"
        assert not work.exists(), "the work dir was not removed after a clean stop"
        assert not [d for d in rpc_dirs if d.exists()], "the workers' IPC socket dirs were left behind"  # ... gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
