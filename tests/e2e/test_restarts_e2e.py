"""Planned and unplanned restarts of a running `graph run`, under streaming load.

One real graph (nats-server, the pool, two Maru workers, the frontend on the tiny model) serves
every check:

1. `maru-dynamo graph restart --all` while streams run: the workers stop one at a time, each
   back (registered, so warm) before the next stops; each leaves discovery and drains - every
   request completes, and none had to be migrated - and exits 0. A prompt computed before the
   restart is loaded from the pool afterwards, by the restarted workers;
2. a worker's whole tree SIGKILLed: the graph takes its instance out of discovery (none of its
   files is left when it says so) and the frontend stops listing it;
3. the frontend SIGKILLed while streams run (the clients retry refused connections): only
   requests that were on the killed frontend fail (streams it was serving, and connections its
   socket accepted as it went down); a fresh KV router (`router_probe`) credits
   both workers at the host tier with the prompt that only the pool holds now (no worker has
   it since their restarts), and the restarted frontend routes it with those blocks credited
   and it is served from the pool;

and after the load nothing is pinned or reserved in the pool.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maru_dynamo.graphs import control
from maru_dynamo.graphs.client import cached_tokens, completion
from maru_dynamo.graphs.run import frontend_instances
from maru_vllm.launch.file_discovery import instance_files
from maru_vllm.pool import PoolClient
from tests.e2e.conftest import token_prompt
from tests.e2e.router_probe_client import RouterProbe
from tests.e2e.streaming_load import Load
from tests.e2e.test_graph_run import cmdline, descendants
from tests.e2e.test_graph_supervision import GraphRun, environ_of, migrations, worker_leaders
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 32
PROMPT_TOKENS = 600
POOL_PROMPT_LEN = 3 * 256 + 1  # 3 pool chunks, 6 KV blocks of 128
BLOCKS = 6

pytestmark = pytest.mark.e2e


def graph_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maru_dynamo.components.main", "graph", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def instances(work: Path) -> dict[str, int]:
    status = control.send(work, control.ControlRequest("status")).status or {}
    return {n: r["instance"] for n, r in status["processes"].items() if r.get("instance") is not None}


def selections(log: Path) -> list[dict[str, str]]:
    """The frontend's `Selected worker` log lines, as key=value dicts."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
    return [
        {k: v.strip('"') for k, v in re.findall(r"(\w+)=(\S+)", line)}
        for line in text.splitlines()
        if "Selected worker" in line
    ]


def pool_idle(address: str) -> bool:
    with PoolClient.connect(address) as c:
        stats = c.stats()
    return not (stats.get("pinned") or stats.get("pins") or stats.get("reserved"))


def test_rolling_restart_dead_worker_and_router_restart_lose_nothing(tiny_model: Path) -> None:
    run = GraphRun()
    probe: RouterProbe | None = None
    work: Path | None = None
    try:
        work = Path(run.wait_line(r"logs in (/\S+)/logs", timeout=60).group(1))
        url = run.wait_line(r"\[graph\] ready: (http://127\.0\.0\.1:\d+) \(2 workers\)", timeout=600).group(1)
        run.wait_line(r"\[graph\] control: ", timeout=10)
        model = str(tiny_model)
        pool = f"unix://{work}/pool-kv.sock"
        before = instances(work)
        assert set(before) == {"worker:worker-0", "worker:worker-1"}, before
        only_in_pool = token_prompt(77, POOL_PROMPT_LEN)
        pinned = {"backend_instance_id": before["worker:worker-0"]}
        first = completion(url, model, only_in_pool, max_tokens=6, logprobs=1, nvext=pinned)

        # 1. A rolling restart of both workers under load: drained, not migrated.
        load = Load(url, model, lambda i: token_prompt(1000 + i, PROMPT_TOKENS), MAX_TOKENS, threads=3).start()
        wait_until(lambda: len(load.results) >= 6, timeout=120, what="the load running")
        moved = migrations(url)
        res = graph_cli("restart", "--all")
        results = load.stop()
        assert res.returncode == 0, res.stdout + res.stderr
        lines = res.stdout.splitlines()
        order = [
            next(i for i, line in enumerate(lines) if line.startswith(want))
            for want in (
                "worker:worker-0: stopped in",
                "worker:worker-0: back and warm in",
                "worker:worker-1: stopping",
                "worker:worker-1: back and warm in",
            )
        ]
        assert order == sorted(order), res.stdout  # one at a time, each back before the next stops
        assert all(re.search(r"stopped in [\d.]+ s \(exit code 0\)", line) for line in lines if "stopped in" in line)
        bad = [r for r in results if not r.complete(MAX_TOKENS)]
        assert not bad, f"{len(bad)} of {len(results)} requests not complete: {bad[:5]}"
        assert migrations(url) == moved, "a planned stop migrated requests instead of draining them"
        after = instances(work)
        assert set(after.values()).isdisjoint(before.values()) and set(after.values()) <= frontend_instances(url)
        for name in ("worker-worker-0", "worker-worker-1"):
            log = (work / "logs" / f"{name}.log").read_text(errors="replace")
            assert "maru_worker: drained in" in log and "dropping" not in log, name
        # Neither restarted worker holds it: served from the pool, the same tokens.
        pinned = {"backend_instance_id": after["worker:worker-1"]}
        again = completion(url, model, only_in_pool, max_tokens=6, logprobs=1, nvext=pinned)
        assert cached_tokens(again) == 3 * 256
        assert again["choices"][0]["logprobs"]["tokens"] == first["choices"][0]["logprobs"]["tokens"]

        # 2. A dead worker leaves routing at once.
        victim = after["worker:worker-1"]
        os.killpg(worker_leaders(run.proc.pid)["worker:worker-1"], signal.SIGKILL)
        run.wait_line(rf"\[graph\] worker:worker-1: instance {victim:x} taken out of discovery", timeout=60)
        assert instance_files(work / "discovery", victim) == []
        wait_until(lambda: victim not in frontend_instances(url), timeout=30, what="the frontend dropping it")
        wait_until(lambda: len(frontend_instances(url)) == 2, timeout=300, interval=1, what="worker-1 back")
        # Only the pool holds `only_in_pool` now: worker-0 was restarted after it computed it, and
        # worker-1, which loaded it, was just killed.

        # 3. The frontend killed under load; the clients retry refused connections.
        load = Load(
            url, model, lambda i: token_prompt(5000 + i, PROMPT_TOKENS), MAX_TOKENS, threads=3, retry_refused_s=120
        ).start()
        wait_until(lambda: len(load.results) >= 6, timeout=120, what="the load running")
        (frontend,) = [p for p in descendants(run.proc.pid) if "maru_dynamo.components.frontend" in cmdline(p)]
        env = environ_of(frontend)
        killed_at = time.monotonic()
        os.kill(frontend, signal.SIGKILL)
        run.wait_line(r"\[graph\] frontend restarted \(pid \d+, restart 1\)", timeout=60)
        wait_until(lambda: len(frontend_instances(url)) == 2, timeout=120, what="the new frontend listing both")
        wait_until(lambda: len(load.results) >= 12, timeout=120, what="the load served again")
        results = load.stop()
        bad = [r for r in results if not r.complete(MAX_TOKENS)]
        # What the killed frontend had: each client's stream cut at the kill, and requests its socket
        # still accepted while the process went down (reset before any answer). Besides, Dynamo's
        # frontend answers 404 in the moment between opening its port and committing the model it
        # discovered (docs/operations.md, "Frontend restart"): a retried request may meet that.
        cut = [r for r in bad if r.status == 200 and r.start < killed_at]
        reset = [r for r in bad if r.status is None and r.end - killed_at < 5]
        not_found = [r for r in bad if r.status == 404 and r.start > killed_at and r.end - killed_at < 10]
        assert len(cut) + len(reset) + len(not_found) == len(bad), bad
        assert len(cut) + len(reset) <= 2 * 3, f"more requests failed than the killed frontend had: {bad}"
        print(
            f"\n[e2e] frontend kill: {len(cut)} streams cut, {len(reset)} connections reset at the kill, "
            f"{len(not_found)} answered 404 by the successor before it knew the model, {load.refused} refused "
            f"connections retried, {len(results) - len(bad)} requests complete"
        )

        probe = RouterProbe({**os.environ, **env}, work / "logs" / "probe.log")
        probe.wait_ready()
        view = probe.wait_for(only_in_pool, lambda v: len(v) == 2 and all(t[1] == BLOCKS for t in v.values()))
        assert sorted(view.values()) == [(0, BLOCKS, BLOCKS)] * 2, view  # both, at the host tier only
        seen = len(selections(work / "logs" / "frontend.log"))
        out = completion(url, model, only_in_pool, max_tokens=6, logprobs=1)
        chosen = selections(work / "logs" / "frontend.log")[seen:]
        assert chosen and int(chosen[0]["host_pinned_blocks"]) == BLOCKS, chosen  # routed with the pool's credit
        assert cached_tokens(out) == 3 * 256  # and served from the pool
        assert out["choices"][0]["logprobs"]["tokens"] == first["choices"][0]["logprobs"]["tokens"]

        wait_until(lambda: pool_idle(pool), timeout=60, what="no pins or reservations left in the pool")
    finally:
        if probe is not None:
            probe.stop()
        run.stop(work, timeout=180)
