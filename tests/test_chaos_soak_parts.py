"""The chaos soak's parts (benchmarks/chaos): its judge of a streamed response, its fault schedule,
its process-tree kill, its /dev/shm attribution and RSS slope, and its refusal of bad input.

The load's judge runs against a loopback HTTP server that streams chosen bytes (the soak's own
measuring instrument under test, not a stand-in for the product), so that each way a response
can come back short is shown to be counted as such.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing import shared_memory
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "chaos_soak.py"
sys.path.insert(0, str(REPO / "benchmarks"))

from chaos import procs  # noqa: E402 - benchmarks/ is not a package
from chaos.faults import Fault, parse_schedule  # noqa: E402
from chaos.load import COMPLETED, FAILED, TRUNCATED, LoadConfig, LoadGenerator, judge, stream_completion  # noqa: E402
from chaos.samplers import Sampler, slope_mib_per_min  # noqa: E402

MAX_TOKENS = 4


def _event(text: str, finish: str | None = None) -> bytes:
    return b"data: " + json.dumps({"choices": [{"text": text, "finish_reason": finish}]}).encode() + b"\n\n"


def _usage(tokens: int) -> bytes:
    return b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": tokens}}).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
FULL = [_event("a"), _event("b"), _event("c"), _event("d", "length"), _usage(4), DONE]


async def _serve(status: int, parts: list[bytes], cut: bool) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        headers = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        length = int(headers.split("content-length:", 1)[1].split("\r\n", 1)[0])
        await reader.readexactly(length)  # the request body
        head = f"HTTP/1.1 {status} X\r\ncontent-type: text/event-stream\r\n"
        if cut:
            head += "transfer-encoding: chunked\r\n\r\n"
            writer.write(head.encode())
            for p in parts:
                writer.write(f"{len(p):x}\r\n".encode() + p + b"\r\n")
            await writer.drain()
            writer.transport.abort()  # the connection drops mid-stream
            return
        body = b"".join(parts)
        writer.write(head.encode() + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


def _ask(status: int, parts: list[bytes], cut: bool = False) -> tuple[str, int]:
    async def go() -> tuple[str, int]:
        async for url in _serve(status, parts, cut):
            cfg = LoadConfig(url=url, model="m", max_tokens=MAX_TOKENS, request_timeout_s=10)
            async with httpx.AsyncClient() as client:
                r = await stream_completion(client, cfg, 0, [1, 2, 3])
            return r.outcome, r.tokens
        raise AssertionError("no server")

    return asyncio.run(go())


@pytest.mark.parametrize(
    "status, parts, cut, outcome",
    [
        (200, FULL, False, COMPLETED),
        (200, FULL[:2] + [_event("c", "length"), _usage(3), DONE], False, TRUNCATED),  # shorter than asked
        (200, FULL[:-1], False, TRUNCATED),  # no [DONE]
        (200, FULL[:2], True, TRUNCATED),  # the connection is cut mid-stream
        (200, FULL[:2] + [b'data: {"error": {"message": "engine died"}}\n\n', DONE], False, TRUNCATED),
        (503, [b"busy"], False, FAILED),
    ],
    ids=["complete", "short", "no-done", "cut", "error-event", "503"],
)
def test_a_response_is_complete_only_with_every_token_asked(
    status: int, parts: list[bytes], cut: bool, outcome: str
) -> None:
    assert _ask(status, parts, cut)[0] == outcome


def test_generated_line_separators_do_not_split_an_event() -> None:
    # \x1c, \x85 and U+2028 are line breaks to str.splitlines; SSE events end only at "\n".
    parts = [_event("\x1c"), _event("\x85"), _event("\u2028"), _event("\x1e", "length"), _usage(4), DONE]
    assert _ask(200, parts) == (COMPLETED, 4)


def _load_for(duration_s: float, max_duration_s: float, keep_going: Callable[[float], bool]) -> tuple[float, int]:
    """Run the load generator against a server that always answers in full: (seconds it sent
    requests for, requests completed). `keep_going` is asked with the seconds since the load began."""

    async def go() -> tuple[float, int]:
        async for url in _serve(200, FULL, False):
            cfg = LoadConfig(url=url, model="m", concurrency=2, max_tokens=MAX_TOKENS)
            cfg = dataclasses.replace(cfg, duration_s=duration_s, max_duration_s=max_duration_s)
            gen = LoadGenerator(cfg, keep_going=lambda: keep_going(time.monotonic() - gen.started))  # noqa: B023
            results = await gen.run()
            assert all(r.outcome == COMPLETED for r in results) and len(results) == gen.sent
            return max(r.start for r in results) - gen.started, len(results)
        raise AssertionError("no server")

    return asyncio.run(go())


def test_load_goes_on_past_its_duration_while_faults_are_pending_up_to_the_cap() -> None:
    last, sent = _load_for(0.3, 10.0, lambda elapsed: elapsed < 1.5)
    assert 1.0 < last < 2.5 and sent > 2
    last, _ = _load_for(0.3, 1.0, lambda elapsed: True)  # never done: the cap ends it
    assert 0.5 < last < 1.5
    last, _ = _load_for(0.3, 10.0, lambda elapsed: False)
    assert last < 0.6


def test_judge_needs_status_done_length_and_count() -> None:
    assert judge(200, 4, "length", True, None, 4) == COMPLETED
    assert judge(200, 4, "stop", True, None, 4) == TRUNCATED
    assert judge(None, 0, None, False, "ConnectError", 4) == FAILED


def test_schedule_is_parsed_in_time_order() -> None:
    assert parse_schedule("pool-stop@80+5, worker-kill@20,nats-stop@100,pool-restart-warm@60,worker-term@40") == [
        Fault("worker-kill", 20.0),
        Fault("worker-term", 40.0),
        Fault("pool-restart-warm", 60.0),
        Fault("pool-stop", 80.0, 5.0),
        Fault("nats-stop", 100.0),
    ]
    assert parse_schedule("") == []


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "reboot@5",
            "fault 'reboot@5': unknown kind 'reboot'; use one of worker-kill, worker-term, pool-kill, "
            "pool-restart-warm, pool-stop, nats-stop",
        ),
        ("pool-kill", "fault 'pool-kill': use KIND@SECONDS or pool-stop@SECONDS+HOLD"),
        ("pool-kill@5+3", "fault 'pool-kill@5+3': only pool-stop takes +HOLD seconds"),
        ("pool-stop@5+0", "fault 'pool-stop@5+0': the hold must be more than 0 seconds"),
    ],
)
def test_a_bad_schedule_names_the_item_and_what_is_allowed(text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_schedule(text)
    assert message in str(err.value)


def _wait(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_signal_tree_kills_descendants_in_sessions_of_their_own() -> None:
    # A parent with a child in a new session (as vLLM's helpers are) and a grandchild.
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import subprocess, sys, time; "
        'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]); time.sleep(60)\'], '
        "start_new_session=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert _wait(lambda: len(procs.tree(parent.pid)) == 3), procs.tree(parent.pid)
        members = procs.tree(parent.pid)
        assert sorted(procs.signal_tree(parent.pid, signal.SIGKILL)) == sorted(members)
        parent.wait(timeout=10)
        assert _wait(lambda: not any(procs.alive(p) for p in members))
    finally:
        for p in procs.tree(parent.pid):
            os.kill(p, signal.SIGKILL)
        parent.kill()
        parent.wait()


class _OneProcessView:
    """The two things the sampler asks a graph: its process names and each one's pid."""

    def __init__(self, pid: int) -> None:
        self._pid = pid

    def names(self) -> list[str]:
        return ["holder"]

    def pid(self, name: str) -> int | None:
        return self._pid

    def pool_stats(self, timeout: float = 2.0) -> None:
        return None


def test_sampler_attributes_the_shm_files_a_graph_process_maps() -> None:
    ours = f"psm_chaostest{os.getpid()}"
    other = shared_memory.SharedMemory(name=f"psm_chaosother{os.getpid()}", create=True, size=4096)
    code = (
        "import sys, time\nfrom multiprocessing import shared_memory\n"
        f"m = shared_memory.SharedMemory(name={ours!r}, create=True, size=4096)\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        sampler = Sampler(_OneProcessView(holder.pid), interval_s=1)  # type: ignore[arg-type]
        sampler.sample()
        assert ours in sampler.shm_seen
        assert other.name not in sampler.shm_seen  # this test's own segment is not the graph's
        labels = [series.label for series in sampler.series.values()]
        assert f"holder/python[{holder.pid}]" in labels  # and its resource tracker below it
    finally:
        holder.kill()
        holder.wait()
        other.close()
        other.unlink()
        Path("/dev/shm", ours).unlink(missing_ok=True)


def test_slope_is_mib_per_minute_of_a_least_squares_fit() -> None:
    times = [0.0, 30.0, 60.0, 90.0]
    assert slope_mib_per_min(times, [1024 * (100 + 2 * i) for i in range(4)]) == pytest.approx(4.0)
    assert slope_mib_per_min(times[:2], [1, 2]) is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--faults", "pool-kill@200"], "--faults: pool-kill@200 is not within the load (--duration 150)"),
        (["--max-duration", "100"], "--max-duration 100: use at least --duration (150)"),
        (["--duration", "-1"], "argument --duration: invalid value '-1': use a number greater than 0"),
        (["--pool-size", "tiny"], "--pool-size: invalid size 'tiny': use bytes or a number with a K, M, G or T"),
        (["--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: the folder /nonexistent does not exist"),
    ],
)
def test_bad_input_is_one_line_naming_the_value(args: list[str], message: str) -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"chaos_soak: error: {message}"), res.stderr


def test_the_soak_runs_the_disaggregated_graph_and_refuses_other_shapes(tmp_path: Path) -> None:
    import chaos_soak

    spec = chaos_soak.load_spec(chaos_soak.parse_args(["--graph", "disagg"]))
    assert spec.mode == "disagg" and sorted(w.role for w in spec.workers) == ["decode", "prefill"]
    assert spec.pool.size == 16 << 20  # the soak's small pool, as for the aggregated graph
    two = tmp_path / "two-prefill.yaml"
    two.write_text(
        "name: x\nworkers:\n  - {name: p1, role: prefill}\n  - {name: p2, role: prefill}\n  - {name: d, role: decode}\n"
    )
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--graph", str(two)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"chaos_soak: error: --graph {two}: a disaggregated graph for the soak has one prefill and one decode "
        "worker entry"
    )
