"""Drive vLLM's real v1 `Scheduler` with MaruKVConnector, no model and no workers.

`make_scheduler` builds a real `VllmConfig` (offline tiny model, block size 128, prefix caching,
chunked prefill) and a `KVCacheConfig` with one full-attention group of `num_blocks` blocks, so
vLLM creates the connector's scheduler side itself. `Sim` plays the model runner: each `step()`
runs `schedule()`, records the connector metadata and the real block tables, optionally plays the
worker's stores into the pool, samples one token for every request whose prompt is done, and
feeds a `ModelRunnerOutput` (with `invalid_block_ids` when asked) back to `update_from_output`.

`Probe` wraps the connector's scheduler-side calls to record what vLLM asked and answered and
how many times each request looked the pool up.

The harness runs on every supported vLLM release (the scheduler level of `make compat` runs these
tests against each release's sources): where a release changed a class it builds, it asks the
class what it has (`model_runner_output`) instead of naming releases.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_block_hash, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from maru_vllm.connector.chunks import chunk_key, hash_bytes
from maru_vllm.connector.metadata import MaruConnectorMetadata
from maru_vllm.connector.scheduled import resumed_req_ids
from maru_vllm.pool import PoolClient

BLOCK_SIZE = 128
CHUNK_TOKENS = 256
BPC = CHUNK_TOKENS // BLOCK_SIZE
SAMPLE_TOKEN = 300  # a byte-range token, never EOS for the tiny model


# ---- vLLM objects --------------------------------------------------------------------------
_HASHER = None


def block_hasher():
    global _HASHER
    if _HASHER is None:
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        _HASHER = get_request_block_hasher(BLOCK_SIZE, fn)
    return _HASHER


def make_vllm_config(
    model_dir: Path,
    pool_address: str,
    *,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 16,
    max_model_len: int = 4096,
    long_prefill_token_threshold: int = 0,
    extra: dict[str, Any] | None = None,
    kv_role: str = "kv_both",
    model_config: ModelConfig | None = None,
) -> VllmConfig:
    """The `VllmConfig` of an engine with MaruKVConnector (vLLM validates it as it is built)."""
    if model_config is None:
        model_config = ModelConfig(model=str(model_dir), max_model_len=max_model_len, dtype="bfloat16", seed=0)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True, prefix_caching_hash_algo="sha256")
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=long_prefill_token_threshold,
        is_encoder_decoder=False,
    )
    transfer = KVTransferConfig(
        kv_connector="MaruKVConnector",
        kv_connector_module_path="maru_vllm.connector",
        kv_role=kv_role,
        kv_connector_extra_config={
            "maru_pool_address": pool_address,
            "maru_kv_chunk_tokens": CHUNK_TOKENS,
            "maru_pool_timeout_s": 2.0,
            **(extra or {}),
        },
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        kv_transfer_config=transfer,
    )


def make_scheduler(
    model_dir: Path,
    pool_address: str,
    *,
    num_blocks: int = 1000,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 16,
    max_model_len: int = 4096,
    long_prefill_token_threshold: int = 0,
    extra: dict[str, Any] | None = None,
    kv_role: str = "kv_both",
) -> Scheduler:
    vllm_config = make_vllm_config(
        model_dir,
        pool_address,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        extra=extra,
        kv_role=kv_role,
    )
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def model_runner_output(
    req_ids: list[str], sampled_token_ids: list[list[int]], kv_connector_output: KVConnectorOutput | None
) -> ModelRunnerOutput:
    """What the model runner hands the scheduler after a step. vLLM 0.34 dropped the
    `req_id_to_index` field (the index is the position in `req_ids`); it is passed where it exists."""
    index = {"req_id_to_index": {rid: i for i, rid in enumerate(req_ids)}} if _HAS_REQ_INDEX else {}
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled_token_ids, kv_connector_output=kv_connector_output, **index
    )


_HAS_REQ_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def make_request(req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=block_hasher(),
    )


def tokens(seed: int, n: int) -> list[int]:
    """`n` deterministic byte tokens; different seeds diverge at the first token."""
    return [(seed * 7919 + i * 31 + (i * i) % 97) % 250 + 3 for i in range(n)]


# The one slice of every chunk a TP 1 engine of the tiny fixture (2 KV heads) stores (chunks.py).
SLOT = "p0h0-2"


def pool_keys(req: Request, num_chunks: int, slot: str | int = SLOT) -> list[bytes]:
    """The pool keys MaruKVConnector uses for chunks 0..num_chunks-1 of `req`."""
    return [chunk_key(req.block_hashes[(c + 1) * BPC - 1], slot) for c in range(num_chunks)]


# ---- the probe -----------------------------------------------------------------------------
@dataclasses.dataclass
class MatchCall:
    req_id: str
    local_tokens: int
    answer: int
    lookups: int  # pool lookups this call caused (whole chunks and part keys together count once)


class Probe:
    """Records the connector's scheduler-side calls (wraps the instance's bound methods)."""

    def __init__(self, scheduler: Scheduler) -> None:
        conn = scheduler.connector
        self.side = conn.scheduler_side
        self.match_calls: list[MatchCall] = []
        self.allocs: list[tuple[str, int]] = []  # (req_id, num_external_tokens)
        self.finished: list[str] = []
        self.lookups_by_req: dict[str, int] = defaultdict(int)
        # The most chunks the pool held for a request at any of its lookups.
        self.pool_chunks_seen: dict[str, int] = defaultdict(int)
        self._current: list[int] = [0]
        side = self.side
        orig_match = side.get_num_new_matched_tokens
        orig_alloc = side.update_state_after_alloc
        orig_finished = side.request_finished

        def counted(lookup: Any) -> Any:
            def counting_lookup(keys: Any, namespace: str, **kw: Any) -> Any:
                self._current[0] = 1
                return lookup(keys, namespace, **kw)

            return counting_lookup

        def match(request: Request, num_computed_tokens: int) -> Any:
            self._current[0] = 0
            answer = orig_match(request, num_computed_tokens)
            n = self._current[0]
            self.lookups_by_req[request.request_id] += n
            self.match_calls.append(MatchCall(request.request_id, num_computed_tokens, answer[0], n))
            st = side.requests.get(request.request_id)
            if st is not None:
                self.pool_chunks_seen[request.request_id] = max(
                    self.pool_chunks_seen[request.request_id], st.pool_chunks
                )
            return answer

        def alloc(request: Request, blocks: Any, num_external_tokens: int) -> None:
            self.allocs.append((request.request_id, num_external_tokens))
            orig_alloc(request, blocks, num_external_tokens)

        def finished(request: Request) -> bool:
            self.finished.append(request.request_id)
            return orig_finished(request)

        side.pool.lookup_prefix = counted(side.pool.lookup_prefix)  # type: ignore[method-assign]
        side.pool.lookup_or_fetch = counted(side.pool.lookup_or_fetch)  # type: ignore[method-assign]
        side.pool.lookup_parts = counted(side.pool.lookup_parts)  # type: ignore[method-assign]
        side.get_num_new_matched_tokens = match  # type: ignore[method-assign]
        side.update_state_after_alloc = alloc  # type: ignore[method-assign]
        side.request_finished = finished  # type: ignore[method-assign]


# ---- the simulated engine loop -------------------------------------------------------------
@dataclasses.dataclass
class StepRecord:
    index: int
    output: SchedulerOutput
    meta: MaruConnectorMetadata
    # For each scheduled request: its block table and computed tokens before this step.
    blocks: dict[str, list[int]]
    computed_before: dict[str, int]
    scheduled: dict[str, int]
    preempted: set[str]
    new_or_resumed: set[str]
    # Requests vLLM admitted this step: num_external_tokens, and the last lookup answer.
    allocs: dict[str, int]
    match: dict[str, MatchCall]
    # Block hash (bytes) of every block of every scheduled request, None if not cached.
    block_hashes: dict[str, list[bytes | None]]
    invalid: set[int] = dataclasses.field(default_factory=set)


class Sim:
    """`worker`: a real `MaruWorkerSide` that stores (write-behind) and reports held requests;
    without one, held requests are reported done in the step that announces them (as an
    inline store would)."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        play_worker_stores: bool = False,
        pool_client: PoolClient | None = None,
        worker: Any = None,
        play_part_keys: bool = True,
    ) -> None:
        self.worker = worker
        self.finished_sending: dict[str, int] = {}  # req_id -> step that reported it
        self.sched = scheduler
        self.conn = scheduler.connector
        self.side = self.conn.scheduler_side
        self.namespace = self.conn.namespace
        self.probe = Probe(scheduler)
        self.play_worker_stores = play_worker_stores
        self.play_part_keys = play_part_keys  # stores carry their part keys, as the worker commits them
        self.client = pool_client
        self.steps: list[StepRecord] = []
        self.requests: dict[str, Request] = {}
        self.finished: dict[str, Request] = {}
        self.preemptions: dict[str, int] = defaultdict(int)
        # (req_id, chunk index) -> number of times a store was planned, and in which steps
        self.stores: dict[tuple[str, int], int] = defaultdict(int)
        self.store_steps: dict[tuple[str, int], list[int]] = defaultdict(list)
        # req_id -> steps in which one of its loads was reported failed
        self.failed_load_steps: dict[str, set[int]] = defaultdict(set)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.sched.add_request(req)

    def chunk_index(self, req: Request, key: bytes) -> int:
        for c in range(len(req.block_hashes) // BPC):
            if hash_bytes(req.block_hashes[(c + 1) * BPC - 1]) == key:
                return c
        raise AssertionError(f"key {key.hex()} is not a chunk of {req.request_id}")

    def load_chunk(self, req: Request, load: Any) -> int:
        """The chunk index a load reads: by its key, or (a chunk shared in part) by its part key."""
        if not load.chunk_blocks:
            return self.chunk_index(req, load.key)
        for b, h in enumerate(req.block_hashes):
            if hash_bytes(h) == load.key:
                return b // BPC
        raise AssertionError(f"part key {load.key.hex()} is not a block of {req.request_id}")

    def step(
        self, invalid_block_ids: set[int] | None = None, invalid_load_chunks: set[int] | None = None
    ) -> StepRecord:
        """One engine step. `invalid_load_chunks`: report the blocks of the loads of these chunk
        indices as failed (as the worker would for chunks missing from the pool)."""
        sched = self.sched
        probe = self.probe
        n_allocs, n_match = len(probe.allocs), len(probe.match_calls)
        out = sched.schedule()
        allocs = dict(probe.allocs[n_allocs:])
        match = {m.req_id: m for m in probe.match_calls[n_match:]}
        meta = out.kv_connector_metadata
        assert isinstance(meta, MaruConnectorMetadata), type(meta)
        new_or_resumed = {r.req_id for r in out.scheduled_new_reqs} | resumed_req_ids(out.scheduled_cached_reqs)
        blocks: dict[str, list[int]] = {}
        before: dict[str, int] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            blocks[req_id] = list(sched.kv_cache_manager.get_block_ids(req_id)[0])
            before[req_id] = sched.requests[req_id].num_computed_tokens - n
        for rid in out.preempted_req_ids:
            self.preemptions[rid] += 1
        hashes = {rid: [block_hash_of(sched, b) for b in bl] for rid, bl in blocks.items()}
        rec = StepRecord(
            len(self.steps),
            out,
            meta,
            blocks,
            before,
            dict(out.num_scheduled_tokens),
            set(out.preempted_req_ids),
            new_or_resumed,
            allocs,
            match,
            hashes,
        )
        self.steps.append(rec)
        for s in meta.stores:
            key = (s.req_id, self.chunk_index(self.requests[s.req_id], s.key))
            self.stores[key] += 1
            self.store_steps[key].append(rec.index)
        if self.worker is not None:
            self.worker.handle_preemptions(meta)
            self.worker.store(meta)
            sending = self.worker.finished_stores(set(out.finished_req_ids), meta)
        else:
            sending = set(meta.held_for_stores)
        if self.play_worker_stores:
            assert self.client is not None
            for s in meta.stores:
                self.client.put(
                    chunk_key(s.key, SLOT),
                    b"kv" * 32,
                    self.namespace,
                    meta=s.meta,
                    parts=[chunk_key(h, SLOT) for h in s.parts] if self.play_part_keys else None,
                )
        for rid in sending:
            self.finished_sending[rid] = rec.index
        invalid = set(invalid_block_ids or ())
        for failure in meta.load_failures:  # the worker reports what the scheduler could not plan
            invalid.update(failure.block_ids)
            self.failed_load_steps[failure.req_id].add(len(self.steps) - 1)
        for ld in meta.loads:
            if invalid_load_chunks and self.load_chunk(self.requests[ld.req_id], ld) in invalid_load_chunks:
                invalid.update(ld.block_ids)
        rec.invalid = invalid
        for ld in meta.loads:
            if set(ld.block_ids) & invalid:
                self.failed_load_steps[ld.req_id].add(rec.index)

        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            r = sched.requests[rid]
            sampled.append([SAMPLE_TOKEN] if r.num_computed_tokens >= r.num_tokens else [])
        mro = model_runner_output(
            req_ids,
            sampled,
            KVConnectorOutput(invalid_block_ids=invalid, finished_sending=sending) if invalid or sending else None,
        )
        sched.update_from_output(out, mro)
        for rid, r in list(self.requests.items()):
            if r.is_finished() and rid not in self.finished:
                self.finished[rid] = r
        return rec

    def run(self, max_steps: int = 500, **kw: Any) -> None:
        for _ in range(max_steps):
            if not self.sched.has_requests():
                return
            self.step(**kw)
        raise AssertionError(
            f"requests still unfinished after {max_steps} steps: {[r for r in self.requests if r not in self.finished]}"
        )


def block_hash_of(scheduler: Scheduler, block_id: int) -> bytes | None:
    blk = scheduler.kv_cache_manager.block_pool.blocks[block_id]
    return None if blk.block_hash is None else bytes(get_block_hash(blk.block_hash))
