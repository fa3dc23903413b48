"""A failing connector hook never costs correctness: real engines, failures injected per hook.

Engine A (MaruKVConnector) computes each prompt cold - a plain engine's work - and stores its
chunks in the pool. Engine F runs the test-only `FaultyMaruKVConnector` (tests/e2e/
faulty_connector.py), which makes one hook fail while its fault file names it. F then serves
the same prompt: its scheduler finds the 3 chunks in the pool, so vLLM counts 768 tokens as
loaded before any hook of the load path ran. Whatever hook fails, F's output must equal A's:
either the load happened, or every planned block was reported failed and recomputed. A forward
over blocks nobody wrote gives other logprobs (test_connector_e2e's undetected-corruption test
shows the comparison catches a bad load).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import cached_tokens, completion
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch import ProcessGroup
from tests.e2e.conftest import (
    CHUNK,
    maru_kv_config,
    pool_chunks,
    start_engine,
    start_pool,
    stored_chunks,
    token_prompt,
    wait_engines,
)
from tests.e2e.faulty_connector import SCHEDULER_HOOKS, START_HOOKS, WORKER_HOOKS

pytestmark = [pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engines(module_procs: ProcessGroup, module_log_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("faults")
    pool = start_pool(module_procs, module_log_dir, f"flt{os.getpid()}")
    tiny = ensure_model("tiny")
    fault_file = tmp / "fault"
    faulty = maru_kv_config(pool.address, test_fault_file=str(fault_file))
    faulty.update(kv_connector="FaultyMaruKVConnector", kv_connector_module_path="tests.e2e.faulty_connector")
    # Engine S fails its start-up hooks: armed before it starts, for good.
    start_faults = tmp / "start-faults"
    start_faults.write_text(" ".join(START_HOOKS))
    faulty_start = dict(faulty, kv_connector_extra_config=dict(faulty["kv_connector_extra_config"]))
    faulty_start["kv_connector_extra_config"]["test_fault_file"] = str(start_faults)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), saved]))  # F imports tests.e2e.*
    try:
        urls = {
            "A": start_engine(module_procs, "A", tiny, 0, module_log_dir, maru_kv_config(pool.address), tmp),
            "F": start_engine(module_procs, "F", tiny, 1, module_log_dir, faulty, tmp),
            "S": start_engine(module_procs, "S", tiny, 0, module_log_dir, faulty_start, tmp),
        }
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    wait_engines(module_procs, urls)
    return urls, str(tiny), fault_file, next(p for p in module_procs if p.name == "F"), pool.address


def ask(url: str, model: str, prompt: list[int]) -> dict:
    return completion(url, model, prompt, max_tokens=8, logprobs=1)


def lp(out: dict) -> tuple[list[str], list[float]]:
    lps = out["choices"][0]["logprobs"]
    return lps["tokens"], lps["token_logprobs"]


@pytest.mark.parametrize("hook", [*SCHEDULER_HOOKS, *WORKER_HOOKS])
def test_output_equals_a_plain_engine_whatever_hook_fails(engines, hook: str) -> None:
    urls, model, fault_file, f_proc, pool_address = engines
    prompt = token_prompt(900 + (SCHEDULER_HOOKS + WORKER_HOOKS).index(hook), 3 * CHUNK + 1)
    reference = ask(urls["A"], model, prompt)  # cold: computed from scratch, stored in the pool
    assert cached_tokens(reference) == 0
    assert sorted(stored_chunks(pool_address, prompt, range(3))) == [0, 1, 2]  # write-behind: committed soon after
    injected = f"injected fault in {hook}"
    before = f_proc.log_text().count(injected)
    fault_file.write_text(hook)
    try:
        out = ask(urls["F"], model, prompt)
    finally:
        fault_file.write_text("")
    assert f_proc.log_text().count(injected) > before, "the fault never fired"
    ref_tokens, ref_lps = lp(reference)
    tokens, lps = lp(out)
    assert tokens == ref_tokens
    assert all(math.isclose(x, y, abs_tol=0.05) for x, y in zip(lps, ref_lps)), (lps, ref_lps)
    # The engine keeps serving with the pool once the fault is gone.
    again = token_prompt(950 + (SCHEDULER_HOOKS + WORKER_HOOKS).index(hook), 2 * CHUNK + 1)
    ask(urls["A"], model, again)
    assert sorted(stored_chunks(pool_address, again, range(2))) == [0, 1]
    assert cached_tokens(ask(urls["F"], model, again)) == 2 * CHUNK
    # ... and the fail-closed guard never refused a plan of the unbroken connector.
    assert "vLLM counts" not in f_proc.log_text()


def test_an_engine_whose_start_up_hooks_fail_serves_plainly(engines, module_procs: ProcessGroup) -> None:
    """register_kv_caches and build_prom_metrics fail at S's start: S starts, stays off the pool
    (a granted load is recomputed, nothing stored) and gives a plain engine's output."""
    urls, model, _, _, pool_address = engines
    s_proc = next(p for p in module_procs if p.name == "S")
    log = s_proc.log_text()
    for hook in START_HOOKS:
        assert f"injected fault in {hook}" in log, hook
    assert "Maru connector disabled on this worker (registering the KV caches failed)" in log
    prompt = token_prompt(990, 3 * CHUNK + 1)
    reference = ask(urls["A"], model, prompt)
    assert sorted(stored_chunks(pool_address, prompt, range(3))) == [0, 1, 2]
    out = ask(urls["S"], model, prompt)
    ref_tokens, ref_lps = lp(reference)
    tokens, lps = lp(out)
    assert tokens == ref_tokens
    assert all(math.isclose(x, y, abs_tol=0.05) for x, y in zip(lps, ref_lps)), (lps, ref_lps)
    # Its own prompts never reach the pool: it stores nothing.
    own = token_prompt(991, 2 * CHUNK + 1)
    ask(urls["S"], model, own)
    time.sleep(2)  # a write-behind store of an engine that stores would be committed by now
    assert pool_chunks(pool_address, own) == {}
