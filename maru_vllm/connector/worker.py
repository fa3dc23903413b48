"""Worker side of MaruKVConnector: the data plane between the paged KV cache and the pool.

Loads: in `start_load_kv`, before the forward, one `acquire` round trip pins every chunk of the
step and checks each object's header (a second one, `acquire_parts`, pins the chunks a request
shares only in part: found by the hash of their last shared block, of which only the leading
blocks are copied). Each pinned object is copied page by page into its blocks - its payload
checksum computed tile by tile right after each tile is copied, while the bytes are still in
cache - and one `release` request unpins them, its reply read before the next pool request's
instead of in the step's critical path. A chunk that is missing, fails validation, has the
wrong size or the wrong checksum is a miss: its blocks are reported through vLLM's load-error
path and recomputed (a corrupt object is also dropped from the pool). Nothing raises into the
forward.

Stores: in `wait_for_save`, after the step's forward, the chunks the step completed are handed
to the `StoreWriter` (store_writer.py, which says why and how it stays correct): its thread
reserves space, copies the pages straight into the shared region and commits them, while the
step returns. vLLM keeps a finished request's blocks until `finished_stores` reports it (the
scheduler side returned True from `request_finished`), and `handle_preemptions` waits for a
preempted request's copies. A producer-only engine (disaggregated prefill) stores inline: its
response is what sends the decode engine to the pool, so the chunks must be there first. A
store that fails is skipped and counted; the request is unaffected.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping

import torch
from vllm.logger import init_logger

from maru_vllm.connector.chunks import Slice, Split, rank_split
from maru_vllm.connector.copier import Copier, WholeChunk
from maru_vllm.connector.cpu_amx import request_amx_permission
from maru_vllm.connector.cuda_host import HostRegistry
from maru_vllm.connector.kernels import resolve_fused_load, resolve_lmcache_kernels
from maru_vllm.connector.layouts import KVCacheSet
from maru_vllm.connector.metadata import ChunkLoad, MaruConnectorMetadata
from maru_vllm.connector.object_format import HeadRange
from maru_vllm.connector.page_layout import LayoutError
from maru_vllm.connector.pool_interface import ConnectorPool
from maru_vllm.connector.sides import WorkerSide
from maru_vllm.connector.slice_pins import SlicePins, flat_pins, load_keys
from maru_vllm.connector.stats import TransferCounters
from maru_vllm.connector.store_writer import StoreWriter
from maru_vllm.connector.transfer import make_copier
from maru_vllm.pool import PartPin, ReadPin
from maru_vllm.pool.objects import checksum_from_digest, checksum_of, payload_hasher

logger = init_logger(__name__)

# On a step that computes nothing, how long to wait for held requests' copies instead of
# letting the engine spin through empty steps against the copy.
IDLE_WAIT_S = 1.0


class MaruWorkerSide(WorkerSide):
    """One KV cache group's data plane; served alone, loads are synchronous and fail per block."""

    def __init__(
        self,
        *,
        namespace: str,
        rank: int,
        pool: ConnectorPool,
        block_size: int,
        num_blocks: int | None,
        use_lmcache_kernels: bool,
        enable_fused_load: bool,
        store_pool: ConnectorPool | None = None,
        write_behind: bool = True,
        blocks_per_chunk: int = 1,
        heads: HeadRange | None = None,
        slot: Slice | None = None,
        splits: tuple[Split, ...] = (),
    ) -> None:
        self.namespace = namespace
        self.rank = rank
        # The slice of every chunk this rank stores, and the splits its loads may name (chunks.py).
        self.slot = slot if slot is not None else Slice(0, 0, 0, rank)
        self.splits = splits or (rank_split(1),)
        self.pool = pool
        # Stores use their own connection when given one, so loads never queue behind them.
        self.store_pool = store_pool or pool
        self.write_behind = write_behind
        self.writer: StoreWriter | None = None
        # Finished requests whose blocks vLLM holds for our stores: announced by the scheduler
        # side (`held_for_stores`) and seen in `finished_req_ids`; reported once copied.
        self._held_announced: set[str] = set()
        self._held_finished: set[str] = set()
        # The last steps' finished ids, should an announcement come a step late.
        self._recent_finished: collections.deque[set[str]] = collections.deque(maxlen=8)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.codec: KVCacheSet | None = None
        self.blocks_per_chunk = blocks_per_chunk
        # The KV heads this rank's pages hold, stated in every object it writes (object_format.py).
        self.heads = heads if heads is not None else HeadRange(0, 0, 0)
        self.copier: Copier | None = None
        self.host_registry: HostRegistry | None = None
        self.kernels = resolve_lmcache_kernels(use_lmcache_kernels)
        self.fused_load = resolve_fused_load(enable_fused_load, self.kernels)
        self.failed_blocks: set[int] = set()
        # Requests whose load failed this step: the forward computed their later chunks on top of
        # missing KV, so this step's stores for them must not reach the pool (the scheduler
        # re-plans them once vLLM has recomputed).
        self.failed_requests: set[str] = set()
        self.counters = TransferCounters()

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], backend_name: str | None, kv_layout: str | None = None
    ) -> None:
        if next(iter(kv_caches.values())).device.type == "cpu":
            request_amx_permission()  # see cpu_amx: loads can make attention the first AMX user
        try:
            self.codec = KVCacheSet(kv_caches, self.block_size, num_blocks=self.num_blocks, backend_name=backend_name)
        except LayoutError as exc:
            # An unsupported KV layout must not take the engine down: serve without the pool.
            logger.error(
                "Maru connector disabled on this worker: unsupported KV cache layout (%s); every "
                "planned load is recomputed and nothing is stored",
                exc,
            )
            return
        codec = self.codec
        object_format = codec.use_format(self.heads)
        try:
            copier = make_copier(
                codec,
                kv_caches,
                self.kernels,
                block_size=self.block_size,
                num_blocks=codec.num_blocks,
                blocks_per_chunk=self.blocks_per_chunk,
                kv_layout=kv_layout,
            )
        except (ImportError, ValueError, RuntimeError, AttributeError, TypeError) as exc:
            logger.error(
                "Maru connector disabled on this worker: LMCache's kernel cannot copy this KV layout "
                "(%s); set maru_use_lmcache_kernels=false to use the torch path",
                exc,
            )
            self.codec = None
            return
        if self.fused_load and not copier.fuses_loads:
            logger.warning(
                "maru_enable_fused_load needs LMCache's block kernel on a CUDA KV cache; loading "
                "chunk by chunk with %s copies",
                copier.name,
            )
            self.fused_load = False
        self.copier = copier
        if codec.device.type == "cuda":
            self.host_registry = HostRegistry()
        self.writer = StoreWriter(
            self.store_pool,
            self.namespace,
            self.rank,
            copier,
            codec.device,
            write_behind=self.write_behind,
            host_registry=self.host_registry,
            slot=self.slot.name,
        )
        logger.info(
            "Maru connector: %d KV layers (%d unique), %d bytes per block, layout %s, copies %s (%s objects%s), "
            "fused load %s, stores %s",
            len(codec.layer_names),
            len(codec.unique_layers),
            codec.bytes_per_block,
            codec.layout_signature(),
            copier.name,
            copier.format,
            f", format {(copier.object_format or object_format).describe()}",
            self.fused_load,
            "write-behind" if self.write_behind else "inline",
        )

    # -- loads -----------------------------------------------------------------------------------
    def load(self, meta: MaruConnectorMetadata) -> None:
        for failure in meta.load_failures:  # granted by vLLM, but the scheduler side could not plan them
            self.failed_blocks.update(failure.block_ids)
            self.failed_requests.add(failure.req_id)
        if not meta.loads:
            return
        copier = self.copier
        if self.codec is None or copier is None:
            self.fail_loads(meta, "KV caches not registered")
            return
        t0 = time.perf_counter()
        # Headers are checked in acquire; payloads are verified as they are copied (_load_one).
        pins = self._acquire(meta.loads)
        t1 = time.perf_counter()
        self.counters.load_acquire_seconds += t1 - t0
        if pins is None:
            self.fail_loads(meta, "pool unavailable")
            return
        loaded_bytes = 0
        bad: list[ReadPin] = []
        try:
            if self.host_registry is not None and self.pool.region_view is not None:
                self.host_registry.ensure(self.pool.region_view)  # DMA from the region
            if self.fused_load:
                loaded_bytes = self._load_fused(meta, pins, bad)
            else:
                loaded_bytes = self._load_batched(meta, pins, bad)
        finally:
            copier.finish()  # an asynchronous kernel must have read the objects before they are unpinned
            t2 = time.perf_counter()
            # The reply is not waited for (it is read before the next pool request's): the
            # service unpins while the forward runs. A corrupt object's report is waited for.
            self.pool.release(flat_pins(pins), bad=bad, wait=bool(bad))
            t3 = time.perf_counter()
            self.counters.load_copy_seconds += t2 - t1
            self.counters.load_release_seconds += t3 - t2
            self.counters.bytes_loaded += loaded_bytes
            self.counters.load_seconds += t3 - t0

    def _load_one(self, load: ChunkLoad, pin: ReadPin | SlicePins | None, bad: list[ReadPin]) -> int:
        """Copy one pinned chunk (or its leading blocks) into its blocks, verifying its checksum on
        the way; the bytes copied, 0 on a miss (a corrupt object is added to `bad`)."""
        assert self.copier is not None
        if isinstance(pin, SlicePins):
            return self._load_slices(load, pin, bad)
        if pin is None:
            self._fail(load, "missing or invalid in the pool")
            return 0
        if isinstance(pin, PartPin) and pin.units != load.skip_blocks + len(load.block_ids):
            self._fail(
                load,
                f"its part key names {pin.units} blocks of the chunk, not {load.skip_blocks + len(load.block_ids)}",
            )
            return 0
        hasher = payload_hasher() if pin.checksum is not None and not pin.payload_verified else None
        try:
            self.copier.unpack(
                load.block_ids,
                pin.data,
                skip_blocks=load.skip_blocks,
                chunk_blocks=load.chunk_blocks or None,
                hasher=hasher,
            )
        except (LayoutError, IndexError, RuntimeError, ValueError) as exc:
            self._fail(load, f"cannot be copied in: {exc}")
            return 0
        if hasher is not None and checksum_of(hasher) != pin.checksum:
            self._corrupt(load, pin, bad)
            return 0
        return self._loaded(load)

    def _load_slices(self, load: ChunkLoad, slices: SlicePins, bad: list[ReadPin]) -> int:
        """A chunk stored by writers that split the KV heads finer: each object verified, then
        this rank's heads assembled from them."""
        assert self.copier is not None
        if not slices.complete:
            self._fail(load, "a slice of it is missing or invalid in the pool")
            return 0
        pins = [p for p in slices.pins if p is not None]
        for pin in pins:
            if not pin.verify():
                self._corrupt(load, pin, bad)
                return 0
        try:
            self.copier.unpack_heads(load.block_ids, [p.data for p in pins], skip_blocks=load.skip_blocks)
        except (LayoutError, IndexError, RuntimeError, ValueError) as exc:
            self._fail(load, f"cannot be copied in: {exc}")
            return 0
        return self._loaded(load)

    def _loaded(self, load: ChunkLoad) -> int:
        """Count a chunk whose blocks now hold its bytes; the bytes it brought."""
        assert self.copier is not None
        self.counters.chunks_loaded += 1
        self.counters.blocks_loaded += len(load.block_ids)
        return self.copier.chunk_nbytes(len(load.block_ids))

    def _corrupt(self, load: ChunkLoad, pin: ReadPin, bad: list[ReadPin]) -> None:
        """The chunk's payload does not match its checksum: its blocks are reported (vLLM
        recomputes them before any later step reads them) and the object is dropped."""
        bad.append(pin)
        self._fail(load, "payload checksum mismatch")

    def _load_batched(
        self, meta: MaruConnectorMetadata, pins: list[ReadPin | SlicePins | None], bad: list[ReadPin]
    ) -> int:
        """The step's whole chunks in one batched kernel pass where the copier has one (host
        caches with the fused kernel), each verified by the digest its copy computed; chunks
        shared in part, misses, and every chunk when the batch cannot run go one by one."""
        assert self.copier is not None
        loads = meta.loads
        whole: list[int] = []
        items: list[WholeChunk] = []
        for i, (load, pin) in enumerate(zip(loads, pins)):
            own_whole = not load.chunk_blocks and not load.split
            if own_whole and pin is not None and not isinstance(pin, (PartPin, SlicePins)):
                whole.append(i)
                hashed = pin.checksum is not None and not pin.payload_verified
                items.append(WholeChunk(load.block_ids, pin.data, load.skip_blocks, hashed))
        digests = None
        if items:
            try:
                digests = self.copier.unpack_whole_many(items)
            except (LayoutError, IndexError, RuntimeError, ValueError) as exc:
                # Checked before any copy: each chunk gets its own verdict one by one.
                logger.debug("batched load not possible (%s); loading chunk by chunk", exc)
        if digests is None:
            return sum(self._load_one(load, pin, bad) for load, pin in zip(loads, pins))
        batched = set(whole)
        loaded = sum(self._load_one(loads[i], pins[i], bad) for i in range(len(loads)) if i not in batched)
        for i, item, digest in zip(whole, items, digests):
            load, pin = loads[i], pins[i]
            assert isinstance(pin, ReadPin)  # only single pins are batched
            if item.hashed and not self._digest_matches(pin, digest):
                self._corrupt(load, pin, bad)
                continue
            loaded += self._loaded(load)
        return loaded

    @staticmethod
    def _digest_matches(pin: ReadPin, digest: int | None) -> bool:
        """The copy's digest against the header's checksum (a payload too short for the kernel's
        hash is verified on its own)."""
        return pin.verify() if digest is None else checksum_from_digest(digest) == pin.checksum

    def _load_fused(self, meta: MaruConnectorMetadata, pins: list, bad: list[ReadPin]) -> int:
        """`maru_enable_fused_load`: every whole chunk of the step in as few kernel launches as possible
        (misses and chunks shared in part go one by one; payloads are verified before the launch)."""
        assert self.copier is not None
        loaded = 0
        present = []
        for load, pin in zip(meta.loads, pins):
            if pin is None or isinstance(pin, (PartPin, SlicePins)) or load.split:
                loaded += self._load_one(load, pin, bad)
            elif not pin.verify():
                self._corrupt(load, pin, bad)
            else:
                present.append((load, pin))
        if not present:
            return loaded
        try:
            self.copier.unpack_many([(load.block_ids, pin.data, load.skip_blocks) for load, pin in present])
        except (LayoutError, IndexError, RuntimeError, ValueError) as exc:
            for load, _ in present:
                self._fail(load, f"cannot be copied in: {exc}")
            return loaded
        return loaded + sum(self._loaded(load) for load, _ in present)

    def _acquire(self, loads: list[ChunkLoad]) -> list[ReadPin | SlicePins | None] | None:
        """Pin every chunk of the step (headers checked, payloads not yet): whole chunks by key
        (the several slices of a chunk stored at a finer TP split as one `SlicePins`), chunks
        shared in part by part key."""
        keys = [load_keys(load, self.slot, self.splits) for load in loads]
        whole = [i for i, load in enumerate(loads) if not load.chunk_blocks and keys[i]]
        parts = [i for i, load in enumerate(loads) if load.chunk_blocks]
        pins: list[ReadPin | SlicePins | None] = [None] * len(loads)
        if whole:
            flat = [k for i in whole for k in keys[i]]
            got = self.pool.acquire(flat, self.namespace, verify_payload=False)
            if got is None:
                return None
            at = 0
            for i in whole:
                mine, at = got[at : at + len(keys[i])], at + len(keys[i])
                pins[i] = mine[0] if len(mine) == 1 else SlicePins(list(mine))
        if parts:
            got_parts = self.pool.acquire_parts([keys[i][0] for i in parts], self.namespace, verify_payload=False)
            if got_parts is None:
                self.pool.release(flat_pins(pins))
                return None
            for i, pin in zip(parts, got_parts):
                pins[i] = pin
        return pins

    def _fail(self, load: ChunkLoad, why: str) -> None:
        self.failed_blocks.update(load.block_ids)
        self.failed_requests.add(load.req_id)
        self.counters.load_failures += 1
        logger.warning("Maru chunk load failed (%s): %d blocks will be recomputed", why, len(load.block_ids))

    def fail_loads(self, meta: MaruConnectorMetadata, why: str) -> None:
        """Report every load of the step failed, whatever was copied, and drop those requests' stores."""
        self.failed_blocks |= meta.planned_load_blocks()
        self.failed_requests.update(ld.req_id for ld in meta.loads)
        self.failed_requests.update(f.req_id for f in meta.load_failures)
        self.counters.load_failures += len(meta.loads)
        logger.warning("Maru loads of this step failed (%s): %d chunks will be recomputed", why, len(meta.loads))

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    def take_load_results(self) -> tuple[set[str], set[str]]:
        """Loads are synchronous here: they end in `load`, failures go through `take_failed_blocks`."""
        return set(), set()

    def fail_unknown_loads(self, meta: MaruConnectorMetadata | None) -> set[int]:
        self.failed_blocks = set()
        return meta.planned_load_blocks() if meta is not None else set()

    # -- stores ----------------------------------------------------------------------------------
    def store(self, meta: MaruConnectorMetadata) -> None:
        """Hand this step's completed chunks to the writer (after the forward, in wait_for_save)."""
        failed, self.failed_requests = self.failed_requests, set()
        stores = [s for s in meta.stores if s.req_id not in failed]
        self.counters.stores_skipped += len(meta.stores) - len(stores)
        if not stores or self.writer is None:
            return
        t0 = time.perf_counter()
        self.writer.submit(stores)
        self.counters.store_hold_seconds += time.perf_counter() - t0

    def handle_preemptions(self, meta: MaruConnectorMetadata) -> None:
        """vLLM freed blocks that copies of `meta.copies_to_finish()` may still read (preempted
        requests, sliding-window blocks handed out again): finish those copies before the step
        writes any block."""
        waiting = meta.copies_to_finish()
        if not waiting or self.writer is None:
            return
        t0 = time.perf_counter()
        self.writer.wait(waiting)
        self.counters.store_hold_seconds += time.perf_counter() - t0

    def finished_stores(self, finished_req_ids: set[str], meta: MaruConnectorMetadata | None) -> set[str]:
        """Requests whose held blocks vLLM may free now: finished, announced, no copy pending."""
        if finished_req_ids:
            self._recent_finished.append(set(finished_req_ids))
        if meta is not None and meta.held_for_stores:
            self._held_announced |= meta.held_for_stores
        for recent in self._recent_finished:
            self._held_finished |= recent & self._held_announced
        waiting = self._held_finished
        if not waiting:
            return set()
        if self.writer is not None and meta is not None and meta.idle and self.writer.busy(waiting):
            # The engine steps only to collect these: wait here rather than spin against the copy.
            t0 = time.perf_counter()
            self.writer.wait(waiting, timeout=IDLE_WAIT_S)
            self.counters.store_hold_seconds += time.perf_counter() - t0
        done = {r for r in waiting if self.writer is None or not self.writer.busy((r,))}
        self._held_finished -= done
        self._held_announced -= done
        return done

    def disable(self, why: str) -> None:
        logger.error("Maru connector disabled on this worker (%s): every planned load is recomputed", why)
        self.codec = None
        self.copier = None
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()

    def quiesce(self) -> None:
        if self.writer is not None:
            self.writer.wait()

    def release_held(self, finished_req_ids: set[str]) -> set[str]:
        self._recent_finished.append(set(finished_req_ids))
        finished = set().union(*self._recent_finished)
        done = self._held_finished | (finished & self._held_announced)
        self._held_finished -= done
        self._held_announced -= done
        return done

    def fail_load_results(self) -> tuple[set[str], set[str]]:
        return set(), set()

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.host_registry is not None:
            self.host_registry.close()

    def take_counters(self) -> TransferCounters | None:
        counters, self.counters = self.counters, TransferCounters()
        if self.writer is not None:
            counters.add(self.writer.take_counters())
        return None if counters.is_empty() else counters
