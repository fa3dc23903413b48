"""TEST ONLY: MaruKVConnector with failures injected into its hooks, for the fail-closed e2e test.

Loaded by an engine with `"kv_connector": "FaultyMaruKVConnector",
"kv_connector_module_path": "tests.e2e.faulty_connector"` (the engine needs the repository on
PYTHONPATH) and `"test_fault_file": PATH` in kv_connector_extra_config. Each hook reads PATH
when it runs: while the file names the hook, the hook fails the way a bug in the connector
would - an exception raised inside the connector's own code, below its containment wrapper - so
the test exercises the product's error handling unchanged. Never used outside tests.

Hooks and what the fault does:
  get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta, request_finished
      the scheduler side's method raises.
  build_connector_meta.seal
                          the load guard's seal of the step's plan raises (after the plan was built).
  start_load_kv           the worker side's load raises before copying anything.
  get_block_ids_with_load_errors
                          every load of the step misses (as if evicted: the worker records the
                          blocks failed), then reading the failed blocks raises.
  wait_for_save           the worker side's store raises.
  handle_preemptions, get_finished, get_transfer_results, get_kv_connector_stats
                          the worker side's method behind the hook raises (handle_preemptions,
                          finished_stores, take_load_results, take_counters).
  register_kv_caches, build_prom_metrics (START_HOOKS: they run once, at engine start)
                          the worker side's registration raises; building the connector's
                          Prometheus metrics raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from maru_vllm.connector import MaruKVConnector
from maru_vllm.connector import connector as connector_module

SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "build_connector_meta.seal",
    "request_finished",
)
WORKER_HOOKS = (
    "start_load_kv",
    "get_block_ids_with_load_errors",
    "wait_for_save",
    "handle_preemptions",
    "get_finished",
    "get_transfer_results",
    "get_kv_connector_stats",
)
START_HOOKS = ("register_kv_caches", "build_prom_metrics")


def _armed(fault_file: Path, hook: str) -> bool:
    try:
        return hook in fault_file.read_text().split()
    except FileNotFoundError:
        return False


class FaultyMaruKVConnector(MaruKVConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.fault_file = Path(vllm_config.kv_transfer_config.kv_connector_extra_config["test_fault_file"])
        side = self.scheduler_side
        if side is not None:
            for hook in SCHEDULER_HOOKS:
                if "." not in hook:
                    setattr(side, hook, self._raising(hook, getattr(side, hook)))
            self.load_guard.seal = self._raising("build_connector_meta.seal", self.load_guard.seal)  # type: ignore[method-assign]
        worker = self.worker_side
        if worker is not None:
            worker.load = self._raising("start_load_kv", self._missing_loads(worker.load))
            worker.take_failed_blocks = self._raising("get_block_ids_with_load_errors", worker.take_failed_blocks)
            worker.store = self._raising("wait_for_save", worker.store)
            worker.handle_preemptions = self._raising("handle_preemptions", worker.handle_preemptions)
            worker.finished_stores = self._raising("get_finished", worker.finished_stores)
            worker.take_load_results = self._raising("get_transfer_results", worker.take_load_results)
            worker.take_counters = self._raising("get_kv_connector_stats", worker.take_counters)
            worker.register_kv_caches = self._raising("register_kv_caches", worker.register_kv_caches)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        """The connector's own metrics class raises while the fault is armed (below the wrapper)."""
        fault_file = Path(vllm_config.kv_transfer_config.kv_connector_extra_config["test_fault_file"])
        real = connector_module.MaruPromMetrics
        if _armed(fault_file, "build_prom_metrics"):

            def raising(*_: Any, **__: Any) -> Any:
                raise RuntimeError("injected fault in build_prom_metrics")

            connector_module.MaruPromMetrics = raising  # type: ignore[assignment,misc]
        try:
            return super().build_prom_metrics(vllm_config, *args, **kwargs)
        finally:
            connector_module.MaruPromMetrics = real  # type: ignore[misc]

    def armed(self, hook: str) -> bool:
        return _armed(self.fault_file, hook)

    def _raising(self, hook: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.armed(hook):
                raise RuntimeError(f"injected fault in {hook}")
            return real(*args, **kwargs)

        return call

    def _missing_loads(self, real_load: Callable[..., Any]) -> Callable[..., Any]:
        def load(meta: Any) -> Any:
            if self.armed("get_block_ids_with_load_errors"):
                meta = dataclasses.replace(
                    meta, loads=[dataclasses.replace(ld, key=b"missing:" + ld.key) for ld in meta.loads]
                )
            return real_load(meta)

        return load
