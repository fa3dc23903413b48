"""A worker sees the other role's workers die at once, not when discovery lets them go.

Real Dynamo 1.6.1 runtimes (file discovery, TCP request plane) in this test and in two peer
processes (`peer_process.py`: a worker's `maru_watch` and `generate` endpoints without an engine).
`PeerWatch` in this process follows the decode role:

* both peers are live once their liveness streams open;
* a SIGKILLed peer is gone within a few seconds, while discovery still lists its instances (file
  discovery keeps them until their lease runs out, ~10 s);
* a peer that unregisters its `generate` endpoint (a planned stop) is gone although it still runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maru_dynamo.components.disagg.peers import PeerWatch
from maru_dynamo.components.disagg.roles import GENERATE, endpoint_path

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def start_peer(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.disagg.peer_process", "decode"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    assert line.startswith("ready "), f"peer did not start: {line!r}\n{log.read_text()[-2000:]}"
    return proc, int(line.split()[1])


def test_peer_watch_sees_deaths_and_planned_stops_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        **os.environ,
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(tmp_path / "discovery"),
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    }
    env.pop("NATS_SERVER", None)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    peers = [start_peer(env, tmp_path / f"peer{i}.log") for i in range(2)]
    try:
        asyncio.run(_watch(peers))
    finally:
        for proc, _ in peers:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


async def _watch(peers: list[tuple[subprocess.Popen[str], int]]) -> None:
    from dynamo.runtime import DistributedRuntime

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    changes: list[tuple[float, frozenset[int]]] = []
    watch = PeerWatch(
        runtime, "dynamo", "decode", watcher_id=1, on_change=lambda live: changes.append((time.monotonic(), live))
    )
    task = asyncio.ensure_future(watch.run())
    (killed, killed_id), (stopping, stopping_id) = peers

    async def until(want: frozenset[int], timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while watch.live != want:
            assert time.monotonic() < deadline, f"live {set(watch.live)} != {set(want)} after {timeout} s: {changes}"
            await asyncio.sleep(0.02)
        return time.monotonic()

    try:
        await until(frozenset({killed_id, stopping_id}), 30)
        killed.kill()
        t0 = time.monotonic()
        gone = await until(frozenset({stopping_id}), 30) - t0
        generate = await runtime.endpoint(endpoint_path("dynamo", "decode", GENERATE)).client()
        listed = killed_id in generate.instance_ids()
        print(f"\n[peers] a SIGKILLed peer left the live set after {gone * 1000:.0f} ms; discovery lists it: {listed}")
        assert listed, "the peer left discovery first: the stream did not tell its death"
        stopping.send_signal(signal.SIGUSR1)
        assert stopping.stdout is not None and stopping.stdout.readline().strip() == "unregistered"
        await until(frozenset(), 10)
        assert stopping.poll() is None  # it still runs: the unregistered endpoint is what counts
    finally:
        task.cancel()
        runtime.shutdown()
