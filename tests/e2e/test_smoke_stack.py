"""The real stack runs here: vLLM (CPU), Dynamo frontend + worker (a graph of plain `dynamo.vllm`
started through graphs/run.py), nats-server + nats-py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import chat_completion, completion, get_json
from maru_vllm.launch import ProcessGroup, stack
from tests.e2e import planned_graph

pytestmark = [pytest.mark.e2e]


def test_vllm_cpu_greedy_is_repeatable(tiny_model: Path, procs: ProcessGroup, log_dir: Path, tmp_path: Path) -> None:
    env = stack.StackEnv(discovery_dir=tmp_path / "disc").build(cpu_thread=0)
    proc, url = stack.vllm_openai_server("vllm", tiny_model, env, log_dir)
    procs.start(proc)
    proc.wait_for_http(f"{url}/v1/models", timeout=240)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    first = completion(url, str(tiny_model), prompt, max_tokens=12, logprobs=1)
    second = completion(url, str(tiny_model), prompt, max_tokens=12, logprobs=1)
    assert first["choices"][0]["text"], "vLLM returned no text"
    assert first["usage"]["completion_tokens"] == 12
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["choices"][0]["logprobs"]["tokens"] == second["choices"][0]["logprobs"]["tokens"]


PLAIN_GRAPH = {
    "name": "smoke",
    "model": "tiny",
    "nats": {},
    "frontend": {"router_mode": "kv"},
    "workers": [{"name": "worker", "engine": "vllm"}],  # plain dynamo.vllm, no pool
}


def test_dynamo_frontend_and_worker_serve(tiny_model: Path, procs: ProcessGroup, tmp_path: Path) -> None:
    graph = planned_graph.start(planned_graph.plan(PLAIN_GRAPH, tiny_model, tmp_path), procs)
    url, frontend = graph.url, graph["frontend"]
    assert [p.name for p in procs.processes] == ["nats-server", "worker:worker-0", "frontend"]  # and no pool
    models = get_json(f"{url}/v1/models")
    assert [m["id"] for m in models["data"]] == [str(tiny_model)]

    out = completion(url, str(tiny_model), "hello world, hello dynamo", max_tokens=6)
    assert out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["text"]

    chat = chat_completion(url, str(tiny_model), [{"role": "user", "content": "hi there"}], max_tokens=5)
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 5
    # The chat template from tokenizer_config.json was applied: <s><|user|>hi there<|end|><|assistant|>
    assert chat["usage"]["prompt_tokens"] == 1 + 1 + len("hi there") + 1 + 1
    # KV router mode really routed it.
    frontend.wait_for_log(r"Selected worker", timeout=10)


def test_nats_publish_subscribe_round_trip(nats) -> None:
    import nats as nats_py

    _, url = nats

    async def round_trip() -> list[bytes]:
        nc = await nats_py.connect(url, connect_timeout=5)
        got: list[bytes] = []
        sub = await nc.subscribe("maru.smoke")
        await nc.flush()
        for i in range(3):
            await nc.publish("maru.smoke", f"msg-{i}".encode())
        for _ in range(3):
            msg = await sub.next_msg(timeout=5)
            got.append(msg.data)
        await nc.close()
        return got

    assert asyncio.run(round_trip()) == [b"msg-0", b"msg-1", b"msg-2"]
