"""Worker side for engines served group by group: one `MaruWorkerSide` per KV cache group.

Each group's layers are copied by a worker side of their own (its namespace, its layout codec
and copier, its write-behind writer), fed the step's loads and stores of that group. What this
adds across the groups:

* **Whole-request load verdicts.** Loads are asynchronous here (`scheduler_groups`): a request
  of `async_loads` is reported finished once its loads ran, and failed as well when any load of
  any group failed (or none was planned) - vLLM then recomputes its whole prompt. Block-level
  failures are never reported: vLLM refuses them with several KV cache groups.
* **One failure, every group.** A request whose load failed in one group gets no stores in any.
* **Copies finished before blocks are reused** (`copies_to_finish`: preempted requests and the
  scheduler's sliding-window flushes), in every group's writer, since vLLM hands a block freed
  in one group to any group.
* **A finished request's blocks are released once every group's writer is done with it.**
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from maru_vllm.connector.chunks import Slice, Split
from maru_vllm.connector.kv_groups import KVGroup
from maru_vllm.connector.metadata import MaruConnectorMetadata
from maru_vllm.connector.object_format import HeadRange
from maru_vllm.connector.pool_interface import ConnectorPool
from maru_vllm.connector.sides import WorkerSide
from maru_vllm.connector.stats import TransferCounters
from maru_vllm.connector.worker import MaruWorkerSide


def _for_group(meta: MaruConnectorMetadata, group: int) -> MaruConnectorMetadata:
    """The step's metadata as one group's worker side sees it."""
    return MaruConnectorMetadata(
        loads=[ld for ld in meta.loads if ld.group == group],
        stores=[s for s in meta.stores if s.group == group],
        preempted_req_ids=meta.preempted_req_ids,
        held_for_stores=meta.held_for_stores,
        idle=meta.idle,
        flush_req_ids=meta.flush_req_ids,
    )


class GroupedWorkerSide(WorkerSide):
    """Several KV cache groups (or a sliding-window one): one `MaruWorkerSide` per group, loads
    asynchronous with one verdict per request."""

    def __init__(
        self,
        *,
        groups: list[KVGroup],
        namespaces: list[str],
        rank: int,
        pool: ConnectorPool,
        store_pool: ConnectorPool | None,
        write_behind: bool,
        block_size: int,
        num_blocks: int | None,
        use_lmcache_kernels: bool,
        enable_fused_load: bool,
        blocks_per_chunk: int,
        heads: HeadRange | None = None,
        slot: Slice | None = None,
        splits: tuple[Split, ...] = (),
    ) -> None:
        self.groups = groups
        self.pool = pool
        self.store_pool = store_pool or pool
        self.sides = [
            MaruWorkerSide(
                namespace=namespaces[g.index],
                rank=rank,
                pool=pool,
                store_pool=self.store_pool,
                write_behind=write_behind,
                blocks_per_chunk=blocks_per_chunk,
                heads=heads,
                slot=slot,
                splits=splits,
                block_size=block_size,
                num_blocks=num_blocks,
                use_lmcache_kernels=use_lmcache_kernels,
                enable_fused_load=enable_fused_load,
            )
            for g in groups
        ]
        # Asynchronous load verdicts not yet reported (get_transfer_results).
        self.loads_finished: set[str] = set()
        self.loads_failed: set[str] = set()
        # Finished requests, by the groups whose writers released them.
        self._released: dict[str, set[int]] = {}

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], backend_name: str | None, kv_layout: str | None = None
    ) -> None:
        for group, side in zip(self.groups, self.sides):
            layers = {name: kv_caches[name] for name in group.layer_names if name in kv_caches}
            if layers:
                side.register_kv_caches(layers, backend_name, kv_layout)
            # A group with no layer here keeps no codec: its loads fail and nothing is stored.

    # -- loads -----------------------------------------------------------------------------------
    def load(self, meta: MaruConnectorMetadata) -> None:
        for group, side in zip(self.groups, self.sides):
            side.load(_for_group(meta, group.index))
        self._settle(meta)

    def fail_loads(self, meta: MaruConnectorMetadata, why: str) -> None:
        for group, side in zip(self.groups, self.sides):
            side.fail_loads(_for_group(meta, group.index), why)
        self._settle(meta, failed_all=True)

    def _settle(self, meta: MaruConnectorMetadata, failed_all: bool = False) -> None:
        """Every async load of the step gets its verdict; a failed request stores in no group."""
        failed = set(meta.async_failed)
        for side in self.sides:
            failed |= side.failed_requests
            side.failed_blocks.clear()  # never reported per block (see module docstring)
        planned = {ld.req_id for ld in meta.loads}
        failed |= meta.async_loads - planned
        if failed_all:
            failed |= meta.async_loads
        for side in self.sides:
            side.failed_requests = set(failed)
        self.loads_finished |= meta.async_loads
        self.loads_failed |= meta.async_loads & failed

    def take_load_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) asynchronous loads since the last call; failed ones are in both."""
        finished, failed = self.loads_finished, self.loads_failed
        self.loads_finished, self.loads_failed = set(), set()
        return finished | failed, failed

    def take_failed_blocks(self) -> set[int]:
        for side in self.sides:
            side.take_failed_blocks()
        return set()

    def fail_unknown_loads(self, meta: MaruConnectorMetadata | None) -> set[int]:
        """Nothing to report per block: the step's requests already have their verdicts (`_settle`)."""
        for side in self.sides:
            side.failed_blocks = set()
        return set()

    # -- stores ----------------------------------------------------------------------------------
    def store(self, meta: MaruConnectorMetadata) -> None:
        for group, side in zip(self.groups, self.sides):
            side.store(_for_group(meta, group.index))

    def handle_preemptions(self, meta: MaruConnectorMetadata) -> None:
        for side in self.sides:
            side.handle_preemptions(meta)

    def finished_stores(self, finished_req_ids: set[str], meta: MaruConnectorMetadata | None) -> set[str]:
        for group, side in zip(self.groups, self.sides):
            sub = _for_group(meta, group.index) if meta is not None else None
            for req_id in side.finished_stores(finished_req_ids, sub):
                self._released.setdefault(req_id, set()).add(group.index)
        done = {r for r, released in self._released.items() if len(released) == len(self.sides)}
        for req_id in done:
            del self._released[req_id]
        return done

    # -- fallbacks -------------------------------------------------------------------------------
    def disable(self, why: str) -> None:
        for side in self.sides:
            side.disable(why)

    def quiesce(self) -> None:
        for side in self.sides:
            side.quiesce()

    def release_held(self, finished_req_ids: set[str]) -> set[str]:
        done = set()
        for side in self.sides:
            done |= side.release_held(finished_req_ids)
        done |= set(self._released)
        self._released.clear()
        return done

    def fail_load_results(self) -> tuple[set[str], set[str]]:
        pending = self.loads_finished | self.loads_failed
        self.loads_finished, self.loads_failed = set(), set()
        return pending, pending

    # -- life cycle ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        for side in self.sides:
            side.shutdown()

    def take_counters(self) -> TransferCounters | None:
        total = TransferCounters()
        for side in self.sides:
            counters = side.take_counters()
            if counters is not None:
                total.add(counters)
        return None if total.is_empty() else total
