"""Dynamo's KV router credits a worker with the pool's blocks at the host tier, and drops the
credit when the pool drops the blocks.

Real processes, a one-worker graph planned and started by graphs/run.py: nats-server, the pool
service (--nats), Dynamo's frontend (--router-mode kv), and as its worker ONE dynamo.vllm started
through `install_pool_event_relay` (no Maru connector: the test itself puts chunks into the pool,
with metadata carrying the block hashes vLLM computes for a prompt); and a `router_probe` (a
second KvRouter) that reports per-tier overlap without routing.

* prompt A's chunks are in the pool before the worker starts (the relay's snapshot path),
  prompt B's are put while it runs (the live event path);
* the router credits both with host_pinned blocks; serving A, the frontend logs
  `Selected worker ... host_pinned_blocks=4`;
* vLLM's own KV events for A carry exactly the block hashes the test computed;
* pool chunks chained on blocks the engine holds extend its prefix at the host tier;
* after `PoolClient.remove`, the host credit is gone (A keeps its device blocks);
* with tier-2 credit on (the worker's relay follows `maru.tier2.keys`, where the test announces
  chunks as a foreign pool would), Dynamo scores a block the worker holds at the host and the
  disk tier once, at the host tier; removing it from the pool leaves its disk-tier credit, and
  the tier's `gone` withdraws that; a prefix continues from the host tier into the disk tier.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from maru_dynamo.graphs.client import completion
from maru_vllm.events.vllm_format import external_hash
from maru_vllm.launch import ManagedProcess, ProcessGroup, free_port
from maru_vllm.launch.argv import kv_events_args
from maru_vllm.pool import PoolClient
from maru_vllm.pool.chunk_codec import ChunkMeta
from maru_vllm.pool.tier2.announce import KEYS_SUBJECT, Tier2Announcement, Tier2Entry
from tests.e2e import planned_graph
from tests.e2e.router_probe_client import RouterProbe, selected_lines

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BLOCK = 128
CHUNK_BLOCKS = 2
PROMPT_BLOCKS = 4

WORKER_BOOT = """
import os, sys
from maru_dynamo.components.text_only import install_text_only_stand_ins
install_text_only_stand_ins()
from maru_dynamo.components.dynamo_hooks import install_pool_event_relay
from maru_vllm.launch.handoff import run_module_as_main
install_pool_event_relay(pool_name=os.environ["MARU_TEST_POOL_NAME"],
                         pool_address=os.environ["MARU_TEST_POOL_ADDRESS"], probe_interval_s=2.0,
                         tier2_credit_max_chunks=64)
run_module_as_main("dynamo.vllm", sys.argv[1:])
"""


def token_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


def vllm_block_hashes(tokens: list[int], monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Block hashes of `tokens` as a vLLM engine with PYTHONHASHSEED=0 and sha256 computes them."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    old = getattr(kcu, "NONE_HASH", None), kcu._NONE_HASH_SEED
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    kcu.init_none_hash(hash_fn)
    try:
        hashes: list[bytes] = []
        parent = None
        for b in range(len(tokens) // BLOCK):
            parent = kcu.hash_block_tokens(hash_fn, parent, tokens[b * BLOCK : (b + 1) * BLOCK], None)
            hashes.append(bytes(parent))
        return hashes
    finally:
        if old[0] is not None:
            kcu.NONE_HASH, kcu._NONE_HASH_SEED = old


def prompt_chunks(tokens: list[int], hashes: list[bytes], chunks: range | None = None) -> list[tuple[bytes, dict]]:
    """(key, metadata) of the prompt's chunks as MaruKVConnector commits them."""
    out = []
    for c in chunks if chunks is not None else range(len(hashes) // CHUNK_BLOCKS):
        blocks = range(c * CHUNK_BLOCKS, (c + 1) * CHUNK_BLOCKS)
        meta = {
            "v": 1,
            "chunk": c,
            "block_size": BLOCK,
            "block_hashes": [hashes[b].hex() for b in blocks],
            "parent_block_hash": hashes[blocks[0] - 1].hex() if c > 0 else None,
            "token_ids": [tokens[b * BLOCK : (b + 1) * BLOCK] for b in blocks],
            "lora_name": None,
            "rank": 0,
        }
        out.append((hashes[blocks[-1]] + b"/r0", meta))
    return out


def put_prompt_chunks(
    pool: PoolClient, namespace: str, tokens: list[int], hashes: list[bytes], chunks: range | None = None
) -> list[bytes]:
    """Store the prompt's chunks like MaruKVConnector does (key, metadata); return the keys."""
    keys = []
    for key, meta in prompt_chunks(tokens, hashes, chunks):
        assert pool.put(key, b"\0" * 4096, namespace=namespace, meta=meta)
        keys.append(key)
    return keys


def announce_tier2(nats_url: str, namespace: str, stored=(), gone=()) -> None:
    """Announce chunks on `maru.tier2.keys` as another domain's pool does after a put (or a miss)."""

    async def send() -> None:
        import nats

        nc = await nats.connect(nats_url)
        msg = Tier2Announcement(
            "127.0.0.1:1",
            "other-domain",
            "0",
            [Tier2Entry(namespace, k, 4096, 4200, msgspec.convert(m, ChunkMeta)) for k, m in stored],
            [Tier2Entry(namespace, k) for k, _ in gone],
        )
        await nc.publish(KEYS_SUBJECT, msgspec.msgpack.encode(msg))
        await nc.flush()
        await nc.close()

    asyncio.run(send())


class VllmEventTap:
    """A second subscriber on vLLM's own KV-event endpoint: the hashes vLLM announces."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        from maru_vllm.events import vllm_format as vf

        self._vf = vf
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self.stored: list[Any] = []

    def drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._sock.poll(200):
                _t, _seq, payload = self._sock.recv_multipart()
                for ev in self._vf.decode_batch(payload).events:
                    if isinstance(ev, self._vf.BlockStored):
                        self.stored.append(ev)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.destroy(linger=0)


GRAPH = {
    "name": "pool-events",
    "model": "tiny",
    "nats": {},
    "pool": {"name": "events", "size": "256M"},
    "frontend": {"router_mode": "kv"},
    "workers": [{"name": "worker"}],  # its process is WORKER_BOOT: the relay without the connector
}
WORKER = "worker:worker-0"
ENGINE_ARGS = ("--max-model-len", "4096", "--enforce-eager")


@pytest.mark.timeout(900)
def test_router_credits_pool_blocks_at_host_tier(
    tiny_model: Path, procs: ProcessGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = planned_graph.plan(GRAPH, tiny_model, tmp_path)
    # The pool first, so that prompt A's chunks are in it before the worker starts.
    graph = planned_graph.start(plan, procs, hold=[WORKER, "frontend"], wait=False)
    address = graph.pool_address()
    pool = PoolClient.connect(address)
    namespace = f"kv:{tiny_model.name}:e2e-events"

    n = PROMPT_BLOCKS
    long_a = token_prompt(1, 2 * n * BLOCK + 40)  # prompt A is its first n blocks (+ a partial one)
    prompt_a = long_a[: n * BLOCK + 40]
    prompt_b = token_prompt(2, n * BLOCK + 40)
    hashes_a = vllm_block_hashes(long_a, monkeypatch)
    hashes_b = vllm_block_hashes(prompt_b, monkeypatch)
    keys_a = put_prompt_chunks(pool, namespace, long_a, hashes_a, chunks=range(n // CHUNK_BLOCKS))
    pool.put(b"not-a-chunk", b"x", namespace=namespace, meta={"something": "else"})  # ignored
    pool.put(
        b"other-model",
        b"x",
        namespace="kv:other-model:abc",  # other namespace: ignored
        meta={
            "v": 1,
            "chunk": 0,
            "block_size": BLOCK,
            "block_hashes": ["ab" * 32, "cd" * 32],
            "parent_block_hash": None,
            "token_ids": [[1] * BLOCK, [2] * BLOCK],
            "lora_name": None,
        },
    )

    kv_port = free_port()
    planned = plan.process(WORKER)
    worker = graph.start(
        WORKER,
        argv=(sys.executable, "-c", WORKER_BOOT, "--model", str(tiny_model), *ENGINE_ARGS, *kv_events_args(kv_port)),
        env={**planned.env, "MARU_TEST_POOL_NAME": plan.spec.pool_name_of(None), "MARU_TEST_POOL_ADDRESS": address},
    )
    frontend = graph.start("frontend")
    url = graph.url
    frontend.wait_for_http(f"{url}/v1/models", timeout=300, accept=lambda body: str(tiny_model).encode() in body)
    worker.wait_for_log(r"Dynamo subscribed to the KV event relay", timeout=60)
    worker.wait_for_log(r"pool '\S+' synced at seq", timeout=60)
    tap = VllmEventTap(f"tcp://127.0.0.1:{kv_port}")
    probe = RouterProbe(graph.env(), tmp_path / "logs" / "probe.log")
    try:
        probe.wait_ready()
        keys_b = put_prompt_chunks(pool, namespace, prompt_b, hashes_b)  # live event path

        # Snapshot path (A) and live path (B): the host tier holds both, the device neither.
        assert probe.wait_tiers(prompt_a, (0, n, n)) == (0, n, n)
        assert probe.wait_tiers(prompt_b, (0, n, n)) == (0, n, n)

        # The frontend's router, routing prompt A, credits the worker with them.
        line = route_and_read_selection(frontend, url, tiny_model, prompt_a)
        assert f"host_pinned_blocks={n} " in line + " ", line

        # vLLM announces A's blocks with exactly the hashes the pool chunks carry.
        tap.drain(3.0)
        announced = [h for ev in tap.stored for h in ev.block_hashes]
        assert announced[:n] == [external_hash(h) for h in hashes_a[:n]], (announced, hashes_a)
        assert probe.wait_tiers(prompt_a, (n, n, 0)) == (n, n, 0)

        # Pool chunks chained on blocks the engine holds extend its prefix at the host tier.
        keys_a += put_prompt_chunks(
            pool, namespace, long_a, hashes_a, chunks=range(n // CHUNK_BLOCKS, 2 * n // CHUNK_BLOCKS)
        )
        assert probe.wait_tiers(long_a, (n, 2 * n, n)) == (n, 2 * n, n)

        # Removing the objects withdraws the host credit; A keeps what is on the device.
        assert pool.remove(keys_a + keys_b, namespace=namespace) == len(keys_a + keys_b)
        assert probe.wait_tiers(prompt_b, (0, 0, 0)) == (0, 0, 0)
        assert probe.wait_tiers(long_a, (n, n, 0)) == (n, n, 0)
        line = route_and_read_selection(frontend, url, tiny_model, prompt_b)
        assert "host_pinned_blocks=0 " in line + " ", line

        # Tier-2 credit: a block at the host and the disk tier counts once, at the host tier;
        # each tier's removal is its own. (device, host-tier extension, disk-tier extension):
        nats_url = graph.env()["NATS_SERVER"]
        tiers = probe.extensions_by_worker
        prompt_c = token_prompt(3, n * BLOCK + 40)
        chunks_c = prompt_chunks(prompt_c, vllm_block_hashes(prompt_c, monkeypatch))
        keys_c = put_prompt_chunks(pool, namespace, prompt_c, vllm_block_hashes(prompt_c, monkeypatch))
        assert list(probe.wait_for(prompt_c, lambda v: list(v.values()) == [(0, n, 0)], read=tiers).values()) == [
            (0, n, 0)
        ]
        announce_tier2(nats_url, namespace, stored=chunks_c)
        time.sleep(3)  # the disk-tier stores reach the router (the removal below shows they did)
        assert list(tiers(prompt_c).values()) == [(0, n, 0)]  # not counted twice
        assert pool.remove(keys_c, namespace=namespace) == len(keys_c)
        view = probe.wait_for(prompt_c, lambda v: list(v.values()) == [(0, 0, n)], read=tiers)
        assert list(view.values()) == [(0, 0, n)], view  # the host tier's removal left the disk tier's store
        announce_tier2(nats_url, namespace, gone=chunks_c)
        view = probe.wait_for(prompt_c, lambda v: list(v.values()) == [(0, 0, 0)], read=tiers)
        assert list(view.values()) == [(0, 0, 0)], view
        prompt_d = token_prompt(4, n * BLOCK + 40)  # its first chunk in the pool, the rest in the tier only
        chunks_d = prompt_chunks(prompt_d, vllm_block_hashes(prompt_d, monkeypatch))
        put_prompt_chunks(pool, namespace, prompt_d, vllm_block_hashes(prompt_d, monkeypatch), chunks=range(1))
        announce_tier2(nats_url, namespace, stored=chunks_d[1:])
        want = (0, CHUNK_BLOCKS, n - CHUNK_BLOCKS)
        view = probe.wait_for(prompt_d, lambda v: list(v.values()) == [want], read=tiers)
        assert list(view.values()) == [want], view  # the disk tier continues the host tier's prefix
    finally:
        probe.stop()
        tap.close()
        pool.close()


def route_and_read_selection(frontend: ManagedProcess, url: str, model: Path, prompt: list[int]) -> str:
    """Send `prompt` through the frontend; return its router's `Selected worker` log line."""
    before = len(selected_lines(frontend))
    out = completion(url, str(model), prompt, max_tokens=2)
    assert out["usage"]["prompt_tokens"] == len(prompt)
    frontend.wait_until(lambda: len(selected_lines(frontend)) > before, 10, "a Selected worker line")
    line = selected_lines(frontend)[before]
    print("router:", line)
    return line
