"""vLLM's KV-event wire format, produced and parsed with vLLM's own classes.

vLLM's `ZmqEventPublisher` sends each `KVEventBatch` as a three-frame ZMQ message
`(topic, seq, payload)`: `seq` is an 8-byte big-endian counter, `payload` the batch encoded
with `msgspec.msgpack.Encoder()`. Block hashes in events are `maybe_convert_block_hash(h)` of
the raw `BlockHash` bytes (with vLLM's default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`: the low
64 bits as an unsigned int), so pool blocks converted here are the same values vLLM announces
for the same blocks on the GPU.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np
from vllm import envs
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from maru_vllm.events.packed_chunks import ChunkStores, StoreTemplate
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
    "extra_keys",
    "int_block_hashes",
    "store_template",
    "to_vllm_event",
    "to_vllm_events",
]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


def external_hash(block_hash: bytes):
    """A vLLM `BlockHash` (bytes) as vLLM writes it into its own KV events."""
    return maybe_convert_block_hash(BlockHash(block_hash))


def int_block_hashes() -> bool:
    """vLLM announces block hashes as ints (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, its default)."""
    return bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def _token_ids(tokens: Sequence[int] | np.ndarray) -> Any:
    """Token ids for a `BlockStored`: a list as it is, a uint32 array as its msgpack encoding
    (an array of uint32 ints, written in one pass instead of one Python int per token)."""
    if not isinstance(tokens, np.ndarray):
        return tokens if isinstance(tokens, list) else list(tokens)
    n = len(tokens)
    head = (
        bytes([0x90 | n])
        if n < 16
        else (b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big"))
    )
    body = np.empty((n, 5), dtype=np.uint8)
    body[:, 0] = 0xCE  # msgpack uint32
    body[:, 1:] = tokens.astype(">u4").view(np.uint8).reshape(n, 4)
    return msgspec.Raw(head + body.tobytes())


@functools.lru_cache(maxsize=64)
def store_template(block_size: int, medium: str) -> StoreTemplate | None:
    """How msgspec lays out vLLM's `BlockStored` (no LoRA) around its three arrays, from one
    encoded with empty ones; None if this vLLM's layout is not the expected one (the relay then
    encodes every store through vLLM's struct)."""
    sample = _encoder.encode(
        BlockStored(
            block_hashes=[],
            parent_block_hash=None,
            token_ids=[],
            block_size=block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )
    )
    hashes_key, parent_key, tokens_key = (
        _encoder.encode(k) for k in ("block_hashes", "parent_block_hash", "token_ids")
    )
    marker = hashes_key + b"\x90" + parent_key + b"\xc0" + tokens_key + b"\x90"
    at = sample.find(marker)
    if at < 0 or sample.find(marker, at + 1) >= 0:
        return None
    return StoreTemplate(sample[:at] + hashes_key, parent_key, tokens_key, sample[at + len(marker) :])


def to_vllm_events(a: Announcement | ChunkStores, medium: str) -> list[Any]:
    """vLLM's events for `a`: one, or one encoded `BlockStored` per chunk of `ChunkStores`."""
    if isinstance(a, ChunkStores):
        template = store_template(a.cols.block_size, medium)
        if template is not None:
            return a.raw_events(template)
        return [to_vllm_event(s, medium) for s in a.announcements()]
    return [to_vllm_event(a, medium)]


def to_vllm_event(a: Announcement, medium: str) -> BlockStored | BlockRemoved:
    """vLLM's event for `a` (whose hashes are already as vLLM announces them: `external_hash`)."""
    if isinstance(a, BlocksStored):
        return BlockStored(
            block_hashes=list(a.block_hashes),
            parent_block_hash=a.parent_block_hash,
            token_ids=_token_ids(a.token_ids),
            block_size=a.block_size,
            lora_id=None,
            medium=medium,
            lora_name=a.lora_name,
            extra_keys=extra_keys(a),
        )
    if isinstance(a, BlocksRemoved):
        return BlockRemoved(block_hashes=list(a.block_hashes), medium=medium)
    raise TypeError(f"not an announcement: {a!r}")


def extra_keys(a: BlocksStored) -> list[tuple[Any, ...] | None] | None:
    """The per-block `extra_keys` of `a` in vLLM's event form (untagged: the LoRA name, then the
    cache salt), from which Dynamo's router derives the adapter and the tenant of each block it
    hashes. Every block carries both: a pool chunk is announced on its own, without the prompt's
    first block that vLLM's own events name the salt in."""
    keys = tuple(k for k in (a.lora_name, a.cache_salt) if k is not None)
    return [keys] * len(a.block_hashes) if keys else None


def encode_announcements(
    announcements: Sequence[Announcement | ChunkStores] | Iterable[Announcement | ChunkStores],
    medium: str,
    *,
    data_parallel_rank: int | None = None,
    ts: float | None = None,
) -> bytes:
    """One `KVEventBatch` payload carrying `announcements` (in order) at tier `medium`."""
    events: list[Any] = [e for a in announcements for e in to_vllm_events(a, medium)]
    return encode_batch(
        KVEventBatch(ts=time.time() if ts is None else ts, events=events, data_parallel_rank=data_parallel_rank)
    )
