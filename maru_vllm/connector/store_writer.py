"""Write-behind stores: a step hands its chunks over and goes on; one thread copies and commits.

Why write-behind (`benchmarks/bench_store.py` measures it; figures in docs/performance.md,
"Stores: write-behind"): a synchronous store holds the step for reserve + page copy + checksum + commit, a cost that
grows with the bytes stored. Next to a CPU prefill, which produces KV slowly, that is a small
share of a miss; next to a GPU prefill, which produces KV orders of magnitude faster, it is a
visible share. Handed to a thread, the step is held only for building the job (a cost per job,
not per byte), and the copy overlaps the next forward (GPU: the copy engine beside the compute;
CPU: the core the forward leaves idle while it waits, and after the request's last prefill step,
time after the first token went out). Per-layer stores inside the forward (`save_kv_layer`) were
not chosen: they would put one pool round trip or Python call per layer into the forward, and on
CPU they compete with the very forward they are meant to hide behind.

What keeps it correct (each is a test in tests/connector/test_write_behind.py):

* **Never visible before complete.** A job reserves space, copies every page, waits for the
  device copy to finish, and only then commits; an object is invisible to every lookup until
  its commit, and a failed copy aborts the reservation.
* **Source blocks stay alive while a copy reads them.** A request's computed prompt blocks are
  not written again while it runs, so only freeing can recycle them: when a request that had
  stores finishes (or is aborted), the scheduler side returns True from `request_finished`
  and vLLM keeps its blocks until this writer reports the request in `get_finished`, which
  happens only once none of its jobs is queued or running. A preempted request's blocks are
  freed at once by vLLM, so `handle_preemptions` (called before the next forward may overwrite
  them) waits for that request's jobs.
* **Stores of a request whose load failed never reach the pool**: they are filtered out before
  a job is built (the worker side decides; nothing changes here).
* **Ordered after the forward on a GPU**: the job carries a CUDA event recorded on the
  forward's stream; the thread copies on its own stream after that event.

The writer has its own pool connection, so a load's `acquire` never queues behind a store's
round trip or checksum on the client lock.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from maru_vllm.connector.chunks import chunk_key, with_rank
from maru_vllm.connector.copier import Copier, WholeChunk
from maru_vllm.connector.cuda_host import HostRegistry
from maru_vllm.connector.metadata import ChunkStore
from maru_vllm.connector.page_layout import LayoutError
from maru_vllm.connector.pool_interface import ConnectorPool
from maru_vllm.connector.stats import TransferCounters
from maru_vllm.pool import Reservation

logger = logging.getLogger(__name__)

# How long shutdown waits for queued stores before dropping them (they are only a cache).
SHUTDOWN_GRACE_S = 10.0


@dataclasses.dataclass
class StoreJob:
    """The stores of one step: copied, then committed together."""

    stores: list[ChunkStore]
    # Recorded on the forward's CUDA stream; the copy waits for it (None on CPU).
    source_ready: Any = None
    req_ids: frozenset[str] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.req_ids = frozenset(s.req_id for s in self.stores)


class StoreWriter:
    """Copies and commits store jobs, inline (`write_behind=False`) or on one daemon thread."""

    def __init__(
        self,
        pool: ConnectorPool,
        namespace: str,
        rank: int,
        copier: Copier,
        device: torch.device,
        *,
        write_behind: bool = True,
        host_registry: HostRegistry | None = None,
        slot: str | None = None,
    ) -> None:
        self.pool = pool
        self.namespace = namespace
        self.rank = rank
        # The name of the slice of each chunk this rank stores (chunks.Slice.name; default its rank).
        self.slot: str | int = slot if slot is not None else rank
        self.copier = copier
        self.write_behind = write_behind
        # The copy seams (tests hold and break them). `pack_many`: a job's chunks in one batched
        # pass (host caches with the fused kernel; None when the copier cannot), else `pack`, one
        # by one. Both give each payload's checksum when the copy computed it, else None.
        self.pack: Callable[[list[int], Any], int | None] = copier.pack
        self.pack_many: Callable[[Sequence[WholeChunk]], list[int | None] | None] = copier.pack_whole_many
        self.host_registry = host_registry
        self._cv = threading.Condition()
        self._queue: collections.deque[StoreJob] = collections.deque()
        self._running: StoreJob | None = None
        self._inflight: collections.Counter[str] = collections.Counter()
        self._counters = TransferCounters()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stream = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device=device)

    # -- the step's side (must stay cheap) ----------------------------------------------------
    def submit(self, stores: list[ChunkStore]) -> None:
        """Store these chunks: now (inline mode) or queued for the writer thread."""
        if not stores:
            return
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._stream.device))
        job = StoreJob(list(stores), ready)
        if not self.write_behind:
            self._write(job)
            return
        with self._cv:
            if self._closed:
                self._counters.stores_skipped += len(stores)
                return
            self._queue.append(job)
            self._inflight.update(job.req_ids)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="maru-store-writer", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def busy(self, req_ids: Iterable[str] | None = None) -> bool:
        """Whether a job of any of `req_ids` (of any request when None) is queued or running."""
        with self._cv:
            return self._busy(req_ids)

    def _busy(self, req_ids: Iterable[str] | None) -> bool:
        if req_ids is None:
            return bool(self._queue) or self._running is not None
        return any(self._inflight[r] > 0 for r in req_ids)

    def wait(self, req_ids: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until no job of `req_ids` (all jobs when None) is queued or running."""
        ids = None if req_ids is None else frozenset(req_ids)
        with self._cv:
            return self._cv.wait_for(lambda: not self._busy(ids), timeout)

    def take_counters(self) -> TransferCounters:
        with self._cv:
            counters, self._counters = self._counters, TransferCounters()
        return counters

    def close(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Finish queued jobs (up to `grace_s`), then stop the thread."""
        if not self.wait(timeout=grace_s):
            logger.warning("Maru store writer: dropping %d queued store jobs at shutdown", len(self._queue))
        with self._cv:
            self._closed = True
            for job in self._queue:
                self._counters.stores_skipped += len(job.stores)
                self._inflight.subtract(job.req_ids)
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=grace_s)

    # -- the writer thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                job = self._running = self._queue.popleft()
            try:
                self._write(job)
            except Exception:  # the writer thread must survive any one job
                logger.exception("Maru store job failed; its chunks are not stored")
                with self._cv:
                    self._counters.store_failures += len(job.stores)
            finally:
                with self._cv:
                    self._running = None
                    self._inflight.subtract(job.req_ids)
                    self._inflight += collections.Counter()  # drop zero counts
                    self._cv.notify_all()

    def _copy_batched(self, live: list[tuple[ChunkStore, Reservation]]) -> bool:
        """Copy every chunk in one batched pass where the copier has one (checksums set); False
        when it cannot: then each chunk is copied on its own, so one that cannot be copied
        fails alone (sizes and block ids are checked before the batch copies any byte)."""
        if not live:
            return True
        try:
            checksums = self.pack_many([WholeChunk(store.block_ids, res.buffer) for store, res in live])
        except (LayoutError, IndexError, RuntimeError, ValueError) as exc:
            logger.debug("batched store copy not possible (%s); copying chunk by chunk", exc)
            return False
        if checksums is None:
            return False
        for (_, res), checksum in zip(live, checksums):
            res.payload_checksum = checksum
        return True

    def _write(self, job: StoreJob) -> None:
        """Reserve, copy every page, wait for the copy, commit: visible only when complete."""
        copier = self.copier
        t0 = time.perf_counter()
        counters = TransferCounters()
        try:
            items = [(chunk_key(s.key, self.slot), copier.chunk_nbytes(len(s.block_ids))) for s in job.stores]
            reservations = self.pool.reserve(items, self.namespace)
            if reservations is None:
                counters.store_failures += len(job.stores)
                return
            if self.host_registry is not None and self.pool.region_view is not None:
                self.host_registry.ensure(self.pool.region_view)  # DMA into the region
            to_commit, metas, parts = [], [], []
            stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
            with stream_ctx:
                if job.source_ready is not None:
                    self._stream.wait_event(job.source_ready)  # type: ignore[union-attr]  # set only with a stream
                live = [(store, res) for store, res in zip(job.stores, reservations) if res is not None]
                counters.stores_skipped += len(job.stores) - len(live)  # already in the pool, or no space
                batched = self._copy_batched(live)
                for store, res in live:
                    if not batched:
                        try:
                            res.payload_checksum = self.pack(store.block_ids, res.buffer)
                        except (LayoutError, IndexError, RuntimeError, ValueError) as exc:
                            logger.warning("Maru store of a chunk failed while copying (%s); skipped", exc)
                            self.pool.abort([res])
                            counters.store_failures += 1
                            continue
                    to_commit.append(res)
                    metas.append(with_rank(store.meta, self.rank))
                    parts.append([chunk_key(h, self.slot) for h in store.parts])
                if self._stream is not None:
                    self._stream.synchronize()  # the bytes are in the region before any commit
            if not to_commit:
                return
            committed = self.pool.commit(to_commit, metas, parts)
            if committed is None:
                counters.store_failures += len(to_commit)
                return
            for ok, res in zip(committed, to_commit):
                if ok:
                    counters.chunks_stored += 1
                    counters.bytes_stored += res.size
                else:
                    counters.stores_skipped += 1
        finally:
            counters.store_seconds += time.perf_counter() - t0
            with self._cv:
                self._counters.add(counters)
