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
  start_load_kv           the worker side's load raises before copying anything.
  get_block_ids_with_load_errors
                          every load of the step misses (as if evicted: the worker records the
                          blocks failed), then reading the failed blocks raises.
  wait_for_save           the worker side's store raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from maru_vllm.connector import MaruKVConnector

SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished")
WORKER_HOOKS = ("start_load_kv", "get_block_ids_with_load_errors", "wait_for_save")


class FaultyMaruKVConnector(MaruKVConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.fault_file = Path(vllm_config.kv_transfer_config.kv_connector_extra_config["test_fault_file"])
        side = self.scheduler_side
        if side is not None:
            for hook in SCHEDULER_HOOKS:
                setattr(side, hook, self._raising(hook, getattr(side, hook)))
        worker = self.worker_side
        if worker is not None:
            worker.load = self._raising("start_load_kv", self._missing_loads(worker.load))
            worker.take_failed_blocks = self._raising("get_block_ids_with_load_errors", worker.take_failed_blocks)
            worker.store = self._raising("wait_for_save", worker.store)

    def armed(self, hook: str) -> bool:
        try:
            return hook in self.fault_file.read_text().split()
        except FileNotFoundError:
            return False

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
