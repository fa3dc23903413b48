"""Our pool events use vLLM's own wire format and hash conversion."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.types import BlocksRemoved, BlocksStored
from tests.events.helpers import BLOCK, block_hash, ext


def test_external_hash_is_what_vllm_puts_in_its_events(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm import envs
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    h = block_hash(1, 0)
    assert vf.external_hash(h) == maybe_convert_block_hash(h)
    if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:  # vLLM 0.31's default: low 64 bits, unsigned
        assert vf.external_hash(h) == int.from_bytes(h, "big") & ((1 << 64) - 1)


def test_announcements_round_trip_through_vllms_classes() -> None:
    stored = BlocksStored((ext(1, 2), ext(1, 3)), ext(1, 1), list(range(2 * BLOCK)), BLOCK)
    removed = BlocksRemoved((ext(1, 0),))
    payload = vf.encode_announcements([stored, removed], "CPU_PINNED", data_parallel_rank=0, ts=12.5)
    batch = vf.decode_batch(payload)
    assert isinstance(batch, vf.KVEventBatch) and batch.ts == 12.5 and batch.data_parallel_rank == 0
    s, r = batch.events
    assert isinstance(s, vf.BlockStored) and isinstance(r, vf.BlockRemoved)
    assert s.block_hashes == [vf.external_hash(block_hash(1, 2)), vf.external_hash(block_hash(1, 3))]
    assert s.parent_block_hash == vf.external_hash(block_hash(1, 1))
    assert s.token_ids == list(range(2 * BLOCK)) and s.block_size == BLOCK and s.medium == "CPU_PINNED"
    assert s.lora_name is None and s.lora_id is None
    assert r.block_hashes == [vf.external_hash(block_hash(1, 0))] and r.medium == "CPU_PINNED"
    # byte-identical to what vLLM's publisher encodes for the same batch
    assert payload == msgspec.msgpack.Encoder().encode(batch)
    # the generic msgpack shape vLLM consumers (Dynamo) parse: [ts, [events...], dp_rank], tagged events
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 12.5 and raw[2] == 0 and raw[1][0]["type"] == "BlockStored" and raw[1][1]["type"] == "BlockRemoved"


def test_first_chunk_has_no_parent_and_seq_frames_are_vllms() -> None:
    s = vf.to_vllm_event(BlocksStored((ext(2, 0),), None, tuple(range(BLOCK)), BLOCK), "CPU")
    assert s.parent_block_hash is None and s.medium == "CPU"
    assert vf.encode_seq(7) == (7).to_bytes(8, "big") and vf.decode_seq(vf.encode_seq(123456)) == 123456
    with pytest.raises(TypeError):
        vf.to_vllm_event("nope", "CPU")  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [3, 64, 1000, 70_000])
def test_token_arrays_encode_to_the_same_event_as_token_lists(n: int) -> None:
    """The relay hands token ids as uint32 arrays; what vLLM's decoder reads back is the list."""
    tokens = np.random.default_rng(n).integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    tokens[:2] = (0, (1 << 32) - 1)
    as_array = vf.encode_announcements([BlocksStored((ext(3, 0),), None, tokens, n)], "CPU_PINNED", ts=1.0)
    as_list = vf.encode_announcements([BlocksStored((ext(3, 0),), None, tokens.tolist(), n)], "CPU_PINNED", ts=1.0)
    assert vf.decode_batch(as_array) == vf.decode_batch(as_list)
    assert vf.decode_batch(as_array).events[0].token_ids == tokens.tolist()
