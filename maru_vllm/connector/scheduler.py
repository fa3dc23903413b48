"""Scheduler side of MaruKVConnector: which chunks to load and which to store, per step.

Per request the scheduler side keeps a small `RequestState`:

  lookup     -> one batched pool lookup the first time the scheduler asks how many tokens the
                pool can supply (the leading whole chunks), plus one lookup of the next chunk's
                part keys when the prompt goes on beyond them (the leading blocks it shares with
                a pool chunk); the answer is cached until the request is scheduled or ends,
                so a request waiting for memory does not hit the pool on every step.
                Where the pool's lower tier (`pool.tier2`) holds the chunks after the present
                ones, the lookup asks the pool to fetch them and answers None (vLLM asks again
                next step) until they are in the pool or the tier gave them up, at most
                TIER_WAIT_S; the chunks then load like any pool hit.
  load plan  -> set in `update_state_after_alloc` when vLLM accepted the external tokens:
                chunk by chunk, the blocks beyond the local prefix-cache hit; the last chunk
                may be loaded in part.
  stores     -> in `build_connector_meta`, every chunk of the prompt that this step completes
                (every step of a chunked prefill, resumed and preempted requests included), minus
                the chunks the pool already had.
  cleanup    -> `request_finished` drops the state, so nothing grows without bound. When a
                store was ever planned for the request, it returns True: the worker side's
                write-behind copy may still read the request's blocks, so vLLM keeps them
                until the worker reports the request in `get_finished` (the request id
                reaches the worker in the next step's metadata, `held_for_stores`).

Matched tokens are block-aligned - exactly the leading blocks of the prompt that some pool
chunk holds, which is what the event relay credits at Dynamo's router - start beyond the local
prefix-cache hit, and always leave at least one prompt token to compute (vLLM needs a token to
sample from).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from maru_vllm.connector.chunks import ChunkGeometry, chunk_key, hash_bytes
from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
from maru_vllm.connector.pool_interface import ConnectorPool
from maru_vllm.connector.scheduled import scheduled_requests
from maru_vllm.connector.sides import SchedulerSide

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# After a failed load, how long the scheduler's lookups ask the pool service instead of the
# presence table: long enough for a hung service to miss one lookup deadline (which marks the pool
# down for the scheduler too), short enough that an object evicted between lookup and load costs
# little.
DISTRUST_AFTER_FAILED_LOAD_S = 1.0
# The longest a request waits for chunks the pool is fetching from its lower tier (the pool
# gives up a fetch sooner, after its own deadline; this bounds a fetch request that got lost),
# and how often the fetch is asked for again meanwhile.
TIER_WAIT_S = 3.0
TIER_ASK_EVERY_S = 0.25


@dataclasses.dataclass
class RequestState:
    request: Request
    block_ids: list[int] = dataclasses.field(default_factory=list)
    # Lookup cache: how many leading blocks were checked, how many whole chunks the pool holds
    # and how many leading blocks of the next chunk (a chunk shared in part).
    checked_blocks: int = -1
    pool_chunks: int = 0
    part_blocks: int = 0
    # Which of the geometry's splits holds each of those whole chunks (0: this engine's own TP
    # split; chunks past the list's end: 0).
    chunk_splits: list[int] = dataclasses.field(default_factory=list)
    # Tokens computed locally (prefix cache) when vLLM asked; where a load starts.
    local_tokens: int = 0
    # Load decided in update_state_after_alloc, emitted in the next build_connector_meta.
    pending_load_tokens: int = 0
    # Every chunk below this index is stored (or known to be in the pool).
    next_store_chunk: int = 0
    # num_computed_tokens vLLM should report next step unless it rolled the request back.
    expected_computed: int = -1
    # A store was planned for this request (its blocks are held at the end, see request_finished).
    has_stores: bool = False
    # Waiting for chunks fetched from the pool's lower tier: since when, and when last asked.
    fetch_since: float | None = None
    fetch_asked: float = 0.0


class MaruSchedulerSide(SchedulerSide):
    """One KV cache group: synchronous loads chunk by chunk (the last one may be in part)."""

    def __init__(
        self,
        geometry: ChunkGeometry,
        namespace: str,
        pool: ConnectorPool,
        *,
        can_load: bool,
        can_store: bool,
    ) -> None:
        self.geometry = geometry
        self.namespace = namespace
        self.pool = pool
        self.can_load = can_load
        self.can_store = can_store
        self.requests: dict[str, RequestState] = {}
        # Finished requests whose blocks vLLM holds for the worker's stores, not yet announced.
        self.held_for_stores: set[str] = set()

    # -- lookup ------------------------------------------------------------------------------
    def _state(self, request: Request) -> RequestState:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = RequestState(request)
        return st

    def _loadable_blocks(self, request: Request) -> int:
        # Leave at least one token to compute.
        return min(max(request.num_tokens - 1, 0) // self.geometry.block_size, len(request.block_hashes))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        if not self.can_load:
            return 0, False
        max_blocks = self._loadable_blocks(request)
        if max_blocks == 0:
            return 0, False
        if st.checked_blocks != max_blocks:
            g = self.geometry
            max_chunks = max_blocks // g.blocks_per_chunk
            present = 0
            splits: list[int] = []
            if max_chunks:
                keys = g.keys_all_ranks(request.block_hashes, max_chunks)
                present, fetching = self._lookup(st, keys)
                if fetching:
                    return None, False  # vLLM asks again next step
                present //= g.objects_per_chunk()
                if present < max_chunks and len(g.splits) > 1:
                    present, splits = self._other_splits(request, max_chunks, present)
            st.checked_blocks = max_blocks
            st.pool_chunks, st.chunk_splits = present, splits
            st.part_blocks = self._shared_part(request, st.pool_chunks, max_blocks)
            # Chunks the pool has need no store.
            st.next_store_chunk = max(st.next_store_chunk, st.pool_chunks)
        hit_tokens = (st.pool_chunks * self.geometry.blocks_per_chunk + st.part_blocks) * self.geometry.block_size
        return max(0, hit_tokens - num_computed_tokens), False

    def _lookup(self, st: RequestState, keys: list[bytes]) -> tuple[int, int]:
        """(keys the pool holds, keys it is fetching from its lower tier that are worth waiting for)."""
        now = time.monotonic()
        waited = 0.0 if st.fetch_since is None else now - st.fetch_since
        if waited >= TIER_WAIT_S:
            return self.pool.lookup_prefix(keys, self.namespace), 0
        present, lower = self.pool.lookup_or_fetch(keys, self.namespace, fetch=now - st.fetch_asked >= TIER_ASK_EVERY_S)
        if lower:
            if st.fetch_since is None:
                st.fetch_since = now
            if now - st.fetch_asked >= TIER_ASK_EVERY_S:
                st.fetch_asked = now
        return present, lower

    def _other_splits(self, request: Request, max_chunks: int, own: int) -> tuple[int, list[int]]:
        """(whole leading chunks, the split of each) when the own split holds the first `own`: from
        the first chunk it lacks, the split holding the most chunks in a row takes them, and so on
        until no split holds the next chunk (a prefix written partly by engines of one TP size and
        continued by another's loads whole). Ties keep the own split, then the lower TP size."""
        g = self.geometry
        chosen, at = [0] * own, own
        while at < max_chunks:
            best, split = 0, 0
            for s in range(len(g.splits)):
                if s == 0 and at == own:
                    continue  # the own split's lookup stopped here
                keys = g.keys_all_ranks(request.block_hashes, max_chunks, s, first=at)
                found = self.pool.lookup_prefix(keys, self.namespace) // g.objects_per_chunk(s)
                if found > best:
                    best, split = found, s
            if best == 0:
                break
            chosen += [split] * best
            at += best
        return at, chosen

    def _shared_part(self, request: Request, chunk: int, max_blocks: int) -> int:
        """How many leading blocks of `chunk` (not in the pool whole) some pool chunk holds, on
        every rank (each rank's part key names the same blocks of that rank's object)."""
        g = self.geometry
        first = chunk * g.blocks_per_chunk
        n = min(g.blocks_per_chunk - 1, max_blocks - first)
        if n <= 0:
            return 0
        names = [s.name for s in g.splits[0].slices]
        per = len(names)
        keys = [chunk_key(request.block_hashes[first + j], name) for j in range(n) for name in names]
        units = self.pool.lookup_parts(keys, self.namespace)
        if not units:
            return 0
        shared = 0
        while shared < n and all(u == shared + 1 for u in units[shared * per : (shared + 1) * per]):
            shared += 1
        return shared

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._state(request)
        st.block_ids = list(blocks.get_block_ids()[0])
        st.pending_load_tokens = num_external_tokens if self.can_load else 0
        # Scheduled: the next time vLLM asks (after a preemption) look up again.
        st.checked_blocks = -1

    # -- per-step plan -----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MaruConnectorMetadata:
        meta = MaruConnectorMetadata(
            preempted_req_ids=set(scheduler_output.preempted_req_ids or ()),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        for sched in scheduled_requests(scheduler_output):
            st = self.requests.get(sched.req_id)
            if st is None:
                continue
            if sched.replaces:
                table = sched.whole_table()
                st.block_ids = table[0] if table else []
            else:
                if sched.block_ids is not None:
                    st.block_ids.extend(sched.block_ids[0])
                if sched.num_computed < st.expected_computed:
                    # vLLM rolled the request back (a failed load is recomputed): the chunks from
                    # there on were not (validly) in the pool, so store them again once recomputed,
                    # and let the next lookups ask the pool service itself.
                    st.next_store_chunk = min(st.next_store_chunk, sched.num_computed // self.geometry.chunk_tokens)
                    self.pool.distrust_lookups(DISTRUST_AFTER_FAILED_LOAD_S)
            self._plan(st, sched.num_computed, sched.num_scheduled, meta)
        # Announced only once a plan was built: a request the worker never hears of would keep
        # its blocks forever.
        meta.held_for_stores, self.held_for_stores = self.held_for_stores, set()
        return meta

    def _plan(self, st: RequestState, num_computed: int, num_scheduled: int, meta: MaruConnectorMetadata) -> None:
        g = self.geometry
        req = st.request
        bpc = g.blocks_per_chunk
        st.expected_computed = num_computed + num_scheduled
        if st.pending_load_tokens:
            start_tok = st.local_tokens
            end_tok = start_tok + st.pending_load_tokens
            st.pending_load_tokens = 0
            end_block = end_tok // g.block_size
            for c in range(start_tok // g.chunk_tokens, -(-end_block // bpc)):
                first_block = max(c * bpc, start_tok // g.block_size)
                last_block = min((c + 1) * bpc, end_block)
                block_ids = st.block_ids[first_block:last_block]
                if last_block == (c + 1) * bpc:
                    split = st.chunk_splits[c] if c < len(st.chunk_splits) else 0
                    key, chunk_blocks = g.chunk_hash(req.block_hashes, c), 0
                else:  # the chunk shared in part: found by the part key of its last shared block (own split)
                    key, chunk_blocks, split = hash_bytes(req.block_hashes[last_block - 1]), bpc, 0
                skip = first_block - c * bpc
                meta.loads.append(ChunkLoad(req.request_id, key, block_ids, skip, chunk_blocks, split=split))
        if not self.can_store:
            return
        # Prompt chunks whose KV is complete once this step's forward ran.
        done_tokens = min(num_computed + num_scheduled, req.num_prompt_tokens)
        done_chunks = g.full_chunks(done_tokens, len(req.block_hashes))
        for c in range(st.next_store_chunk, done_chunks):
            block_ids = st.block_ids[c * bpc : (c + 1) * bpc]
            if len(block_ids) < bpc:
                break  # blocks not known yet (should not happen); retry next step
            lora = req.lora_request.lora_name if req.lora_request is not None else None
            meta.stores.append(
                ChunkStore(
                    req.request_id,
                    g.chunk_hash(req.block_hashes, c),
                    block_ids,
                    g.chunk_meta(req.block_hashes, req.prompt_token_ids or [], c, lora, req.cache_salt),
                    g.part_hashes(req.block_hashes, c),
                )
            )
            st.next_store_chunk = c + 1
            st.has_stores = True

    # -- end of a request --------------------------------------------------------------------
    def request_finished(self, request: Request) -> bool:
        """Forget the request; True when vLLM must keep its blocks until the worker's stores are done."""
        return self.forget_request(request)

    def forget_request(self, request: Request) -> bool:
        """Drop the request's state; True (and announced to the worker) if a store was planned."""
        st = self.requests.pop(request.request_id, None)
        if st is None or not st.has_stores:
            return False
        self.held_for_stores.add(request.request_id)
        return True
