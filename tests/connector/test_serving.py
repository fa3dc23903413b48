"""Which path an engine is served on (serving.py): chosen once, from engine_support's verdict.

One full-attention group keeps the namespace engines of that model always shared, synchronous
loads and per-block failures; group by group, every group has its own namespace, the announced
group's is the engine's, and a failed load fails its whole request.
"""

from __future__ import annotations

import types
from typing import Any

from maru_vllm.connector.chunks import ChunkGeometry
from maru_vllm.connector.engine_support import engine_support
from maru_vllm.connector.metadata import ChunkLoad, MaruConnectorMetadata
from maru_vllm.connector.namespace import group_namespaces, identity_from_vllm
from maru_vllm.connector.scheduler import MaruSchedulerSide
from maru_vllm.connector.scheduler_groups import GroupedSchedulerSide
from maru_vllm.connector.serving import ServingPath, serving_path
from maru_vllm.connector.worker import MaruWorkerSide
from maru_vllm.connector.worker_groups import GroupedWorkerSide
from tests.connector.test_engine_support import FULL, SLIDING, engine, kv_config

CFG = types.SimpleNamespace(
    model_config=types.SimpleNamespace(model="llama", revision=None, dtype="bfloat16"),
    cache_config=types.SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256"),
    parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
)
GEOMETRY = ChunkGeometry(16, 2, 1)


def sides(path: ServingPath) -> tuple[Any, Any]:
    """The path's scheduler and worker sides (built without a pool link: nothing is sent)."""
    pool = types.SimpleNamespace()
    scheduler = path.scheduler_side(GEOMETRY, pool, can_load=True, can_store=True)
    worker = path.worker_side(
        rank=0,
        pool=pool,
        store_pool=None,
        write_behind=True,
        blocks_per_chunk=2,
        block_size=16,
        num_blocks=100,
        use_lmcache_kernels=False,
        enable_fused_load=False,
    )
    return scheduler, worker


def engine_support_grouped(config: object) -> bool:
    support = engine_support(engine(), config)
    return support.serves and support.grouped


def failed_step() -> MaruConnectorMetadata:
    return MaruConnectorMetadata(loads=[ChunkLoad("r", b"k", [4, 5])], async_loads={"r"})


def test_one_full_attention_group_is_served_chunk_by_chunk() -> None:
    config = kv_config(FULL)
    path = serving_path(CFG, config, "", grouped=engine_support_grouped(config))
    assert path.namespace == identity_from_vllm(CFG, config, "").namespace()  # what its engines share
    assert not path.load_guard(16).asynchronous and path.describe() == ""
    scheduler, worker = sides(path)
    assert type(scheduler) is MaruSchedulerSide and type(worker) is MaruWorkerSide
    assert worker.namespace == path.namespace
    # A failed load is reported block by block; there are no per-request verdicts.
    assert worker.fail_unknown_loads(failed_step()) == {4, 5}
    assert worker.take_load_results() == (set(), set())
    worker.shutdown()


def test_several_groups_are_served_group_by_group() -> None:
    config = kv_config(SLIDING, FULL)
    path = serving_path(CFG, config, "", grouped=engine_support_grouped(config))
    assert path.grouped
    namespaces = group_namespaces(CFG, config, "")
    assert list(path.namespaces) == namespaces and len(set(namespaces)) == 2
    assert path.namespace == namespaces[1]  # the full-attention group's objects are announced
    assert path.load_guard(16).asynchronous and "2 KV cache groups" in path.describe()
    scheduler, worker = sides(path)
    assert type(scheduler) is GroupedSchedulerSide and type(worker) is GroupedWorkerSide
    assert [side.namespace for side in worker.sides] == namespaces
    # A failed load fails its request: vLLM takes no block ids here.
    worker.fail_loads(failed_step(), "test")
    assert worker.fail_unknown_loads(failed_step()) == set()
    assert worker.take_load_results() == ({"r"}, {"r"})
    worker.shutdown()
