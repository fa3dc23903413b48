"""Tier-2 key announcements: the chunk metadata they carry, old-format entries, batches by bytes."""

from __future__ import annotations

import collections

import msgspec

from maru_vllm.pool import chunk_codec
from maru_vllm.pool.tier2 import announce as A
from maru_vllm.pool.tier2.announce import Tier2Announcement, Tier2Entry, chunk_meta_of, take_batch
from tests.events.helpers import chunk_meta


def _meta(prefix: int, chunk: int = 0, blocks: int = 2, block_size: int = 4) -> chunk_codec.ChunkMeta:
    return msgspec.convert(chunk_meta(prefix, chunk, blocks, block_size), chunk_codec.ChunkMeta)


def test_an_entry_carries_the_chunk_metadata_the_pool_stored_binary_or_json():
    meta = _meta(7, 1)
    binary = chunk_codec.encode(meta)
    assert binary is not None
    assert chunk_meta_of(binary) == meta
    assert chunk_meta_of(msgspec.json.encode(meta)) == meta
    assert chunk_meta_of(None) is None
    assert chunk_meta_of(b'{"block_hash": 1}') is None  # a pool object that is not a connector chunk
    assert chunk_meta_of(binary[:-4]) is None  # truncated binary metadata

    msg = Tier2Announcement("m:1", "kv-a", "inc", [Tier2Entry("kv:m:1", b"k", 10, 20, meta)], [Tier2Entry("ns", b"g")])
    back = A.decode_announcement(msgspec.msgpack.encode(msg))
    assert back == msg
    assert back.stored[0].meta == meta and back.gone[0].meta is None


class OldEntry(msgspec.Struct, array_like=True):  # an entry as pools without chunk metadata send it
    ns: str
    key: bytes
    size: int = 0
    tier_size: int = 0


class OldAnnouncement(msgspec.Struct):
    tier: str
    pool: str
    incarnation: str
    stored: list[OldEntry] = []
    gone: list[OldEntry] = []


def test_old_format_entries_still_decode_and_old_readers_ignore_the_metadata():
    old = OldAnnouncement("m:1", "kv-a", "inc", [OldEntry("ns", b"k", 1, 2)])
    new = A.decode_announcement(msgspec.msgpack.encode(old))
    assert new.stored == [Tier2Entry("ns", b"k", 1, 2, None)]

    ours = Tier2Announcement("m:1", "kv-a", "inc", [Tier2Entry("ns", b"k", 1, 2, _meta(1))])
    seen_by_old = msgspec.msgpack.decode(msgspec.msgpack.encode(ours), type=OldAnnouncement)
    assert seen_by_old.stored == [OldEntry("ns", b"k", 1, 2)]


def test_a_malformed_metadata_field_fails_the_message_not_the_reader():
    bad_entry = ["ns", b"k", 1, 2, {"v": 99}]
    raw = msgspec.msgpack.encode({"tier": "t", "pool": "p", "incarnation": "i", "stored": [bad_entry]})
    try:
        A.decode_announcement(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    else:
        raise AssertionError("a chunk metadata version nobody supports decoded")


def test_batches_stay_under_the_message_limit_and_lose_nothing():
    big = _meta(3, blocks=16, block_size=256)  # ~4096 token ids: ~13 KiB encoded
    entries = [Tier2Entry("kv:m:1", i.to_bytes(8, "big"), 1, 1, big) for i in range(200)]
    queue = collections.deque(entries)
    sent: list[Tier2Entry] = []
    while queue:
        batch, used = take_batch(queue, A.MAX_MESSAGE_BYTES - A._HEADER_SLACK)
        assert batch, "a batch took nothing"
        msg = msgspec.msgpack.encode(Tier2Announcement("m:1", "kv-a", "0" * 32, batch))
        assert used <= A.MAX_MESSAGE_BYTES and len(msg) <= A.MAX_MESSAGE_BYTES < 1 << 20
        assert len(batch) < len(entries)  # bytes, not the entry count, ended the batch
        sent += batch
    assert sent == entries


def test_an_entry_too_large_for_any_message_goes_without_its_metadata():
    huge = _meta(4, blocks=128, block_size=2048)  # 262,144 token ids: over a message's bytes
    queue = collections.deque([Tier2Entry("ns", b"big", 1, 1, huge), Tier2Entry("ns", b"small", 1, 1, _meta(5))])
    batch, _ = take_batch(queue, A.MAX_MESSAGE_BYTES - A._HEADER_SLACK)
    assert [(e.key, e.meta is None) for e in batch] == [(b"big", True), (b"small", False)]


def test_past_the_metadata_queue_entries_wait_without_their_metadata():
    ann = A.Tier2Announcer("nats://127.0.0.1:1", "m:1", "kv-a", "inc", lambda s, g: None, lambda n: [])
    for i in range(A.META_QUEUE + 2):
        ann.stored(Tier2Entry("ns", i.to_bytes(4, "big"), 1, 1, _meta(1)))
    queued = list(ann._stored)
    assert all(e.meta is not None for e in queued[: A.META_QUEUE])
    assert all(e.meta is None for e in queued[A.META_QUEUE :])
