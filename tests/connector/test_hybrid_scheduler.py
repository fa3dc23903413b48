"""The connector under vLLM's hybrid KV cache manager, driven through vLLM's real Scheduler.

The engine is Gemma-3-shaped: one sliding-window group (window 256 tokens) and one
full-attention group, one layer each, block size 128, chunks of 256 tokens, a real pool. The
loop plays the model runner: it schedules, plays the worker's stores into the pool (each group's
objects in its namespace), gives asynchronous loads their verdict, and samples a token for every
request whose prompt is done. What a user would notice if it broke:

* a second engine asking for a stored prompt gets it from the pool: all of it in the
  full-attention group, only the blocks vLLM keeps in the window in the sliding-window group -
  exactly the non-null blocks of vLLM's own block tables - loaded asynchronously;
* a failed load is recomputed from scratch and never asked of the pool again;
* a missing window object shortens the hit instead of loading a hole;
* a sliding-window block that vLLM hands out again while a store may still read it is named in
  that step's flushes, so no copy reads a recycled block.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from maru_vllm.connector.chunks import chunk_key
from maru_vllm.connector.kv_groups import NULL_BLOCK_ID
from maru_vllm.connector.metadata import MaruConnectorMetadata
from maru_vllm.connector.scheduler_groups import GroupedSchedulerSide
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch.stack import PoolProcess
from maru_vllm.pool import PoolClient
from tests.connector.sched_harness import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    SAMPLE_TOKEN,
    SLOT,
    make_request,
    model_runner_output,
    tokens,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WINDOW = 256
SLIDING, FULL = 0, 1  # group indices, in vLLM's order for Gemma 3 (sliding groups first)
PROMPT = 3 * CHUNK_TOKENS + 1


def hybrid_scheduler(pool_address: str, num_blocks: int = 64, max_num_batched_tokens: int = 512) -> Scheduler:
    model_config = ModelConfig(model=str(ensure_model("tiny")), max_model_len=4096, dtype="bfloat16", seed=0)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True, prefix_caching_hash_algo="sha256")
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=8,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    transfer = KVTransferConfig(
        kv_connector="MaruKVConnector",
        kv_connector_module_path="maru_vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "maru_pool_address": pool_address,
            "maru_kv_chunk_tokens": CHUNK_TOKENS,
            "maru_pool_timeout_s": 2.0,
        },
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        kv_transfer_config=transfer,
    )
    common: dict[str, Any] = dict(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], SlidingWindowSpec(sliding_window=WINDOW, **common)),
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(**common)),
        ],
    )
    cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


class Engine:
    """vLLM's scheduler plus a model runner that plays the worker side against the pool."""

    def __init__(self, pool_address: str, client: PoolClient, **kw: Any) -> None:
        self.sched = hybrid_scheduler(pool_address, **kw)
        side = self.sched.connector.scheduler_side
        assert isinstance(side, GroupedSchedulerSide)
        self.side = side
        self.client = client
        self.metas: list[MaruConnectorMetadata] = []
        self.fail_loads: set[str] = set()  # requests whose async load the worker reports failed
        self.pending_verdicts: tuple[set[str], set[str]] = (set(), set())
        # Sliding-window blocks a store read, by request (what the worker's copy would read).
        self.window_reads: dict[int, set[str]] = {}
        self.flush_checks = 0  # steps where a block a store read went to a new owner
        self.scheduled_tokens: dict[str, int] = {}

    def step(self) -> MaruConnectorMetadata:
        sched = self.sched
        before = {rid: self._blocks(rid) for rid in sched.requests}
        out = sched.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, MaruConnectorMetadata)
        self.metas.append(meta)
        after = {rid: self._blocks(rid) for rid in sched.requests}
        self._check_flushes(before, after, meta)
        for s in meta.stores:
            self.client.put(chunk_key(s.key, SLOT), b"kv" * 32, self.side.namespaces[s.group], meta=s.meta)
            if s.group == SLIDING:
                for b in s.block_ids:
                    self.window_reads.setdefault(b, set()).add(s.req_id)
        finished, failed = self.pending_verdicts
        self.pending_verdicts = (set(meta.async_loads), meta.async_loads & (self.fail_loads | meta.async_failed))
        req_ids = list(out.num_scheduled_tokens)
        for r, n in out.num_scheduled_tokens.items():
            self.scheduled_tokens[r] = self.scheduled_tokens.get(r, 0) + n
        sampled = [
            [SAMPLE_TOKEN] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
            for r in req_ids
        ]
        sending = set(meta.held_for_stores)
        kv_out = KVConnectorOutput(finished_sending=sending, finished_recving=finished, failed_recving=failed)
        sched.update_from_output(out, model_runner_output(req_ids, sampled, kv_out))
        return meta

    def _blocks(self, req_id: str) -> set[int]:
        try:
            ids = self.sched.kv_cache_manager.get_block_ids(req_id)
        except (KeyError, AssertionError):
            return set()
        return {b for group in ids for b in group if b != NULL_BLOCK_ID}

    def _check_flushes(self, before: dict, after: dict, meta: MaruConnectorMetadata) -> None:
        """A block a sliding-window store read that now belongs to a request it did not belong to
        before this step: the store's request must be in this step's flushes."""
        for rid, blocks in after.items():
            for b in blocks - before.get(rid, set()):
                readers = self.window_reads.pop(b, set())
                if readers:
                    self.flush_checks += 1
                    assert readers <= meta.flush_req_ids, (b, readers, meta.flush_req_ids)

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.sched.has_requests() and not any(self.pending_verdicts):
                return
            self.step()
        raise AssertionError("requests unfinished")

    def loads_of(self, req_id: str) -> list[Any]:
        return [ld for m in self.metas for ld in m.loads if ld.req_id == req_id]


@pytest.fixture
def client(pool: PoolProcess) -> Iterator[PoolClient]:
    c = PoolClient(pool.address, timeout=5.0)
    yield c
    c.close()


def stored_prompt(pool: PoolProcess, client: PoolClient, seed: int) -> tuple[Engine, list[int]]:
    """An engine that computed (and stored) a three-chunk prompt, its prefix cache then reset."""
    engine = Engine(pool.address, client)
    prompt = tokens(seed, PROMPT)
    engine.sched.add_request(make_request("first", prompt))
    engine.run()
    stored = {(s.group, s.key) for m in engine.metas for s in m.stores}
    hashes = make_request("x", prompt).block_hashes
    # Every chunk of the full-attention group; the window group's chunks its blocks were alive for.
    assert {(FULL, engine.side.geometry.chunk_hash(hashes, c)) for c in range(3)} <= stored
    assert (SLIDING, engine.side.geometry.chunk_hash(hashes, 2)) in stored
    assert engine.sched.reset_prefix_cache()
    return engine, prompt


def test_a_stored_prompt_loads_all_full_blocks_and_only_the_window_blocks(
    pool: PoolProcess, client: PoolClient
) -> None:
    _, prompt = stored_prompt(pool, client, seed=11)
    engine = Engine(pool.address, client)
    engine.sched.add_request(make_request("again", prompt))
    meta = engine.step()
    assert meta.async_loads == {"again"} and not meta.async_failed
    request = engine.sched.requests["again"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sliding_ids, full_ids = engine.sched.kv_cache_manager.get_block_ids("again")
    loads = engine.loads_of("again")
    full_loaded = [b for ld in loads if ld.group == FULL for b in ld.block_ids]
    window_loaded = [b for ld in loads if ld.group == SLIDING for b in ld.block_ids]
    hit_blocks = 3 * CHUNK_TOKENS // BLOCK_SIZE
    assert full_loaded == full_ids[:hit_blocks]
    # vLLM keeps the blocks from (hit - window + 1) // block_size on: exactly those are loaded.
    first_kept = (3 * CHUNK_TOKENS - WINDOW + 1) // BLOCK_SIZE
    assert window_loaded == sliding_ids[first_kept:hit_blocks]
    assert all(b == NULL_BLOCK_ID for b in sliding_ids[:first_kept]) and NULL_BLOCK_ID not in window_loaded
    engine.run()
    assert "again" not in engine.sched.requests  # finished
    assert sum(1 for m in engine.metas if "again" in m.async_loads) == 1  # loaded once
    assert engine.scheduled_tokens["again"] == PROMPT - 3 * CHUNK_TOKENS + 3  # the rest, then decodes


def test_a_failed_load_is_recomputed_and_not_asked_again(pool: PoolProcess, client: PoolClient) -> None:
    _, prompt = stored_prompt(pool, client, seed=12)
    engine = Engine(pool.address, client)
    engine.fail_loads.add("again")
    engine.sched.add_request(make_request("again", prompt))
    engine.run()
    assert sum(1 for m in engine.metas if "again" in m.async_loads) == 1  # asked of the pool once
    # Computed from the first token on (no local hit after the reset), then decoded.
    assert engine.scheduled_tokens["again"] == PROMPT + 3


def test_a_missing_window_object_shortens_the_hit(pool: PoolProcess, client: PoolClient) -> None:
    first, prompt = stored_prompt(pool, client, seed=13)
    hashes = make_request("x", prompt).block_hashes
    g = first.side.geometry
    window_ns = first.side.namespaces[SLIDING]
    assert client.remove([chunk_key(g.chunk_hash(hashes, 2), SLOT)], window_ns) == 1
    engine = Engine(pool.address, client)
    engine.sched.add_request(make_request("again", prompt))
    engine.step()
    loads = engine.loads_of("again")
    assert {ld.key for ld in loads if ld.group == FULL} == {g.chunk_hash(hashes, c) for c in range(2)}
    assert g.chunk_hash(hashes, 2) not in {ld.key for ld in loads}
    engine.run()


def test_window_blocks_handed_out_again_are_flushed_first(pool: PoolProcess, client: PoolClient) -> None:
    """Small block pool, long prompts in 512-token steps: vLLM frees each request's blocks that
    leave the window and gives them to the others while their stores may still read them."""
    engine = Engine(pool.address, client, num_blocks=24)
    for i in range(4):
        engine.sched.add_request(make_request(f"r{i}", tokens(20 + i, 6 * CHUNK_TOKENS + 1)))
    engine.run()
    assert engine.flush_checks > 0  # the case happened (and every time was flushed)
