"""Pool-aware routing with real Maru workers: Dynamo's KV router sees the pool for every worker.

A graph (planned and started by graphs/run.py) of nats-server, the pool (publishing events on
NATS), Dynamo's frontend in KV-router mode and two Maru workers (MaruKVConnector + the pool event
relay), on the tiny model. Prompts of 769 byte tokens have 6 full KV blocks = 3 pool chunks, so
a worker that holds a prompt in its own cache shows 6 device blocks and a peer that can load it
from the pool shows 6 host-tier blocks. Requests are pinned to a worker with Dynamo's `nvext.backend_instance_id`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import cached_tokens, completion
from maru_vllm.launch import ManagedProcess, ProcessGroup, stack
from maru_vllm.pool import PoolClient
from tests.e2e import planned_graph
from tests.e2e.conftest import token_prompt
from tests.e2e.router_probe_client import RouterProbe, selected_lines

pytestmark = [pytest.mark.e2e]

BLOCKS = 6  # full blocks of a 769-token prompt (block size 128)
PROMPT_LEN = 3 * 256 + 1


GRAPH = {
    "name": "pool-routing",
    "model": "tiny",
    "nats": {},
    "pool": {"name": "kv", "size": "256M", "chunk_tokens": 256},
    "frontend": {"router_mode": "kv", "pool_tier_weight": 0.75},
    # worker-c is held back: the late joiner of the last test.
    "workers": [{"name": "worker-a"}, {"name": "worker-b"}, {"name": "worker-c"}],
}
LATE_JOINER = "worker:worker-c-0"


class Graph:
    def __init__(self, started: planned_graph.StartedGraph, probe: RouterProbe) -> None:
        self.started, self.probe = started, probe
        self.url, self.model = started.url, started.model
        self.frontend, self.nats = started["frontend"], started["nats-server"]
        self.pool_address = started.pool_address()

    def worker(self, name: str) -> ManagedProcess:
        return self.started[f"worker:{name}-0"]

    def wait_workers(self, count: int, timeout: float = 300.0) -> list[int]:
        """Wait until the router knows `count` workers; return their ids."""
        probe_prompt = token_prompt(999, 10)
        view = self.probe.wait_for(probe_prompt, lambda v: len(v) == count, timeout=timeout)
        assert len(view) == count, f"router sees {len(view)} workers, want {count}"
        return sorted(view)

    def ask(self, prompt: list[int], worker_id: int | None = None) -> dict:
        extra = {"nvext": {"backend_instance_id": worker_id}} if worker_id is not None else {}
        return completion(self.url, self.model, prompt, max_tokens=6, logprobs=1, **extra)

    def routed_to(self, prompt: list[int]) -> tuple[dict, int]:
        """Send through the router; return the response and the worker it selected."""
        before = len(selected_lines(self.frontend))
        out = self.ask(prompt)
        self.frontend.wait_until(lambda: len(selected_lines(self.frontend)) > before, 10, "a routing decision")
        line = selected_lines(self.frontend)[before]
        worker = int(line.split("worker_id=")[1].split()[0])
        return out, worker


@pytest.fixture(scope="module")
def graph(module_procs: ProcessGroup, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Graph]:
    work = tmp_path_factory.mktemp("routing")
    started = planned_graph.start(planned_graph.plan(GRAPH, tiny_model, work), module_procs, hold=[LATE_JOINER])
    probe = RouterProbe(started.env(), work / "logs" / "probe.log")
    g = Graph(started, probe)
    probe.wait_ready()
    g.wait_workers(2)
    yield g
    probe.stop()


def test_peer_is_credited_with_pool_blocks_and_serves_them_from_the_pool(graph: Graph) -> None:
    prompt = token_prompt(31, PROMPT_LEN)
    first, served_by = graph.routed_to(prompt)
    assert cached_tokens(first) == 0
    peer = next(w for w in graph.wait_workers(2) if w != served_by)
    view = graph.probe.wait_for(prompt, lambda v: v.get(peer, (0, 0, 0))[1] == BLOCKS)
    assert view[served_by][0] == BLOCKS  # on the serving worker's own (GPU) cache
    assert view[peer] == (0, BLOCKS, BLOCKS)  # the peer: all of it at the host (pool) tier

    on_peer = graph.ask(prompt, worker_id=peer)
    assert cached_tokens(on_peer) == 3 * 256  # loaded from the pool, not recomputed
    assert on_peer["choices"][0]["logprobs"]["tokens"] == first["choices"][0]["logprobs"]["tokens"]


def test_removing_the_chunks_from_the_pool_removes_the_credit(graph: Graph) -> None:
    prompt = token_prompt(32, PROMPT_LEN)
    _, served_by = graph.routed_to(prompt)
    peer = next(w for w in graph.wait_workers(2) if w != served_by)
    assert graph.probe.wait_for(prompt, lambda v: v.get(peer, (0, 0, 0))[1] == BLOCKS)[peer][1] == BLOCKS
    with PoolClient.connect(graph.pool_address) as c:
        mine = [o for o in c.snapshot() if _chunk_of(o, prompt)]
        assert len(mine) == 3
        for o in mine:
            assert c.remove([bytes.fromhex(o["key"])], namespace=o["namespace"]) == 1
    view = graph.probe.wait_for(prompt, lambda v: v.get(peer, (9, 9, 9))[1] == 0)
    with PoolClient.connect(graph.pool_address) as c:
        left = [o["meta"].get("chunk") for o in c.snapshot() if _chunk_of(o, prompt)]
        stats = c.stats()
    assert view[peer] == (0, 0, 0), (left, stats["stores"], stats["objects"], served_by, peer)
    assert view[served_by][0] == BLOCKS  # the serving worker's own cache is untouched


def _chunk_of(obj: dict, prompt: list[int]) -> bool:
    meta = obj.get("meta") or {}
    if "chunk" not in meta:
        return False
    start = meta["chunk"] * 256
    return [t for b in meta["token_ids"] for t in b] == prompt[start : start + 256]


def test_nats_outage_keeps_serving_and_the_router_view_converges_after(graph: Graph) -> None:
    graph.nats.stop()
    assert not graph.nats.alive()
    during = token_prompt(33, PROMPT_LEN)
    out = graph.ask(during)  # requests keep succeeding without NATS
    assert out["usage"]["completion_tokens"] == 6
    time.sleep(2)
    graph.nats.restart().wait_for_log(stack.NATS_READY_PATTERN, timeout=30)
    after = token_prompt(34, PROMPT_LEN)
    graph.ask(after)
    for prompt in (during, after):  # both converge: the relay resyncs from the pool snapshot
        view = graph.probe.wait_for(
            prompt, lambda v: len(v) == 2 and all(t[1] == BLOCKS for t in v.values()), timeout=90
        )
        assert sorted(t[1] for t in view.values()) == [BLOCKS, BLOCKS], view


def test_prompt_sharing_part_of_a_chunk_is_credited_exactly_the_blocks_it_loads(graph: Graph) -> None:
    # P's 3 chunks go to the pool; Q shares P's first 5 blocks: chunks 0 and 1 whole, and only
    # the first block of chunk 2. The router credits the peer with 5 host-tier blocks and the
    # peer loads exactly those 5 (before part keys it could load only the 4 of whole chunks).
    prompt = token_prompt(36, PROMPT_LEN)
    _, served_by = graph.routed_to(prompt)
    peer = next(w for w in graph.wait_workers(2) if w != served_by)
    graph.probe.wait_for(prompt, lambda v: v.get(peer, (0, 0, 0))[1] == BLOCKS)
    shared = BLOCKS - 1
    partial = prompt[: shared * 128] + token_prompt(37, PROMPT_LEN - shared * 128)
    view = graph.probe.wait_for(partial, lambda v: v.get(peer, (0, 0, 0))[1] == shared)
    assert view[peer] == (0, shared, shared)  # the router's credit: 5 blocks at the host tier
    assert view[served_by][0] == shared  # the serving worker holds them in its own cache

    on_peer = graph.ask(partial, worker_id=peer)
    assert cached_tokens(on_peer) == shared * 128  # the peer loaded exactly the credited blocks

    # Reference: the serving worker's local prefix-cache hit on the same 5 blocks. The peer has
    # stored Q's own chunk 2 meanwhile; take it out so the reference uses no pool KV at all.
    with PoolClient.connect(graph.pool_address) as c:
        mine = [o for o in c.snapshot() if _chunk_of(o, partial) and o["meta"]["chunk"] == 2]
        assert len(mine) == 1
        assert c.remove([bytes.fromhex(mine[0]["key"])], namespace=mine[0]["namespace"]) == 1
    reference = graph.ask(partial, worker_id=served_by)
    assert cached_tokens(reference) == shared * 128
    got, want = on_peer["choices"][0]["logprobs"], reference["choices"][0]["logprobs"]
    assert got["tokens"] == want["tokens"]
    assert got["token_logprobs"] == want["token_logprobs"]  # bit-identical, not just the same tokens


def test_late_joiner_is_credited_and_takes_over_from_the_pool(graph: Graph) -> None:
    # Only worker-b is left to serve P; then worker-c joins, worker-b stops, and c serves P.
    assert graph.worker("worker-a").stop(grace_s=30) == 0  # a graceful stop
    (survivor,) = graph.wait_workers(1)
    prompt = token_prompt(35, PROMPT_LEN)
    first, served_by = graph.routed_to(prompt)
    assert served_by == survivor
    graph.started.start(LATE_JOINER)
    joiner = next(w for w in graph.wait_workers(2) if w != survivor)
    view = graph.probe.wait_for(prompt, lambda v: v.get(joiner, (0, 0, 0))[1] == BLOCKS)
    assert view[joiner] == (0, BLOCKS, BLOCKS)
    assert graph.worker("worker-b").stop(grace_s=30) == 0
    assert graph.wait_workers(1) == [joiner]
    out, served_by = graph.routed_to(prompt)
    assert served_by == joiner
    assert cached_tokens(out) == 3 * 256
    assert out["choices"][0]["logprobs"]["tokens"] == first["choices"][0]["logprobs"]["tokens"]
