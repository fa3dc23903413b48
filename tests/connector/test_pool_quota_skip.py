"""A store the pool refuses (a session quota) is a clean skip in the connector, never an error."""

from __future__ import annotations

import torch

from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
from tests.connector.chunk_meta import chunk_meta
from tests.connector.worker_side import worker_side
from tests.running_pool import running_pool


def test_stores_past_the_session_quota_are_skipped_and_the_rest_load() -> None:
    with running_pool("2M") as svc:  # default quota: half the pool per session
        caches = {f"layer{i}": torch.randn(16, 2, 8, 32).to(torch.bfloat16) for i in range(3)}
        side = worker_side(svc.address, "kv:quota", caches, block_size=8, num_blocks=16)
        stores = [
            ChunkStore(f"r{i}", b"chunk-%d" % i, [2 * (i % 8), 2 * (i % 8) + 1], chunk_meta(i)) for i in range(300)
        ]  # 300 x ~6 KiB in one step: more than 1 MiB
        side.store(MaruConnectorMetadata(stores=stores))
        if side.writer is not None:  # write-behind: the copies finish off the step
            assert side.writer.wait(timeout=30)
        c = side.take_counters()
        assert c.store_failures == 0 and c.stores_skipped > 0
        assert c.chunks_stored + c.stores_skipped == 300 and c.chunks_stored > 0
        side.load(MaruConnectorMetadata(loads=[ChunkLoad("x", b"chunk-0", [14, 15])]))
        assert side.take_failed_blocks() == set()
        assert side.pool.available
