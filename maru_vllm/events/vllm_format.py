"""vLLM's KV-event wire format, produced and parsed with vLLM's own classes.

vLLM's `ZmqEventPublisher` sends each `KVEventBatch` as a three-frame ZMQ message
`(topic, seq, payload)`: `seq` is an 8-byte big-endian counter, `payload` the batch encoded
with `msgspec.msgpack.Encoder()`. Block hashes in events are `maybe_convert_block_hash(h)` of
the raw `BlockHash` bytes (with vLLM's default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`: the low
64 bits as an unsigned int), so pool blocks converted here are the same values vLLM announces
for the same blocks on the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from maru_vllm.events.types import KNOWN_MEDIUMS, Announcement, BlocksRemoved, BlocksStored

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KNOWN_MEDIUMS",
    "decode_batch",
    "decode_seq",
    "encode_announcements",
    "encode_batch",
    "encode_seq",
    "external_hash",
    "to_vllm_event",
]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


def external_hash(block_hash: bytes):
    """A vLLM `BlockHash` (bytes) as vLLM writes it into its own KV events."""
    return maybe_convert_block_hash(BlockHash(block_hash))


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def to_vllm_event(a: Announcement, medium: str) -> BlockStored | BlockRemoved:
    if isinstance(a, BlocksStored):
        return BlockStored(
            block_hashes=[external_hash(h) for h in a.block_hashes],
            parent_block_hash=None if a.parent_block_hash is None else external_hash(a.parent_block_hash),
            token_ids=list(a.token_ids),
            block_size=a.block_size,
            lora_id=None,
            medium=medium,
            lora_name=a.lora_name,
        )
    if isinstance(a, BlocksRemoved):
        return BlockRemoved(block_hashes=[external_hash(h) for h in a.block_hashes], medium=medium)
    raise TypeError(f"not an announcement: {a!r}")


def encode_announcements(
    announcements: Sequence[Announcement] | Iterable[Announcement],
    medium: str,
    *,
    data_parallel_rank: int | None = None,
    ts: float | None = None,
) -> bytes:
    """One `KVEventBatch` payload carrying `announcements` (in order) at tier `medium`."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [to_vllm_event(a, medium) for a in announcements]
    return encode_batch(
        KVEventBatch(ts=time.time() if ts is None else ts, events=events, data_parallel_rank=data_parallel_rank)
    )
