"""How the connector serves an engine, chosen once at start-up: one KV cache group, or group by group.

`engine_support` decides whether the engine is served and whether group by group; `serving_path`
turns that into a `ServingPath`, which makes everything that differs between the two, so that
nothing after start-up asks again (`connector.py` calls the sides only through `sides.py`):

==============  =====================================  =====================================
                one KV cache group                     group by group (several groups, or a
                                                       sliding-window one)
==============  =====================================  =====================================
namespaces      one for the engine                     one per group; the announced group's
                (`namespace.identity_from_vllm`)       is the engine's (`group_namespaces`)
scheduler side  `scheduler.MaruSchedulerSide`          `scheduler_groups.GroupedSchedulerSide`
worker side     `worker.MaruWorkerSide`                `worker_groups.GroupedWorkerSide`: one
                                                       `MaruWorkerSide` per group
loads           synchronous; a failure is reported     asynchronous; a failure fails the whole
                per block, vLLM recomputes those       request, vLLM recomputes its prompt
load guard      checks the blocks of every grant       gives every grant a verdict
==============  =====================================  =====================================

Failure semantics: nothing here touches the pool or raises for a configuration
`engine_support` accepted; an error building a side is an engine start-up error, as any error
in the connector's constructor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maru_vllm.connector.chunks import ChunkGeometry
from maru_vllm.connector.kv_groups import KVGroup, announced_group, kv_groups
from maru_vllm.connector.load_guard import SchedulerLoadGuard
from maru_vllm.connector.namespace import group_namespaces, identity_from_vllm
from maru_vllm.connector.pool_interface import ConnectorPool
from maru_vllm.connector.scheduler import MaruSchedulerSide
from maru_vllm.connector.scheduler_groups import GroupedSchedulerSide
from maru_vllm.connector.sides import SchedulerSide, WorkerSide
from maru_vllm.connector.worker import MaruWorkerSide
from maru_vllm.connector.worker_groups import GroupedWorkerSide


@dataclasses.dataclass(frozen=True)
class ServingPath:
    """The path one engine is served on; see the module docstring for what `grouped` changes."""

    grouped: bool
    groups: tuple[KVGroup, ...]
    # Grouped: one per KV cache group, by group index; else the engine's one namespace.
    namespaces: tuple[str, ...]
    # Which of `namespaces` the pool's events announce (the engine's namespace).
    announced: int

    @property
    def namespace(self) -> str:
        return self.namespaces[self.announced]

    def scheduler_side(
        self, geometry: ChunkGeometry, pool: ConnectorPool, *, can_load: bool, can_store: bool
    ) -> SchedulerSide:
        if self.grouped:
            return GroupedSchedulerSide(
                geometry,
                list(self.groups),
                list(self.namespaces),
                self.announced,
                pool,
                can_load=can_load,
                can_store=can_store,
            )
        return MaruSchedulerSide(geometry, self.namespace, pool, can_load=can_load, can_store=can_store)

    def worker_side(self, **args: Any) -> WorkerSide:
        """`args`: `MaruWorkerSide`'s keyword arguments but `namespace` (rank, pools, copy options)."""
        if self.grouped:
            return GroupedWorkerSide(groups=list(self.groups), namespaces=list(self.namespaces), **args)
        return MaruWorkerSide(namespace=self.namespace, **args)

    def load_guard(self, block_size: int) -> SchedulerLoadGuard:
        return SchedulerLoadGuard(block_size, asynchronous=self.grouped)

    def describe(self) -> str:
        """What the start-up log line adds about the groups (nothing for one group)."""
        if not self.grouped:
            return ""
        groups = "; ".join(g.describe() for g in self.groups)
        return f", {len(self.groups)} KV cache groups ({groups}), loads asynchronous"


def serving_path(vllm_config: Any, kv_cache_config: Any, salt: str, *, grouped: bool) -> ServingPath:
    """The path for this engine; `grouped` is `engine_support`'s verdict (False when it stands aside)."""
    groups = tuple(kv_groups(kv_cache_config))
    if grouped:
        return ServingPath(
            True, groups, tuple(group_namespaces(vllm_config, kv_cache_config, salt)), announced_group(list(groups))
        )
    return ServingPath(False, groups, (identity_from_vllm(vllm_config, kv_cache_config, salt).namespace(),), 0)
