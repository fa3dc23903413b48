"""`maru-dynamo graph run graphs/domains.yaml` as a user runs it: two CXL domains over one Mooncake
Store, behind one frontend.

The bundled graph starts a real mooncake_master, nats-server, a pool per domain (each a client of
the master), a Maru worker on each pool and Dynamo's frontend. A prompt pinned to domain a's worker
(Dynamo's ``nvext.backend_instance_id``) is written through to the tier; domain b's pool learns its
keys over NATS, and the same prompt pinned to domain b's worker is served from the tier (cached
tokens >= its full chunks, counted by b's worker as prompt tokens from tier 2) with the tokens and
logprobs of b's own prefix-cache hit after it. With tier-2 credit on in domain b's worker only
(`MARU_TIER2_CREDIT=1` in its env), a router probe shows b's worker credited at the disk tier with
a prompt domain a prefilled, and a's worker (credit off) not credited with one b prefilled. A
SIGINT then stops everything: no process, no region, nothing pinned before it.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from maru_dynamo.graphs import control
from maru_dynamo.graphs.client import cached_tokens, completion
from maru_dynamo.graphs.prometheus import token_sources_text
from maru_vllm.pool import PoolClient
from tests.e2e.conftest import CHUNK, token_prompt
from tests.e2e.router_probe_client import BLOCK, RouterProbe
from tests.e2e.test_graph_run import alive, cmdline, descendants
from tests.e2e.test_graph_supervision import GraphRun, environ_of
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e


def _stats(work: Path, pool: str) -> dict:
    with PoolClient.connect(f"unix://{work}/pool-{pool}.sock") as c:
        return c.stats()


def _token_sources(run_pid: int, pool: str) -> dict[str, float]:
    """Where the prompt tokens of the worker on `pool` came from, off its /metrics."""
    (pid,) = [
        p
        for p in descendants(run_pid)
        if "maru_dynamo.components.maru_worker" in cmdline(p) and f"pool-{pool}.sock" in cmdline(p)
        if os.getpgid(p) == p  # the worker's leader, whose environment names its system port
    ]
    port = environ_of(pid)["DYN_SYSTEM_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return token_sources_text([resp.read().decode()])


def _lp(out: dict) -> tuple[list[str], list[float]]:
    lp = out["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def test_the_domains_graph_serves_domain_a_prompts_from_the_tier_in_domain_b(tiny_model: Path, tmp_path: Path) -> None:
    graph = yaml.safe_load(Path("graphs/domains.yaml").read_text())
    graph["workers"][1]["env"] = {"MARU_TIER2_CREDIT": "1"}  # tier-2 credit in domain b's worker only
    assert graph["workers"][1]["name"] == "worker-b"
    (tmp_path / "domains.yaml").write_text(yaml.safe_dump(graph))
    run = GraphRun(str(tmp_path / "domains.yaml"))
    children: set[int] = set()
    work: Path | None = None
    probe: RouterProbe | None = None
    try:
        work = Path(run.wait_line(r"logs in (/\S+)/logs", timeout=60).group(1))
        url = run.wait_line(r"\[graph\] ready: (http://127\.0\.0\.1:\d+) \(2 workers\)", timeout=600).group(1)
        run.wait_line(r"\[graph\] control: ", timeout=10)
        status = control.send(work, control.ControlRequest("status")).status or {}
        ids = {n: r["instance"] for n, r in status["processes"].items() if r.get("instance") is not None}
        assert set(ids) == {"worker:worker-a-0", "worker:worker-b-0"}, ids
        model = str(tiny_model)

        def ask(worker: str, prompt: list[int]) -> dict:
            pinned = {"backend_instance_id": ids[f"worker:{worker}-0"]}
            return completion(url, model, prompt, max_tokens=8, logprobs=1, nvext=pinned)

        prompt = token_prompt(4242, 3 * CHUNK + 1)
        on_a = ask("worker-a", prompt)
        assert cached_tokens(on_a) == 0
        wait_until(
            lambda: _stats(work, "kv-b")["tier2_keys"] >= 3, timeout=60, what="domain b learning a's tier-2 keys"
        )
        assert _stats(work, "kv-b")["objects"] == 0  # nothing of it in b's pool yet

        before = _token_sources(run.proc.pid, "kv-b")
        from_tier = ask("worker-b", prompt)  # b's pool fetches a's chunks; b's engine loads them
        assert cached_tokens(from_tier) >= 3 * CHUNK
        after = wait_until(
            lambda: (t := _token_sources(run.proc.pid, "kv-b"))["prompt tokens"] > before["prompt tokens"] and t,
            10,
            "worker b counting the prompt",
        )
        assert after["tier 2"] - before["tier 2"] == 3 * CHUNK  # b's worker: its three chunks came from tier 2
        assert after["pool"] == before["pool"]
        b = _stats(work, "kv-b")
        assert b["tier2_hits"] >= 3 and b["tier2_corrupt"] == 0, b
        local = ask("worker-b", prompt)  # b's own prefix cache now
        assert cached_tokens(local) >= 3 * CHUNK
        assert _lp(from_tier) == _lp(local)
        assert _lp(from_tier)[0] == _lp(on_a)[0]

        # tier-2 credit: b's worker (on) is credited at the disk tier with what a prefilled ...
        (frontend,) = [p for p in descendants(run.proc.pid) if "maru_dynamo.components.frontend" in cmdline(p)]
        probe = RouterProbe(environ_of(frontend), work / "logs" / "probe.log")
        probe.wait_ready()
        blocks = 3 * CHUNK // BLOCK
        wa, wb = ids["worker:worker-a-0"], ids["worker:worker-b-0"]
        credited = token_prompt(4343, 3 * CHUNK + 1)
        assert cached_tokens(ask("worker-a", credited)) == 0
        tiers = probe.extensions_by_worker  # worker -> (device, host-tier extension, disk-tier extension)
        view = probe.wait_for(credited, lambda v: v.get(wb, (0, 0, 0))[2] == blocks, timeout=60, read=tiers)
        assert view[wb] == (0, 0, blocks), view  # b: only the tier holds it, credited at disk
        assert view[wa][2] == 0 and view[wa][0] + view[wa][1] >= blocks, view  # a: its device and pool
        # ... and a's worker (off) is not credited with what b prefilled
        uncredited = token_prompt(4444, 3 * CHUNK + 1)
        keys_a = _stats(work, "kv-a")["tier2_keys"]
        assert cached_tokens(ask("worker-b", uncredited)) == 0
        wait_until(lambda: _stats(work, "kv-a")["tier2_keys"] >= keys_a + 3, timeout=60, what="a learning b's keys")
        probe.wait_for(uncredited, lambda v: v.get(wb, (0, 0, 0))[0] >= blocks, timeout=60, read=tiers)
        time.sleep(2)  # longer than b's credit took to arrive above
        view = probe.extensions_by_worker(uncredited)
        assert view.get(wa, (0, 0, 0)) == (0, 0, 0), view
        probe.stop()
        probe = None

        for pool in ("kv-a", "kv-b"):
            wait_until(
                lambda pool=pool: (s := _stats(work, pool))["pinned"] == 0 and s["reserved"] == 0,
                timeout=30,
                what=f"nothing pinned or reserved in {pool}",
            )

        children = descendants(run.proc.pid)
        assert any("mooncake_master" in cmdline(p) for p in children)
        run.proc.send_signal(signal.SIGINT)
        assert run.proc.wait(timeout=180) == 0, run.text()
        time.sleep(0.5)
        left = sorted(p for p in children if alive(p))
        assert not left, f"processes left after SIGINT: {left}\n" + run.text()
        assert not list(Path("/dev/shm").glob(f"maru-*{work.name}*")), "a pool region was left"
    finally:
        if probe is not None:
            probe.stop()
        run.stop(work, seen=children)
