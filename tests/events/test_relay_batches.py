"""A resync of a large pool reaches Dynamo as many bounded KVEventBatches, never one huge one."""

from __future__ import annotations

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.relay import MAX_BATCH_BLOCKS, KvEventRelay
from maru_vllm.events.types import BlocksRemoved, BlocksStored
from tests.events.helpers import BLOCK, block_hash


def test_large_announcements_are_split_into_bounded_batches_in_order() -> None:
    relay = KvEventRelay(upstream="tcp://127.0.0.1:1")  # not started: batches are held, in order
    stores = [
        BlocksStored((block_hash(i, 0), block_hash(i, 1)), None, tuple(range(2 * BLOCK)), BLOCK) for i in range(1500)
    ]
    removal = BlocksRemoved(tuple(block_hash(i, 9) for i in range(2500)))
    relay._announce([removal, *stores])
    batches = [vf.decode_batch(p) for p in relay._held]
    sizes = [sum(len(e.block_hashes) for e in b.events) for b in batches]
    assert len(batches) >= 5 and max(sizes) <= MAX_BATCH_BLOCKS + 1  # a store may end one block past
    removed = [h for b in batches for e in b.events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    stored = [e for b in batches for e in b.events if type(e).__name__ == "BlockStored"]
    assert removed == [vf.external_hash(h) for h in removal.block_hashes]  # all of it, in order
    assert [e.block_hashes[0] for e in stored] == [vf.external_hash(s.block_hashes[0]) for s in stores]
    relay.close_sockets()
