"""Fail closed on the load path: every block vLLM counted as loaded is loaded or reported failed.

vLLM counts the tokens a connector matched as computed the moment it admits the request
(`update_state_after_alloc`), before any byte is copied. From then on the only way back is the
worker's `get_block_ids_with_load_errors`: a block reported there is recomputed, any other
block is trusted by the forward. So a load hook that fails - with an exception the connector
contains, or with a plain bug that forgets part of the plan - must not simply report nothing:
the forward would then run over blocks that were never written.

`SchedulerLoadGuard` keeps the one fact that settles it, straight from vLLM's own calls: how
many external tokens vLLM granted each request this step. When the step's metadata is built
(`seal`), it recomputes from the `SchedulerOutput` which blocks those tokens occupy and checks
that the plan loads exactly them. A request whose plan is missing, partial, or came from a hook
that raised gets no loads at all and a `LoadFailure` for every granted block instead; the worker
reports those blocks failed (and drops that request's stores of the step), and vLLM recomputes
them under `kv_load_failure_policy=recompute`. Loads for requests vLLM granted nothing are
dropped: they would write blocks the forward computes, or prefix-cache blocks others share.

The worker side's counterpart lives in the connector: an exception in `start_load_kv` or
`get_block_ids_with_load_errors` reports every block the step's metadata plans to load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from maru_vllm.connector.metadata import LoadFailure, MaruConnectorMetadata
from maru_vllm.connector.scheduled import resumed_req_ids

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

logger = init_logger(__name__)


class SchedulerLoadGuard:
    def __init__(self, block_size: int, asynchronous: bool = False) -> None:
        self.block_size = block_size
        # Loads are asynchronous (engines served group by group): vLLM waits for a verdict on
        # every request it granted tokens, so each must be in `async_loads`, failed if unplanned.
        self.asynchronous = asynchronous
        self.granted: dict[str, int] = {}  # req_id -> external tokens vLLM granted this step
        # req_id -> the blocks those tokens occupy, from vLLM's own calls alone (what `fail_step`
        # reports when the step's SchedulerOutput cannot be read).
        self.granted_blocks: dict[str, list[int]] = {}
        self.local_tokens: dict[str, int] = {}  # req_id -> its local prefix-cache hit, as vLLM asked
        self.broken: set[str] = set()  # requests a load hook failed for this step
        self.failed_loads = 0  # requests whose granted load was turned into a failure

    def asked(self, req_id: str, num_local_tokens: int) -> None:
        """vLLM asked for `req_id`'s external tokens beyond its local hit of `num_local_tokens`."""
        self.local_tokens[req_id] = num_local_tokens

    def forget(self, req_id: str) -> None:
        """The request finished (or was aborted while it waited): drop what `asked` kept."""
        self.local_tokens.pop(req_id, None)

    def granted_load(self, req_id: str, num_external_tokens: int, blocks: Any = None) -> None:
        """vLLM admitted `req_id` counting `num_external_tokens` tokens as loaded; `blocks` is the
        request's `KVCacheBlocks` (its whole table so far)."""
        local = self.local_tokens.pop(req_id, 0)
        if num_external_tokens <= 0:
            return
        self.granted[req_id] = num_external_tokens
        end = -(-(local + num_external_tokens) // self.block_size)
        try:
            table = list(blocks.get_block_ids()[0])
        except (AttributeError, IndexError, TypeError):
            table = []
        # A table vLLM's KVCacheBlocks no longer gives (the start-up check refuses such a vLLM) reports none.
        self.granted_blocks[req_id] = table[local // self.block_size : end]

    def fail_step(self) -> MaruConnectorMetadata:
        """The step's metadata when sealing it failed: no load and no store; every token vLLM
        granted this step fails (its blocks are recomputed), from what vLLM's calls said alone."""
        granted, self.granted = self.granted, {}
        blocks, self.granted_blocks = self.granted_blocks, {}
        self.broken = set()
        meta = MaruConnectorMetadata()
        self.failed_loads += len(granted)
        if self.asynchronous:
            meta.async_loads = set(granted)
            meta.async_failed = set(granted)
        else:
            meta.load_failures = [LoadFailure(req_id, blocks.get(req_id, [])) for req_id in granted]
        if granted:
            logger.error("Maru: %d requests' granted pool tokens recomputed (the step's plan failed)", len(granted))
        return meta

    def hook_failed(self, req_id: str) -> None:
        self.broken.add(req_id)

    def seal(self, meta: MaruConnectorMetadata | None, scheduler_output: SchedulerOutput) -> MaruConnectorMetadata:
        """The step's metadata with every granted block loaded or failed; None = building failed."""
        granted, self.granted = self.granted, {}
        broken, self.broken = self.broken, set()
        self.granted_blocks = {}
        if meta is None:
            meta = MaruConnectorMetadata()
            broken = set(granted)
        unasked = [ld for ld in meta.loads if ld.req_id not in granted]
        if unasked:
            logger.error(
                "Maru load plan has %d chunk loads for requests vLLM granted no external tokens; dropped", len(unasked)
            )
            meta.loads = [ld for ld in meta.loads if ld.req_id in granted]
        if self.asynchronous:
            return self._seal_async(meta, granted, broken)
        for req_id, num_computed, block_ids in _admitted(scheduler_output):
            external = granted.get(req_id, 0)
            if not external:
                continue
            first = (num_computed - external) // self.block_size
            end = -(-num_computed // self.block_size)
            expected = list(block_ids[first:end])
            planned = [b for ld in meta.loads if ld.req_id == req_id for b in ld.block_ids]
            if req_id not in broken and planned == expected:
                continue
            if req_id not in broken:
                logger.error(
                    "Maru load plan of request %s covers blocks %s, vLLM counts %s as loaded; recomputing them",
                    req_id,
                    planned,
                    expected,
                )
            meta.loads = [ld for ld in meta.loads if ld.req_id != req_id]
            meta.load_failures.append(LoadFailure(req_id, expected))
            self.failed_loads += 1
        return meta

    def _seal_async(
        self, meta: MaruConnectorMetadata, granted: dict[str, int], broken: set[str]
    ) -> MaruConnectorMetadata:
        """Every granted request gets a verdict: its planned loads, or failed without any."""
        unplanned = {r for r in granted if r not in meta.async_loads or r in broken}
        if unplanned:
            logger.error("Maru load plan misses %d requests vLLM granted pool tokens; recomputing them", len(unplanned))
            meta.loads = [ld for ld in meta.loads if ld.req_id not in unplanned]
            meta.async_loads |= unplanned
            meta.async_failed |= unplanned
            self.failed_loads += len(unplanned)
        return meta


def _admitted(scheduler_output: SchedulerOutput) -> list[tuple[str, int, list[int]]]:
    """(req_id, num_computed_tokens, block ids) of the requests admitted this step, new or resumed."""
    admitted = [(r.req_id, r.num_computed_tokens, list(r.block_ids[0])) for r in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    resumed = resumed_req_ids(cached)
    for i, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        if req_id in resumed and new_ids is not None:
            admitted.append((req_id, cached.num_computed_tokens[i], list(new_ids[0])))
    return admitted
