"""Scheduler side for engines served group by group (vLLM's hybrid KV cache manager).

With several KV cache groups (or a sliding-window one) every group has its own block table and
its own pool namespace (`namespace.group_namespaces`); a chunk is one object per group (and
rank), keyed by the same chunk hash. What differs from one full-attention group
(`scheduler.MaruSchedulerSide`, whose per-request bookkeeping this reuses):

  lookup     -> a hit of H tokens (whole chunks only) needs every full-attention group's chunks
                below H and, per sliding-window group, the chunks holding the blocks vLLM keeps
                at H (`KVGroup.skipped_blocks`: the last ~window tokens). The longest such H is
                found with a few `lookup_prefix` calls; a missing window chunk moves H left.
  loads      -> asynchronous: vLLM admits the request to wait for its KV, the worker loads it
                (after the step's forward) and reports it finished - or failed, and vLLM then
                recomputes the whole prompt. vLLM accepts block-level load failures only with
                one group, so with several only a whole-request verdict is safe. Per group, the
                blocks from the local hit to H that are not null blocks are loaded.
  stores     -> every group's blocks of each completed chunk; a sliding-window group's chunk is
                skipped when vLLM already freed one of its blocks (out of the window).
  flushes    -> a sliding-window block leaves its request while the request runs, so a
                write-behind copy may still read it when vLLM hands it out again. Every block a
                sliding-window store reads is remembered; when vLLM allocates it (to any request,
                any group) the step's metadata names the store's request in `flush_req_ids`, and
                the worker finishes that request's copies before the step writes any block
                (as for preempted requests).

A request that comes back for a lookup while its asynchronous load is outstanding had that load
fail (vLLM reset it to recompute): it gets no more pool loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maru_vllm.connector.chunks import ChunkGeometry
from maru_vllm.connector.kv_groups import FULL, NULL_BLOCK_ID, KVGroup
from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
from maru_vllm.connector.pool_interface import ConnectorPool
from maru_vllm.connector.scheduled import scheduled_requests
from maru_vllm.connector.scheduler import DISTRUST_AFTER_FAILED_LOAD_S, MaruSchedulerSide, RequestState

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Lookups one request's hit may take to settle on the sliding-window groups (each miss moves
# the hit left by at least one chunk); beyond it the request gets no pool hit.
MAX_WINDOW_PROBES = 8


class GroupedSchedulerSide(MaruSchedulerSide):
    def __init__(
        self,
        geometry: ChunkGeometry,
        groups: list[KVGroup],
        namespaces: list[str],
        announced: int,
        pool: ConnectorPool,
        *,
        can_load: bool,
        can_store: bool,
    ) -> None:
        super().__init__(geometry, namespaces[announced], pool, can_load=can_load, can_store=can_store)
        self.groups = groups
        self.namespaces = namespaces
        # Per request: block ids per group (RequestState.block_ids is not used here).
        self.group_block_ids: dict[str, list[list[int]]] = {}
        # Sliding-window block id -> requests whose planned stores read it.
        self.window_store_blocks: dict[int, set[str]] = {}
        # Block ids vLLM allocated since the last plan (update_state_after_alloc).
        self.allocated: set[int] = set()
        # Requests granted an asynchronous load since the last plan / still waiting for it.
        self.granted_async: set[str] = set()
        self.awaiting_load: set[str] = set()
        self.no_pool_loads: set[str] = set()

    # -- lookup ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        req_id = request.request_id
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        if req_id in self.awaiting_load:  # asked again: the load failed and vLLM recomputes
            self.awaiting_load.discard(req_id)
            self.no_pool_loads.add(req_id)
            self.pool.distrust_lookups(DISTRUST_AFTER_FAILED_LOAD_S)
        if not self.can_load or req_id in self.no_pool_loads:
            return 0, False
        g = self.geometry
        max_blocks = self._loadable_blocks(request)
        max_chunks = max_blocks // g.blocks_per_chunk
        if max_chunks == 0:
            return 0, False
        if st.checked_blocks != max_blocks:
            st.checked_blocks = max_blocks
            st.pool_chunks = self._hit_chunks(request, max_chunks)
            st.part_blocks = 0
            st.next_store_chunk = max(st.next_store_chunk, st.pool_chunks)
        external = max(0, st.pool_chunks * g.chunk_tokens - num_computed_tokens)
        return external, external > 0

    def _hit_chunks(self, request: Request, max_chunks: int) -> int:
        """The most leading chunks whose objects every group needs are in the pool."""
        g = self.geometry
        ranks = g.objects_per_chunk()
        keys = g.keys_all_ranks(request.block_hashes, max_chunks)
        hit = max_chunks
        for grp in self.groups:
            if grp.kind == FULL and hit:
                hit = min(hit, self.pool.lookup_prefix(keys[: hit * ranks], self.namespaces[grp.index]) // ranks)
        probes = 0
        settled = False
        while hit and not settled:
            settled = True
            for grp in self.groups:
                if not grp.sliding or not hit:
                    continue
                first = grp.skipped_blocks(hit * g.chunk_tokens) // g.blocks_per_chunk
                probes += 1
                if probes > MAX_WINDOW_PROBES:
                    return 0
                present = self.pool.lookup_prefix(keys[first * ranks : hit * ranks], self.namespaces[grp.index])
                present //= ranks
                if first + present < hit:  # chunk first + present is missing: the hit ends before it
                    hit = first + present
                    settled = False
        return hit

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._state(request)
        ids = [list(group_ids) for group_ids in blocks.get_block_ids()]
        self._set_block_ids(st, ids)
        for group_ids in ids:
            self.allocated.update(group_ids)
        st.pending_load_tokens = num_external_tokens if self.can_load else 0
        st.checked_blocks = -1
        if st.pending_load_tokens:
            self.granted_async.add(request.request_id)

    def _set_block_ids(self, st: RequestState, ids: list[list[int]]) -> None:
        self.group_block_ids[st.request.request_id] = ids

    # -- per-step plan -----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MaruConnectorMetadata:
        meta = MaruConnectorMetadata(
            preempted_req_ids=set(scheduler_output.preempted_req_ids or ()),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        allocated, self.allocated = self.allocated, set()
        granted, self.granted_async = self.granted_async, set()
        for req_id in granted:
            st = self.requests.get(req_id)
            meta.async_loads.add(req_id)
            if st is None or not self._plan_loads(st, meta):
                meta.async_failed.add(req_id)
                meta.loads = [ld for ld in meta.loads if ld.req_id != req_id]
            else:
                self.awaiting_load.add(req_id)
        scheduled: list[tuple[RequestState, int, int]] = []
        for sched in scheduled_requests(scheduler_output):
            st = self.requests.get(sched.req_id)
            if st is None:
                continue
            if sched.block_ids is not None:
                for group_ids in sched.block_ids:
                    allocated.update(group_ids)
            if sched.replaces:
                self._set_block_ids(st, sched.whole_table())
            else:
                if sched.block_ids is not None:
                    ids = self.group_block_ids.setdefault(sched.req_id, [[] for _ in self.groups])
                    for known, more in zip(ids, sched.block_ids):
                        known.extend(more)
                    self._set_block_ids(st, ids)
                if sched.num_computed < st.expected_computed:
                    st.next_store_chunk = min(st.next_store_chunk, sched.num_computed // self.geometry.chunk_tokens)
            scheduled.append((st, sched.num_computed, sched.num_scheduled))
        # Copies that may still read a block vLLM handed out again: finished before any write.
        for block_id in allocated & self.window_store_blocks.keys():
            meta.flush_req_ids |= self.window_store_blocks.pop(block_id)
        for st, num_computed, num_scheduled in scheduled:
            self.awaiting_load.discard(st.request.request_id)
            st.expected_computed = num_computed + num_scheduled
            if self.can_store:
                self._plan_stores(st, num_computed + num_scheduled, meta)
        meta.held_for_stores, self.held_for_stores = self.held_for_stores, set()
        return meta

    def _plan_loads(self, st: RequestState, meta: MaruConnectorMetadata) -> bool:
        """Every group's blocks of the granted load; False if vLLM's block tables do not hold them."""
        g = self.geometry
        bpc = g.blocks_per_chunk
        start_tok = st.local_tokens
        end_tok = start_tok + st.pending_load_tokens
        st.pending_load_tokens = 0
        if end_tok % g.chunk_tokens:
            return False  # hits end on a chunk boundary
        end_block = end_tok // g.block_size
        ids = self.group_block_ids.get(st.request.request_id, [])
        if len(ids) != len(self.groups):
            return False
        hashes = st.request.block_hashes
        for grp in self.groups:
            group_ids = ids[grp.index]
            first_needed = max(start_tok // g.block_size, grp.skipped_blocks(end_tok))
            if len(group_ids) < end_block:
                return False
            for c in range(first_needed // bpc, end_block // bpc):
                first_block = max(c * bpc, first_needed)
                block_ids = group_ids[first_block : (c + 1) * bpc]
                if NULL_BLOCK_ID in block_ids:
                    return False
                meta.loads.append(
                    ChunkLoad(
                        st.request.request_id, g.chunk_hash(hashes, c), block_ids, first_block - c * bpc, 0, grp.index
                    )
                )
        return True

    def _plan_stores(self, st: RequestState, done_tokens: int, meta: MaruConnectorMetadata) -> None:
        g = self.geometry
        req = st.request
        bpc = g.blocks_per_chunk
        ids = self.group_block_ids.get(req.request_id)
        if ids is None or len(ids) != len(self.groups):
            return
        done_chunks = g.full_chunks(min(done_tokens, req.num_prompt_tokens), len(req.block_hashes))
        lora = req.lora_request.lora_name if req.lora_request is not None else None
        for c in range(st.next_store_chunk, done_chunks):
            if any(len(group_ids) < (c + 1) * bpc for group_ids in ids):
                break  # blocks not known yet (should not happen); retry next step
            key = g.chunk_hash(req.block_hashes, c)
            chunk_meta = g.chunk_meta(req.block_hashes, req.prompt_token_ids or [], c, lora, req.cache_salt)
            for grp in self.groups:
                block_ids = ids[grp.index][c * bpc : (c + 1) * bpc]
                if NULL_BLOCK_ID in block_ids:
                    continue  # vLLM already freed part of it (out of the window)
                meta.stores.append(ChunkStore(req.request_id, key, block_ids, chunk_meta, [], grp.index))
                if grp.sliding:
                    for block_id in block_ids:
                        self.window_store_blocks.setdefault(block_id, set()).add(req.request_id)
            st.next_store_chunk = c + 1
            st.has_stores = True

    # -- end of a request --------------------------------------------------------------------
    def request_finished(self, request: Request) -> bool:
        req_id = request.request_id
        self.group_block_ids.pop(req_id, None)
        self.awaiting_load.discard(req_id)
        self.no_pool_loads.discard(req_id)
        self.granted_async.discard(req_id)
        return super().request_finished(request)
