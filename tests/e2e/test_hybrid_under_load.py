"""A sliding-window model under concurrent load in a small KV cache: what the pool gives back is
what the engine computed.

One Gemma-3-shaped engine (3 sliding-window layers of window 256 : 1 full layer, vLLM's hybrid
KV cache manager on, 4 KV cache groups) gets a KV cache of only a few requests' worth of blocks,
so while prompts are prefilled in 512-token steps vLLM keeps freeing the blocks that leave the
window and handing them to the other requests - while the connector's write-behind stores of
those blocks may still be copying them. Six prompts (three share a two-chunk prefix) are sent
at once and computed; then the engine's prefix cache is reset and the same six are sent at once
again, now loaded from the pool. Had a store copied a recycled block, or a load written the
window's blocks wrong, the second answers would differ from the first.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import cached_tokens, completion, post_json
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch import ManagedProcess, ProcessGroup, free_port, stack
from tests.e2e.conftest import CHUNK, maru_kv_config, start_pool, token_prompt
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]

PROMPT_CHUNKS = 5
PROMPTS = [token_prompt(900, 2 * CHUNK) + token_prompt(910 + i, 3 * CHUNK + 1) for i in range(3)] + [
    token_prompt(920 + i, PROMPT_CHUNKS * CHUNK + 1) for i in range(3)
]
KV_BLOCKS = 48  # of 128 tokens, shared by the 4 groups: about two of these requests at a time
# vLLM's CPU attention over a cached prefix with sliding layers rounds differently from the same
# layers inside one prefill (see test_model_matrix): same tokens, logprobs this close.
LOGPROB_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def engine(module_procs: ProcessGroup, module_log_dir: Path) -> tuple[ManagedProcess, str, str]:
    pool = start_pool(module_procs, module_log_dir, f"hybrid{os.getpid()}")
    model = ensure_model("gemma3")
    env = stack.StackEnv(discovery_dir=module_log_dir / "discovery").build(cpu_thread=0)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    proc, url = stack.vllm_openai_server(
        "gemma3-small-cache",
        model,
        env,
        module_log_dir,
        port=free_port(),
        max_model_len=2048,
        kv_transfer_config=maru_kv_config(pool.address),
        extra_args=[
            "--max-num-batched-tokens",
            "512",
            "--max-num-seqs",
            "4",
            "--num-gpu-blocks-override",
            str(KV_BLOCKS),
        ],
    )
    module_procs.start(proc)
    proc.wait_for_http(f"{url}/v1/models", timeout=300)
    return proc, url, str(model)


def ask_all(url: str, model: str) -> list[dict]:
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        return list(ex.map(lambda p: completion(url, model, p, max_tokens=8, logprobs=1), PROMPTS))


def answer(out: dict) -> tuple[list[str], list[float]]:
    lp = out["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def test_concurrent_pool_hits_give_what_the_engine_computed(engine: tuple[ManagedProcess, str, str]) -> None:
    proc, url, model = engine
    log = proc.log_text()
    assert "Turning off hybrid kv cache manager" not in log and "4 KV cache groups" in log
    computed = ask_all(url, model)
    wait_until(lambda: post_json(f"{url}/reset_prefix_cache", {})["success"], 60, "prefix cache reset")
    from_pool = ask_all(url, model)
    assert sum(cached_tokens(r) for r in from_pool) >= len(PROMPTS) * 2 * CHUNK  # the pool served them
    for i, (first, again) in enumerate(zip(computed, from_pool)):
        (tokens_1, logprobs_1), (tokens_2, logprobs_2) = answer(first), answer(again)
        assert tokens_2 == tokens_1, (i, tokens_1, tokens_2)
        assert max(abs(a - b) for a, b in zip(logprobs_1, logprobs_2)) <= LOGPROB_TOLERANCE, (i, logprobs_1, logprobs_2)
    assert "Traceback" not in proc.log_text()
