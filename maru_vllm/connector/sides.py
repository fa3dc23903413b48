"""The connector's two halves as `MaruKVConnector` drives them: `SchedulerSide` and `WorkerSide`.

vLLM builds one connector per role: the scheduler process's runs a `SchedulerSide` (what to load
and store, per step), each worker's a `WorkerSide` (the copies between its paged KV cache and the
pool). `serving.py` picks the implementations once per engine, and `connector.py` only calls
these methods, whichever were picked:

* one KV cache group (`scheduler.MaruSchedulerSide`, `worker.MaruWorkerSide`): loads run
  synchronously before the forward, and a failed load is reported block by block;
* several groups, or a sliding-window one (`scheduler_groups.GroupedSchedulerSide`, which extends
  the one-group bookkeeping; `worker_groups.GroupedWorkerSide`, one `MaruWorkerSide` per group):
  loads are asynchronous and a failed one fails its whole request.

Failure contract. The connector wraps every hook, so a method here may raise; what it must never
do is leave vLLM trusting KV nobody wrote. Every block vLLM counts as loaded is either written
by `load` or reported failed (`take_failed_blocks` with one group, `take_load_results` with
several); when a worker hook raised and which loads failed is unknown, the connector asks
`fail_unknown_loads` for the blocks to recompute. Stores are a best-effort cache: a failed
store is skipped and counted, never reported to vLLM.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from maru_vllm.connector.metadata import MaruConnectorMetadata
    from maru_vllm.connector.stats import TransferCounters


class SchedulerSide(ABC):
    """Plans each step's loads and stores in the scheduler process (no pool data moves here)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens beyond `num_computed_tokens` the pool can supply, and whether they load
        asynchronously; None: ask again next step (the pool is bringing them in)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM admitted `request` with its blocks, counting `num_external_tokens` as loaded."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MaruConnectorMetadata:
        """The step's loads and stores (the connector's load guard checks the loads)."""

    @abstractmethod
    def request_finished(self, request: Request) -> bool:
        """Forget the request; True when vLLM must keep its blocks until the worker's stores are done."""

    @abstractmethod
    def forget_request(self, request: Request) -> bool:
        """`request_finished` raised: still drop what must not outlive the request, and still
        answer True if a store may read its blocks."""


class WorkerSide(ABC):
    """Moves KV between one worker's paged cache and the pool, as the step's metadata says."""

    @abstractmethod
    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], backend_name: str | None, kv_layout: str | None = None
    ) -> None:
        """Learn the caches' layout. An unsupported one leaves the side without a copier: every
        planned load then fails (recomputed) and nothing is stored; the engine keeps serving.

        ``kv_layout`` is vLLM's resolved KV cache layout (a ``KVCacheLayout`` name such as
        ``LBNHC``), or None where vLLM has not resolved one; LMCache's block kernel reads the
        pages by it (heads and block tokens are indistinguishable from the shape alone)."""

    @abstractmethod
    def load(self, meta: MaruConnectorMetadata) -> None:
        """Copy the step's planned loads into their blocks before the forward; a chunk that cannot
        be loaded is recorded failed, never raised."""

    @abstractmethod
    def fail_loads(self, meta: MaruConnectorMetadata, why: str) -> None:
        """Record every load of the step failed, whatever was copied (`load` raised)."""

    @abstractmethod
    def take_failed_blocks(self) -> set[int]:
        """Blocks whose loads failed since the last call (vLLM recomputes them); always empty
        where verdicts are per request."""

    @abstractmethod
    def take_load_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) asynchronous loads since the last call, failed ones in both; always
        empty where loads are synchronous."""

    @abstractmethod
    def fail_unknown_loads(self, meta: MaruConnectorMetadata | None) -> set[int]:
        """Reporting the failed loads raised, so which failed is unknown: drop the verdicts taken
        so far and return the blocks vLLM must recompute (every block `meta` plans to load where
        verdicts are per block; none where they are per request)."""

    @abstractmethod
    def store(self, meta: MaruConnectorMetadata) -> None:
        """Hand the step's completed chunks to the store writer (after the forward)."""

    @abstractmethod
    def handle_preemptions(self, meta: MaruConnectorMetadata) -> None:
        """Finish the copies that may still read blocks vLLM freed, before the step writes any."""

    @abstractmethod
    def finished_stores(self, finished_req_ids: set[str], meta: MaruConnectorMetadata | None) -> set[str]:
        """Finished requests whose held blocks vLLM may free now (no copy reads them any more)."""

    # -- fallbacks of the connector's contained hooks (they must not fail themselves) -----------
    @abstractmethod
    def disable(self, why: str) -> None:
        """Leave the pool for good on this worker: every planned load fails, nothing is stored."""

    @abstractmethod
    def quiesce(self) -> None:
        """Wait until no store copy reads any block (which copies read freed blocks is unknown)."""

    @abstractmethod
    def release_held(self, finished_req_ids: set[str]) -> set[str]:
        """After `quiesce`: every request held for stores that vLLM finished, now or before."""

    @abstractmethod
    def fail_load_results(self) -> tuple[set[str], set[str]]:
        """Like `take_load_results`, but every asynchronous load in flight failed."""

    @abstractmethod
    def take_counters(self) -> TransferCounters | None:
        """The transfer counters since the last call; None when nothing happened."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the store writers; the pool connections belong to the caller."""
