"""Worker side of MaruKVConnector: the data plane between the paged KV cache and the pool.

Loads: in `start_load_kv`, before the forward, one `acquire` round trip pins every chunk of the
step, each pinned object is copied page by page into its blocks, and the pins are released. A
chunk that is missing, fails validation or has the wrong size is a miss: its blocks are
reported through vLLM's load-error path and recomputed. Nothing raises into the forward.

Stores: in `wait_for_save`, after the step's forward, one `reserve` round trip gets space for
every chunk the step completed, the pages are copied straight into the shared region, and one
`commit` round trip publishes them with their metadata. The copy is synchronous on purpose:
the blocks cannot be freed or reused while the step is still in `wait_for_save`, so no
block-holding protocol (`request_finished` / `get_finished`) is needed, and on CPU a background
copy would compete with the next forward for the same pinned core. A store that fails is
skipped and counted; the request is unaffected.
"""

from __future__ import annotations

from vllm.logger import init_logger
import time
from collections.abc import Mapping
from typing import Any

import torch

from maru_vllm.connector.chunks import chunk_key, with_rank
from maru_vllm.connector.cpu_amx import request_amx_permission
from maru_vllm.connector.kernels import resolve_fused_load, resolve_lmcache_kernels
from maru_vllm.connector.layouts import KVCacheSet, LayoutError
from maru_vllm.connector.metadata import ChunkLoad, MaruConnectorMetadata
from maru_vllm.connector.pool_access import PoolAccess
from maru_vllm.connector.stats import TransferCounters

logger = init_logger(__name__)


class MaruWorkerSide:
    def __init__(
        self,
        *,
        namespace: str,
        rank: int,
        pool: PoolAccess,
        block_size: int,
        num_blocks: int | None,
        use_lmcache_kernels: bool,
        enable_fused_load: bool,
    ) -> None:
        self.namespace = namespace
        self.rank = rank
        self.pool = pool
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.codec: KVCacheSet | None = None
        self.kernels = resolve_lmcache_kernels(use_lmcache_kernels)
        self.fused_load = resolve_fused_load(enable_fused_load, self.kernels)
        self.failed_blocks: set[int] = set()
        # Requests whose load failed this step: the forward computed their later chunks on top of
        # missing KV, so this step's stores for them must not reach the pool (the scheduler
        # re-plans them once vLLM has recomputed).
        self.failed_requests: set[str] = set()
        self.counters = TransferCounters()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], backend_name: str | None) -> None:
        if next(iter(kv_caches.values())).device.type == "cpu":
            request_amx_permission()  # see cpu_amx: loads can make attention the first AMX user
        try:
            self.codec = KVCacheSet(kv_caches, self.block_size, num_blocks=self.num_blocks,
                                    backend_name=backend_name)
        except LayoutError as exc:
            # An unsupported KV layout must not take the engine down: serve without the pool.
            logger.error("Maru connector disabled on this worker: unsupported KV cache layout (%s); every "
                         "planned load is recomputed and nothing is stored", exc)
            return
        logger.info(
            "Maru connector: %d KV layers (%d unique), %d bytes per block, layout %s, kernels %s",
            len(self.codec.layer_names), len(self.codec.unique_layers), self.codec.bytes_per_block,
            self.codec.layout_signature(), self.kernels.source if self.kernels else "torch",
        )

    # -- loads -----------------------------------------------------------------------------------
    def load(self, meta: MaruConnectorMetadata) -> None:
        if not meta.loads:
            return
        codec = self.codec
        if codec is None:
            self._fail_all(meta, "KV caches not registered")
            return
        t0 = time.perf_counter()
        keys = [chunk_key(load.key, self.rank) for load in meta.loads]
        pins = self.pool.call("acquire", lambda c: c.acquire(keys, self.namespace))
        if pins is None:
            self._fail_all(meta, "pool unavailable")
            return
        loaded_bytes = 0
        try:
            for load, pin in zip(meta.loads, pins):
                if pin is None:
                    self._fail(load, "missing or invalid in the pool")
                    continue
                try:
                    codec.unpack(load.block_ids, pin.data, skip_blocks=load.skip_blocks)
                    loaded_bytes += codec.chunk_nbytes(len(load.block_ids))
                    self.counters.chunks_loaded += 1
                except (LayoutError, IndexError, RuntimeError, ValueError) as exc:
                    self._fail(load, f"cannot be copied in: {exc}")
        finally:
            self.pool.call("release", lambda c: c.release(pins))
        self.counters.bytes_loaded += loaded_bytes
        self.counters.load_seconds += time.perf_counter() - t0

    def _fail(self, load: ChunkLoad, why: str) -> None:
        self.failed_blocks.update(load.block_ids)
        self.failed_requests.add(load.req_id)
        self.counters.load_failures += 1
        logger.warning("Maru chunk load failed (%s): %d blocks will be recomputed", why, len(load.block_ids))

    def _fail_all(self, meta: MaruConnectorMetadata, why: str) -> None:
        for load in meta.loads:
            self.failed_blocks.update(load.block_ids)
            self.failed_requests.add(load.req_id)
        self.counters.load_failures += len(meta.loads)
        logger.warning("Maru loads of this step failed (%s): %d chunks will be recomputed", why, len(meta.loads))

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    # -- stores ----------------------------------------------------------------------------------
    def store(self, meta: MaruConnectorMetadata) -> None:
        failed, self.failed_requests = self.failed_requests, set()
        stores = [s for s in meta.stores if s.req_id not in failed]
        self.counters.stores_skipped += len(meta.stores) - len(stores)
        if not stores or self.codec is None:
            return
        codec = self.codec
        t0 = time.perf_counter()
        items = [(chunk_key(s.key, self.rank), codec.chunk_nbytes(len(s.block_ids))) for s in stores]
        reservations = self.pool.call("reserve", lambda c: c.reserve(items, self.namespace))
        if reservations is None:
            self.counters.store_failures += len(stores)
            return
        to_commit, metas = [], []
        for store, res in zip(stores, reservations):
            if res is None:
                self.counters.stores_skipped += 1  # already in the pool, or no space
                continue
            try:
                codec.pack(store.block_ids, res.buffer)
            except (LayoutError, IndexError, RuntimeError, ValueError) as exc:
                logger.warning("Maru store of a chunk failed while copying (%s); skipped", exc)
                self.pool.call("abort", lambda c, r=res: c.abort([r]))
                self.counters.store_failures += 1
                continue
            to_commit.append(res)
            metas.append(with_rank(store.meta, self.rank))
        if not to_commit:
            return
        committed = self.pool.call("commit", lambda c: c.commit(to_commit, metas))
        if committed is None:
            self.counters.store_failures += len(to_commit)
            return
        for ok, res in zip(committed, to_commit):
            if ok:
                self.counters.chunks_stored += 1
                self.counters.bytes_stored += res.size
            else:
                self.counters.stores_skipped += 1
        self.counters.store_seconds += time.perf_counter() - t0

    def take_counters(self) -> TransferCounters | None:
        if self.counters.is_empty():
            return None
        counters, self.counters = self.counters, TransferCounters()
        return counters

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "namespace": self.namespace, "fused_load": self.fused_load}
