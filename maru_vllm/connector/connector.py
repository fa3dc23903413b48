"""MaruKVConnector: vLLM instances reuse each other's prefill through the Maru pool.

Load it the standard vLLM way::

    --kv-transfer-config '{"kv_connector": "MaruKVConnector",
                           "kv_connector_module_path": "maru_vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"maru_pool_address": "unix:///tmp/maru-pool.sock"}}'

`kv_both` loads and stores; `kv_producer` only stores (disaggregated prefill); `kv_consumer`
only loads (disaggregated decode). This class only adapts vLLM's hooks: the scheduler-side
policy lives in `scheduler.py`, the data movement in `worker.py`, and every hook vLLM calls
is wrapped (`_contained`) so that no exception from the connector reaches vLLM's scheduler, model
runner or metrics: a failed hook is a miss for that step and one log line with the cause.
Containment fails closed: a failed load hook reports the step's planned blocks as failed
(`load_guard.py`), so vLLM recomputes them instead of running the forward over unwritten KV; a
failed hook that guards block reuse (preemptions, finished stores) first waits until no copy
reads a block; a failed `register_kv_caches` leaves the worker off the pool. Only an error inside
such a fallback is not contained: stopping the engine beats wrong tokens.

It declares vLLM's `SupportsHMA`, so vLLM keeps its hybrid KV cache manager (sliding-window
models free the KV outside the window). An engine with several KV cache groups, or a
sliding-window one, is served group by group (`scheduler_groups.py`, `worker_groups.py`): one
namespace per group, sliding-window groups only the window's blocks, and asynchronous loads
whose failures vLLM recomputes per request (`get_transfer_results`). `engine_support.py`
decides, once, whether and how the engine is served, `serving.py` builds that path, and the
hooks below call its sides only through the interfaces of `sides.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger

from maru_vllm.connector.chunks import ChunkGeometry
from maru_vllm.connector.config import parse_config
from maru_vllm.connector.engine_support import EngineSupport, engine_support
from maru_vllm.connector.log_summary import ConnectorLogSummary
from maru_vllm.connector.logging_setup import follow_vllm_logging
from maru_vllm.connector.metadata import MaruConnectorMetadata
from maru_vllm.connector.parallel_place import ParallelPlace
from maru_vllm.connector.pool_access import PoolAccess
from maru_vllm.connector.serving import serving_path
from maru_vllm.connector.sides import SchedulerSide, WorkerSide
from maru_vllm.connector.startup import copy_path, stack_line
from maru_vllm.connector.stats import MaruConnectorStats, MaruPromMetrics, TransferCounters
from maru_vllm.connector.token_sources import TokenSources
from maru_vllm.connector.transfer import copy_format
from maru_vllm.connector.upstream_check import moved_contracts
from maru_vllm.versions import VLLM

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

T = TypeVar("T")


def _contained(default: Any, on_error: str | None = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Run a hook; on any error log it and return `default`, or what method `on_error` returns.

    Hooks on the load path name an `on_error` that fails the step's planned loads closed (see
    `load_guard`): "continue without the pool" must never mean "trust blocks nobody wrote". An
    error inside `on_error` itself is not contained: stopping the engine beats wrong tokens.
    The wrapped hook carries `__maru_contained__` (tests check that every hook has it).
    """

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def inner(self: MaruKVConnector, *args: Any, **kwargs: Any) -> T:
            try:
                return fn(self, *args, **kwargs)
            except Exception:  # containment boundary: the engine must keep serving
                self.contained_errors += 1
                logger.exception("MaruKVConnector.%s failed; continuing without the pool for this step", fn.__name__)
                if on_error is not None:
                    return getattr(self, on_error)(*args, **kwargs)
                return default() if callable(default) else default

        inner.__maru_contained__ = True  # type: ignore[attr-defined]
        return inner

    return wrap


def _contained_classmethod(default: Any) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """`_contained` for the class methods vLLM calls (stats and metrics): `default` on any error."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def inner(cls: type, *args: Any, **kwargs: Any) -> T:
            try:
                return fn(cls, *args, **kwargs)
            except Exception:  # containment boundary: vLLM's metrics must keep working
                logger.exception("MaruKVConnector.%s failed; the connector's metrics are off", fn.__name__)
                return default() if callable(default) else default

        inner.__maru_contained__ = True  # type: ignore[attr-defined]
        return inner

    return wrap


class MaruKVConnector(KVConnectorBase_V1, SupportsHMA):
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """No: the worker side keeps views of the KV cache, the copier's page tables and (CUDA)
        the registered staging region for the engine's life, and does not follow a sleep's
        unregister/restore. vLLM (0.33+) then refuses `--enable-sleep-mode` with this connector at
        start-up, in one line, instead of copying into a remapped cache."""
        return False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # vLLM builds a KV connector only from a kv_transfer_config
        block_size = int(vllm_config.cache_config.block_size)
        # Before any INFO line: ours reach the engine log only through vLLM's logging set-up.
        follow_vllm_logging(bool(vllm_config.logging_config.configure_logging))
        self.config = parse_config(transfer.kv_connector_extra_config, block_size)
        # Which copier writes (its start-up line); every copier reads every order (transfer.py).
        from vllm.platforms import current_platform

        self.copy_format = copy_format(str(current_platform.device_type), self.config.use_lmcache_kernels)
        salt = self.config.namespace
        support = engine_support(vllm_config, kv_cache_config)
        moved = moved_contracts()
        if moved:
            support = EngineSupport(
                f"vLLM {VLLM.installed()} lacks what the connector relies on ({', '.join(moved[:4])}"
                f"{', ...' if len(moved) > 4 else ''}); supported releases: {VLLM.span}"
            )
        # One KV cache group, or group by group (vLLM's hybrid KV cache manager, sliding-window
        # layers: one namespace per group, the announced group's is `self.namespace`). Chosen here, once.
        self.path = serving_path(vllm_config, kv_cache_config, salt, grouped=support.serves and support.grouped)
        self.namespace = self.path.namespace
        self.can_load = bool(transfer.is_kv_consumer) and support.serves
        self.can_store = bool(transfer.is_kv_producer) and support.serves
        if not support.serves and role == KVConnectorRole.SCHEDULER:
            logger.warning("MaruKVConnector stands aside: %s", support.reason)
        self.contained_errors = 0
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            # A pool miss discovered at load time must mean "recompute", never a failed request.
            logger.warning(
                "MaruKVConnector sets kv_load_failure_policy=recompute (was %r)", transfer.kv_load_failure_policy
            )
            transfer.kv_load_failure_policy = "recompute"
        place = ParallelPlace.of_engine(vllm_config)
        splits = place.splits()
        ranks = place.tp * place.pp
        geometry = ChunkGeometry(block_size, self.config.blocks_per_chunk, ranks, splits)
        who = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self.pool = self._pool_access(who)
        # The role's side (the other is None).
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        self.store_pool: PoolAccess | None = None  # the worker's stores' own connection
        self.load_guard = self.path.load_guard(block_size)
        self.token_sources = TokenSources(self.config.chunk_tokens, geometry.objects_per_chunk())
        pools = [self.pool]  # the links the periodic log summary reports on
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = self.path.scheduler_side(
                geometry, self.pool, can_load=self.can_load, can_store=self.can_store
            )
        else:
            # Stores get their own pool connection (loads never wait behind them) and run
            # write-behind, except on a disaggregated prefill engine (`maru_store_inline`, or
            # producer-only), whose response sends the decode engine to the pool: its chunks
            # must be there first.
            store_pool = self._pool_access("worker-store") if self.can_store else None
            if store_pool is not None:
                pools.append(store_pool)
            worker_args: dict[str, Any] = dict(
                rank=place.rank,
                slot=place.slice,
                splits=splits,
                pool=self.pool,
                store_pool=store_pool,
                write_behind=self.can_load and not self.config.store_inline,
                blocks_per_chunk=self.config.blocks_per_chunk,
                heads=place.heads,
                block_size=block_size,
                num_blocks=getattr(kv_cache_config, "num_blocks", None),
                use_lmcache_kernels=self.config.use_lmcache_kernels,
                enable_fused_load=self.config.enable_fused_load,
            )
            self.worker_side = self.path.worker_side(**worker_args)
            self.store_pool = store_pool
            if worker_args["rank"] == 0:
                level, line = stack_line(
                    copy_path(str(current_platform.device_type), self.config.use_lmcache_kernels, self.copy_format)
                )
                logger.log(level, "%s", line)
        logger.info(
            "MaruKVConnector (%s): pool %s, namespace %s, chunk %d tokens, load=%s store=%s%s",
            who,
            self.config.pool_address,
            self.namespace,
            self.config.chunk_tokens,
            self.can_load,
            self.can_store,
            self.path.describe(),
        )
        self.log_summary = ConnectorLogSummary(who, self.config.log_stats_interval_s, block_size, pools)
        self.log_summary.start()

    def _pool_access(self, who: str) -> PoolAccess:
        """A connection to the pool, made at start-up; every request it sends has the deadline."""
        c = self.config
        return PoolAccess(
            c.pool_address, c.pool_token, c.pool_deadline_s, c.checksum, who, connect_timeout_s=c.pool_timeout_s
        )

    # ==== worker side ==========================================================================
    @_contained(None, on_error="_register_failed")
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_side is not None
        self.worker_side.register_kv_caches(
            kv_caches, _backend_name(self._vllm_config, kv_caches), _kv_layout(self._vllm_config)
        )

    def _register_failed(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The worker cannot copy: it stays off the pool (planned loads fail, nothing is stored)."""
        if self.worker_side is not None:
            self.worker_side.disable("registering the KV caches failed")

    @_contained(None, on_error="_fail_step_loads")
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.worker_side is not None and isinstance(meta, MaruConnectorMetadata):
            self.worker_side.load(meta)

    def _fail_step_loads(self, *args: Any, **kwargs: Any) -> None:
        """start_load_kv failed: whatever it copied, report every planned block of the step failed."""
        meta = self._get_connector_metadata()
        if self.worker_side is not None and isinstance(meta, MaruConnectorMetadata):
            self.worker_side.fail_loads(meta, "connector error")

    @_contained(None)
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in start_load_kv, before the forward starts."""

    @_contained(None)
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Whole pages of every layer are stored after the forward (see store_writer.py for why)."""

    @_contained(None)
    def wait_for_save(self) -> None:
        if self.worker_side is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, MaruConnectorMetadata):
            self.worker_side.store(meta)

    @_contained(None, on_error="_quiesce")
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker_side is not None and isinstance(kv_connector_metadata, MaruConnectorMetadata):
            self.worker_side.handle_preemptions(kv_connector_metadata)

    def _quiesce(self, *args: Any, **kwargs: Any) -> None:
        """Which copies read freed blocks is unknown: wait until no copy reads any block."""
        if self.worker_side is not None:
            self.worker_side.quiesce()

    @_contained(lambda: (None, None), on_error="_release_held")
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker_side is None:
            return None, None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        done = self.worker_side.finished_stores(
            finished_req_ids, meta if isinstance(meta, MaruConnectorMetadata) else None
        )
        return (done or None), None

    def _release_held(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finding the stores' finished requests failed: once no copy reads a block, every held
        request vLLM finished may go (a request held for ever would leak its blocks)."""
        if self.worker_side is None:
            return None, None
        self.worker_side.quiesce()
        return (self.worker_side.release_held(finished_req_ids) or None), None

    @_contained(KVConnectorTransferResults, on_error="_fail_transfer_results")
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished stores, and (served group by group) the asynchronous loads' verdicts."""
        sending, _ = self.get_finished(finished_req_ids)
        results = KVConnectorTransferResults(finished_sending=set(sending or ()))
        if self.worker_side is not None:
            results.finished_recving, results.failed_recving = self.worker_side.take_load_results()
        return results

    def _fail_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The verdicts could not be read: every asynchronous load in flight failed (recomputed)."""
        sending, _ = self._release_held(finished_req_ids)
        results = KVConnectorTransferResults(finished_sending=set(sending or ()))
        if self.worker_side is not None:
            results.finished_recving, results.failed_recving = self.worker_side.fail_load_results()
        return results

    @_contained(set, on_error="_all_planned_blocks")
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_failed_blocks() if self.worker_side is not None else set()

    def _all_planned_blocks(self) -> set[int]:
        """Which loads failed is unknown: the worker side says which blocks vLLM recomputes (every
        block the step planned to load; none where verdicts are per request, already given)."""
        meta = self._get_connector_metadata()
        planned = meta if isinstance(meta, MaruConnectorMetadata) else None
        if self.worker_side is None:
            return planned.planned_load_blocks() if planned is not None else set()
        return self.worker_side.fail_unknown_loads(planned)

    @_contained(None)
    def get_kv_connector_stats(self) -> MaruConnectorStats | None:
        if self.worker_side is None:  # the scheduler side: where the external prompt tokens came from
            tokens = self.token_sources.take()
            if not tokens:
                return None
            return MaruConnectorStats.from_counters(
                TransferCounters(**{f"prompt_tokens_{source}": n for source, n in tokens.items()})
            )
        counters = self.worker_side.take_counters()
        if counters is None:
            return None
        self.log_summary.record_transfers(counters)
        return MaruConnectorStats.from_counters(counters)

    @_contained(None)
    def shutdown(self) -> None:
        self.log_summary.stop()
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.store_pool is not None:
            self.store_pool.close()
        self.pool.close()

    # ==== scheduler side =======================================================================
    @_contained(lambda: (0, False))
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        self.load_guard.asked(request.request_id, num_computed_tokens)
        try:
            return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)
        finally:
            self.token_sources.asked(request.request_id, num_computed_tokens, self.pool.take_tier_fetch())

    @_contained(None, on_error="_alloc_failed")
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # Recorded before anything can fail: vLLM now counts these tokens as loaded.
        self.load_guard.granted_load(request.request_id, num_external_tokens, blocks)
        self.token_sources.granted(request, num_external_tokens)
        self._plan_after_alloc(request, blocks, num_external_tokens)

    @_contained(None, on_error="_alloc_failed")
    def _plan_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        if self.can_load:
            self.log_summary.record_lookup(num_external_tokens)
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def _alloc_failed(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.load_guard.hook_failed(request.request_id)

    @_contained(None, on_error="_fail_step_plan")
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.load_guard.seal(self._build_plan(scheduler_output), scheduler_output)

    def _fail_step_plan(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Sealing the plan failed: no load, no store, and every token vLLM granted fails (recomputed)."""
        return self.load_guard.fail_step()

    @_contained(None)
    def _build_plan(self, scheduler_output: SchedulerOutput) -> MaruConnectorMetadata | None:
        """The scheduler side's plan, or None when building it failed (the guard fails its loads)."""
        assert self.scheduler_side is not None
        return self.scheduler_side.build_connector_meta(scheduler_output)

    @_contained(None, on_error="_forget_request")
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # True: a write-behind store may still read the blocks; the worker reports them in get_finished.
        self.load_guard.forget(request.request_id)
        self.token_sources.forget(request.request_id)
        if self.scheduler_side is None:
            return False, None
        return bool(self.scheduler_side.request_finished(request)), None

    @_contained(None, on_error="_forget_request_all_groups")
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager: the request finished in every group (`request_finished`)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def _forget_request_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._forget_request(request, [])

    def _forget_request(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """request_finished failed: still drop the request's state (it must not outlive the request),
        and still hold its blocks if a write-behind store may read them."""
        if self.scheduler_side is None:
            return False, None
        return self.scheduler_side.forget_request(request), None

    @property
    def requires_kv_delivery(self) -> bool:
        # The pool is a best-effort cache: a dropped store is just a future miss.
        return False

    # ==== stats ================================================================================
    @classmethod
    @_contained_classmethod(None)
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> MaruConnectorStats | None:
        return MaruConnectorStats(data) if data is not None else MaruConnectorStats()

    @classmethod
    @_contained_classmethod(None)
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> MaruPromMetrics | None:
        return MaruPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _kv_layout(vllm_config: Any) -> str | None:
    """vLLM's resolved KV cache layout (a ``KVCacheLayout`` name), or None before it resolves one."""
    try:
        return str(vllm_config.cache_config.get_resolved_kv_cache_layout().name)
    except (AttributeError, ValueError):
        return None


def _backend_name(vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> str | None:
    """Name of the attention backend of the first KV layer (helps the layout codec)."""
    layers = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    for name in kv_caches:
        backend = getattr(layers.get(name), "attn_backend", None)
        if backend is not None and hasattr(backend, "get_name"):
            return str(backend.get_name())
    return None
