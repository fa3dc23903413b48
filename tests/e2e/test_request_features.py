"""What a request can carry, through Dynamo's frontend, its KV router and the pool.

One graph for the whole module (planned as `graph run` plans it: nats-server, the pool, Dynamo's
frontend with the KV router, two Maru workers started with `--enable-lora`, on the `tiny`
fixture), and Dynamo's router asked through `router_probe` with each request's adapter and salt.
Each feature is checked the same way: the answer cold on one worker, from the pool on the other
and from the first worker's own prefix cache are the same greedy tokens with the same logprobs;
the router credits a worker with pool chunks only for requests that could load them (same
adapter, same tenant salt); a request never hits another adapter's or tenant's chunks; and the
pool holds no pin and no reservation after each test.

Requests are sent to a chosen worker with Dynamo's `nvext.backend_instance_id`. Prompts of 769
byte tokens are 3 pool chunks (6 KV blocks of 128) and one token.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from maru_dynamo.graphs import plan as graph_plan
from maru_dynamo.graphs.client import cached_tokens, completions
from maru_vllm.fixtures.lora import ensure_lora
from maru_vllm.launch import ProcessGroup
from maru_vllm.launch.engine_metrics import EngineCounters, read_counters, running_requests
from maru_vllm.launch.lifecycle import read_instance_file
from maru_vllm.pool import PoolClient
from tests.e2e import planned_graph
from tests.e2e.conftest import token_prompt
from tests.e2e.router_probe_client import RouterProbe
from tests.e2e.test_disagg_roles import settled
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]

BLOCKS = 6  # full KV blocks of a 769-token prompt (block size 128)
PROMPT_LEN = 3 * 256 + 1
MAX_MODEL_LEN = 4096  # what the graph plans for its workers
ADAPTERS = ("alpha", "beta")


class Graph:
    def __init__(self, started: planned_graph.StartedGraph, probe: RouterProbe, workers: dict[int, str]) -> None:
        """`workers`: each worker's Dynamo instance id -> the URL of its system server."""
        self.started, self.probe = started, probe
        self.url, self.model = started.url, started.model
        self.pool_address = started.pool_address()
        self.a, self.b = workers
        self.system = workers

    def counters(self, worker: int) -> EngineCounters:
        return read_counters(f"{self.system[worker]}/metrics")

    def flush(self, worker: int) -> None:
        """Empty `worker`'s own prefix cache (Dynamo's `/engine/flush_cache`), once it runs nothing."""
        wait_until(lambda: running_requests(f"{self.system[worker]}/metrics") == 0, 30, "an idle worker")
        assert _post(f"{self.system[worker]}/engine/flush_cache", {}).get("status") == "ok"

    def ask(self, prompt: list[int], worker: int, *, max_tokens: int = 6, model: str | None = None, **extra: Any):
        nvext = {"backend_instance_id": worker, **extra.pop("nvext", {})}
        payload = {"model": model or self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return completions(self.url, {**payload, "logprobs": 1, "nvext": nvext, **extra})

    def credit(self, prompt: list[int], **keys: str | None) -> dict[int, tuple[int, int, int]]:
        return self.probe.tiers_by_worker(prompt, **keys)

    def wait_credit(self, prompt: list[int], worker: int, host_blocks: int, **keys: str | None):
        return self.probe.wait_for(
            prompt, lambda v: v.get(worker, (0, 0, 0))[1] == host_blocks, read=lambda p: self.credit(p, **keys)
        )

    def chunks(self, prompt: list[int]) -> list[dict]:
        """The pool's chunk metadata of `prompt` (every object whose tokens are a chunk of it)."""
        with PoolClient.connect(self.pool_address) as c:
            objs = c.snapshot()
        out = []
        for o in objs:
            meta = o.get("meta") or {}
            if "chunk" not in meta:
                continue
            start = meta["chunk"] * 256
            if [t for b in meta["token_ids"] for t in b] == prompt[start : start + 256]:
                out.append(meta)
        return out

    def wait_chunks(self, prompt: list[int], count: int, **keys: str | None) -> list[dict]:
        if count == 0:
            return []

        def stored() -> list[dict] | None:
            mine = [m for m in self.chunks(prompt) if all(m.get(k) == v for k, v in keys.items())]
            return mine if len(mine) >= count else None

        return wait_until(stored, 30, f"{count} chunks {keys} committed to the pool")


def answer(response: dict) -> list[tuple[list[str], list[float]]]:
    """Each choice's tokens and their logprobs, by choice index."""
    choices = sorted(response["choices"], key=lambda c: c["index"])
    return [(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]) for c in choices]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def load_adapter(system_url: str, name: str, path: Path) -> None:
    """Dynamo's own LoRA route on a worker's system server (`/engine/load_lora`)."""
    out = _post(f"{system_url}/engine/load_lora", {"lora_name": name, "source": {"uri": f"file://{path}"}})
    assert out.get("status") == "success", out


@pytest.fixture(scope="module")
def graph(module_procs: ProcessGroup, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Graph]:
    work = tmp_path_factory.mktemp("features")
    spec = {
        "name": "features",
        "model": "tiny",
        "nats": {},
        "pool": {"name": "kv", "size": "256M", "chunk_tokens": 256},
        "frontend": {"router_mode": "kv"},
        "workers": [
            {
                "name": name,
                "args": ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"],
                "env": {"DYN_LORA_ENABLED": "true", "DYN_LORA_PATH": str(work / "lora-cache")},
            }
            for name in ("worker-a", "worker-b")
        ],
    }
    started = planned_graph.start(planned_graph.plan(spec, tiny_model, work), module_procs)
    probe = RouterProbe(started.env(), work / "logs" / "probe.log")
    probe.wait_ready()
    ids: dict[int, str] = {}
    for name in ("worker-a", "worker-b"):
        env = started.plan.process(f"worker:{name}-0").env
        system_url = f"http://127.0.0.1:{env['DYN_SYSTEM_PORT']}"
        for adapter in ADAPTERS:
            load_adapter(system_url, adapter, ensure_lora(tiny_model, adapter))
        instance = read_instance_file(graph_plan.instance_file(work, f"worker:{name}-0"))
        assert instance is not None, f"{name} wrote no instance id"
        ids[instance] = system_url
    wait_until(lambda: {m["id"] for m in _models(started.url)} >= set(ADAPTERS), 60, "the frontend lists the adapters")
    view = probe.wait_for(token_prompt(999, 10), lambda v: len(v) == 2, timeout=120)
    assert sorted(view) == sorted(ids)
    yield Graph(started, probe, ids)
    probe.stop()


def _models(url: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"]


@pytest.fixture(autouse=True)
def no_pins_after(graph: Graph) -> Iterator[None]:
    yield
    with PoolClient.connect(graph.pool_address) as c:
        wait_until(lambda: settled(c), 30, "no pin and no reservation left in the pool")


def three_ways(graph: Graph, prompt: list[int], *, cached: int, choices: int = 1, **request: Any) -> dict:
    """Cold on worker A, from the pool on worker B, from A's own prefix cache, and from the pool
    on A once its prefix cache is emptied: the same tokens and logprobs each time; the pool's
    answers did not compute the `cached` tokens, and A's second one loaded them.

    With several `choices` (n > 1) vLLM runs one request per choice: one scheduled a step after
    another finds the other's prefix in the engine's cache, or loads it from the pool too, so a
    cold answer may report the prefix cached and a load may count once per choice."""
    cold = graph.ask(prompt, graph.a, **request)
    assert cached_tokens(cold) == 0 or choices > 1
    graph.wait_chunks(prompt, cached // 256)
    pooled = graph.ask(prompt, graph.b, **request)
    local = graph.ask(prompt, graph.a, **request)
    assert cached_tokens(pooled) == cached
    assert cached_tokens(local) >= cached - 128  # vLLM's own hit stops a block short of the last token
    graph.flush(graph.a)
    before = graph.counters(graph.a)
    again = graph.ask(prompt, graph.a, **request)
    assert cached_tokens(again) == cached
    loaded = (graph.counters(graph.a) - before).external_kv_transfer  # from the pool, on A
    assert loaded == cached if choices == 1 else cached <= loaded <= choices * cached
    assert answer(pooled) == answer(cold) == answer(local) == answer(again)
    return cold


def test_tenant_salts_are_served_and_credited_only_within_their_tenant(graph: Graph) -> None:
    prompt = token_prompt(51, PROMPT_LEN)
    salted = {"nvext": {"cache_salt": "tenant-a"}}
    cold = graph.ask(prompt, graph.a, **salted)
    (meta,) = {m["cache_salt"] for m in graph.wait_chunks(prompt, 3)}
    assert meta == "dynamo-cache-salt:tenant-a"  # Dynamo hands vLLM the salt tagged as its own

    # the router: B may load tenant-a's chunks for tenant-a, and nothing for anyone else
    view = graph.wait_credit(prompt, graph.b, BLOCKS, cache_namespace="tenant-a")
    assert view[graph.b] == (0, BLOCKS, BLOCKS) and view[graph.a][0] == BLOCKS
    for other in ({}, {"cache_namespace": "tenant-b"}):
        assert graph.credit(prompt, **other) == {graph.a: (0, 0, 0), graph.b: (0, 0, 0)}, other

    on_b = graph.ask(prompt, graph.b, **salted)
    assert cached_tokens(on_b) == 3 * 256
    assert answer(on_b) == answer(cold)
    # a top-level `cache_salt` (vLLM's own field) is the same tenant as nvext's
    assert cached_tokens(graph.ask(prompt, graph.b, cache_salt="tenant-a")) == 3 * 256
    # another tenant and no tenant on B, which holds tenant-a's blocks in its own cache and can
    # load them from the pool: no hit, the same tokens computed cold
    for other in ({"nvext": {"cache_salt": "tenant-b"}}, {}):
        out = graph.ask(prompt, graph.b, **other)
        assert cached_tokens(out) == 0, other
        assert answer(out) == answer(cold)


def test_adapters_are_served_and_credited_only_for_their_own_requests(graph: Graph) -> None:
    prompt = token_prompt(52, PROMPT_LEN)
    base = graph.ask(prompt, graph.a)
    cold = graph.ask(prompt, graph.a, model="alpha")
    assert cached_tokens(cold) == 0  # the base model's blocks are not alpha's
    assert answer(cold)[0][0] != answer(base)[0][0]  # the adapter changes the answer: a wrong hit would show
    (lora,) = {m.get("lora_name") for m in graph.wait_chunks(prompt, 3, lora_name="alpha")}
    assert lora == "alpha"

    view = graph.wait_credit(prompt, graph.b, BLOCKS, lora_name="alpha")
    assert view[graph.b] == (0, BLOCKS, BLOCKS) and view[graph.a][0] == BLOCKS
    assert graph.credit(prompt, lora_name="beta") == {graph.a: (0, 0, 0), graph.b: (0, 0, 0)}
    assert graph.credit(prompt)[graph.b] == (0, BLOCKS, BLOCKS)  # the base model's own chunks, from A

    on_b = graph.ask(prompt, graph.b, model="alpha")
    assert cached_tokens(on_b) == 3 * 256
    assert answer(on_b) == answer(cold) == answer(graph.ask(prompt, graph.a, model="alpha"))
    beta = graph.ask(prompt, graph.b, model="beta")
    assert cached_tokens(beta) == 0
    assert answer(beta)[0][0] != answer(cold)[0][0]


def test_n_greater_than_one_answers_every_choice_from_the_pool(graph: Graph) -> None:
    # Dynamo 1.6.1 refuses n > 1 at temperature 0 (its choices would be the same); sampled with a
    # seed, each choice is reproducible, so the pool's answer must be the cold one, choice by choice
    prompt = token_prompt(53, PROMPT_LEN)
    out = three_ways(graph, prompt, cached=3 * 256, choices=2, n=2, temperature=1.0, seed=7)
    assert len(answer(out)) == 2 and answer(out)[0] != answer(out)[1]
    assert len(graph.chunks(prompt)) == 3  # stored once, not once per choice


@pytest.mark.parametrize(
    ("length", "cached"),
    [
        (200, 0),  # shorter than one chunk: nothing to store or load
        (512, 384),  # exactly two chunks: the last token is computed, so the second chunk's last block is too
        (MAX_MODEL_LEN - 6, 15 * 256),  # at max_model_len with its 6 new tokens
    ],
    ids=["shorter-than-a-chunk", "on-a-chunk-boundary", "at-max-model-len"],
)
def test_prompt_lengths_at_the_edges(graph: Graph, length: int, cached: int) -> None:
    prompt = token_prompt(54 + length, length)
    three_ways(graph, prompt, cached=cached)
    if length < 256:
        assert graph.chunks(prompt) == []
        view = graph.credit(prompt)
        assert [host_extension for _, _, host_extension in view.values()] == [0, 0], view  # no pool credit


def test_a_prompt_past_max_model_len_is_refused_and_leaves_nothing(graph: Graph) -> None:
    prompt = token_prompt(55, MAX_MODEL_LEN)
    with pytest.raises(urllib.error.HTTPError) as err:
        graph.ask(prompt, graph.b)
    assert err.value.code == 400
    assert graph.chunks(prompt) == []


def test_a_client_that_disconnects_during_its_load_leaves_no_pin_and_no_wrong_answer(graph: Graph) -> None:
    prompt = token_prompt(56, MAX_MODEL_LEN - 6)
    cold = graph.ask(prompt, graph.a)
    graph.wait_chunks(prompt, 15)
    body = json.dumps(
        {
            "model": graph.model,
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "nvext": {"backend_instance_id": graph.b},
        }
    ).encode()
    host, port = graph.url.removeprefix("http://").split(":")
    before = graph.counters(graph.b)
    for delay in (0.0, 0.01, 0.02, 0.05, 0.1):  # gone before, during and after worker B's load of 15 chunks
        graph.flush(graph.b)  # each request loads its chunks from the pool, not from B's own cache
        with socket.create_connection((host, int(port))) as s:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
            s.sendall(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(delay)
    with PoolClient.connect(graph.pool_address) as c:
        wait_until(lambda: settled(c), 30, "no pin and no reservation left after the disconnects")
    gone = graph.counters(graph.b) - before
    assert gone.chunks_loaded >= 15  # at least one of them got to its load
    assert gone.requests < 5  # and at least one was cut off by its client
    graph.flush(graph.b)
    after = graph.ask(prompt, graph.b)
    assert cached_tokens(after) == 15 * 256
    assert answer(after) == answer(cold)


def test_tenants_batched_together_answer_as_they_do_alone(graph: Graph) -> None:
    """Plain and two tenants' requests of one prompt in one batch on worker B, each loading its
    own tenant's chunks from the pool at once: the answers of each alone on worker A. (Adapters
    are not mixed in one batch: vLLM 0.31's CPU build computes a batch that mixes adapters, or an
    adapter and the base model, with one adapter, without any connector - README.)"""
    prompt = token_prompt(57, PROMPT_LEN)
    kinds: list[dict[str, Any]] = [{}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}]
    alone = [graph.ask(prompt, graph.a, nvext=k) for k in kinds]
    for k in kinds:
        graph.wait_chunks(prompt, 3, cache_salt=f"dynamo-cache-salt:{k['cache_salt']}" if k else None)
    with concurrent.futures.ThreadPoolExecutor(len(kinds)) as pool:
        together = list(pool.map(lambda k: graph.ask(prompt, graph.b, nvext=k), kinds))
    for one, both in zip(alone, together):
        assert cached_tokens(both) == 3 * 256
        assert answer(both) == answer(one)
