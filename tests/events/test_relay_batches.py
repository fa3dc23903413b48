"""A resync of a large pool reaches Dynamo as many bounded KVEventBatches, never one huge one."""

from __future__ import annotations

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.relay import MAX_BATCH_BLOCKS, KvEventRelay
from maru_vllm.events.types import BlocksRemoved, BlocksStored
from tests.events.helpers import BLOCK, ext


def test_large_announcements_are_split_into_bounded_batches_in_order() -> None:
    relay = KvEventRelay(upstream="tcp://127.0.0.1:1")  # not started: batches are held, in order
    stores = [BlocksStored((ext(i, 0), ext(i, 1)), None, list(range(2 * BLOCK)), BLOCK) for i in range(1500)]
    removal = BlocksRemoved(tuple(ext(i, 9) for i in range(2500)))
    relay._announce([removal, *stores])
    batches = [vf.decode_batch(p) for p in relay._held_pool]
    sizes = [sum(len(e.block_hashes) for e in b.events) for b in batches]
    assert len(batches) >= 5 and max(sizes) <= MAX_BATCH_BLOCKS + 1  # a store may end one block past
    removed = [h for b in batches for e in b.events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    stored = [e for b in batches for e in b.events if type(e).__name__ == "BlockStored"]
    assert removed == list(removal.block_hashes)  # all of it, in order
    assert [e.block_hashes[0] for e in stored] == [s.block_hashes[0] for s in stores]
    relay.close_sockets()


def test_pool_batches_beyond_the_hold_are_dropped_and_announced_in_full_on_join() -> None:
    """Before Dynamo subscribes, a relay holds a bounded amount of pool batches; a larger resync
    is not held (it would hold the whole pool's token ids) but announced again from the pool."""
    relay = KvEventRelay(upstream="tcp://127.0.0.1:1", max_held_pool_blocks=100)
    relay._announce([BlocksStored((ext(i, 0),), None, list(range(BLOCK)), BLOCK) for i in range(60)])
    assert len(relay._held_pool) == 1 and not relay._announce_on_join
    relay._announce([BlocksStored((ext(i, 1),), None, list(range(BLOCK)), BLOCK) for i in range(60)])
    assert relay._held_pool == [] and relay._announce_on_join  # past 100 blocks: nothing held
    relay.close_sockets()
