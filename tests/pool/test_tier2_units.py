"""The second tier's pure parts: its object format, the presence table's lower-tier hints, the
directory's bound. (The tier against a real mooncake_master: test_tier2.py.)"""

from __future__ import annotations

import os
import random

import pytest

from maru_vllm.pool.allocator import Allocator
from maru_vllm.pool.index import PoolIndex
from maru_vllm.pool.objects import payload_checksum
from maru_vllm.pool.presence import (
    HINT_FREE_SLOTS,
    SLOTS_PER_BUCKET,
    PresenceReader,
    PresenceTable,
    bucket_of,
    table_bytes,
)
from maru_vllm.pool.tier2 import codec
from maru_vllm.pool.tier2.directory import Tier2Directory

DATA = 4096


def _blob(ns: str = "ns", key: bytes = b"key", payload: bytes | None = None) -> tuple[bytearray, bytes]:
    payload = payload if payload is not None else os.urandom(1 << 16)
    meta = b'{"block_hashes": [1, 2]}'
    blob = codec.encode(ns, key, payload_checksum(payload), meta, [b"p0", b"p01"], memoryview(payload))
    return blob, payload


def test_codec_round_trip_carries_meta_parts_and_checksum():
    blob, payload = _blob()
    obj = codec.decode(bytes(blob), "ns", b"key")
    assert bytes(obj.payload) == payload
    assert obj.meta == b'{"block_hashes": [1, 2]}'
    assert obj.parts == (b"p0", b"p01")
    assert obj.checksum == payload_checksum(payload)
    assert len(blob) == codec.encoded_size("ns", b"key", obj.meta, obj.parts, len(payload))


@pytest.mark.parametrize(
    "damage",
    ["payload bit", "header bit", "meta bit", "truncated", "appended", "other namespace", "other key", "magic"],
)
def test_codec_refuses_anything_that_is_not_the_object_asked_for(damage: str):
    blob, _ = _blob()
    ns, key = "ns", b"key"
    if damage == "payload bit":
        blob[-1] ^= 1
    elif damage == "header bit":
        blob[20] ^= 1  # the payload checksum field
    elif damage == "meta bit":
        blob[codec.HEADER_SIZE + 2 + 3 + 2 + 2 + 2 + 3 + 1] ^= 1
    elif damage == "truncated":
        blob = blob[:-1]
    elif damage == "appended":
        blob += b"x"
    elif damage == "other namespace":
        ns = "ns2"
    elif damage == "other key":
        key = b"kez"
    else:
        blob[0] ^= 1
    with pytest.raises(codec.Tier2Corrupt):
        codec.decode(bytes(blob), ns, key)


def test_names_differ_per_namespace_and_never_leak_the_key():
    assert codec.object_name("a", b"k") != codec.object_name("b", b"k")
    assert codec.object_name("a", b"k") == codec.object_name("a", b"k")
    assert len(codec.object_name("a", b"k" * 200)) == len("maru1-") + 32


def _table(buckets: int, capacity: int = 1 << 20) -> tuple[PoolIndex, PresenceReader, PresenceTable]:
    region = memoryview(bytearray(DATA + table_bytes(buckets) + capacity))
    table = PresenceTable(region, DATA, buckets)
    idx = PoolIndex(Allocator(capacity), DATA + table_bytes(buckets), presence=table)
    return idx, PresenceReader(region, DATA, buckets), table


def _store(idx: PoolIndex, sid: int, key: bytes) -> bool:
    (o,) = idx.reserve(sid, "ns", [(key, 1000)])
    return o is not None and idx.commit(sid, [o.oid], [None], lambda _: None) == [True]


def test_hints_never_count_as_present_and_never_push_out_a_key_the_pool_holds():
    rng = random.Random(3)
    idx, reader, table = _table(buckets=64, capacity=300 * 4096)  # small: full buckets and evictions
    sid = idx.open_session()
    fp = table.fingerprints
    keys = [rng.randbytes(12) for _ in range(1500)]
    hinted: set[bytes] = set()
    for _ in range(6000):
        key = rng.choice(keys)
        action = rng.random()
        if action < 0.4:
            _store(idx, sid, key)
        elif action < 0.8:
            if table.hint(fp.of_object("ns", key)):
                hinted.add(key)
        elif action < 0.9:
            table.unhint(fp.of_object("ns", key))
            hinted.discard(key)
        else:
            idx.remove("ns", [key])
        probe = rng.choice(keys)
        local = reader.lookup_prefix("ns", [probe])
        if local is not None:  # a hint is never taken for a key the pool holds
            assert local == idx.lookup_prefix("ns", [probe])
        tiers = reader.lookup_tiers("ns", [probe])
        if tiers is not None:
            assert tiers[0] == idx.lookup_prefix("ns", [probe])
            assert tiers[1] in (0, 1) and not (tiers[0] and tiers[1])
    # a key only spills when its bucket holds nothing but the pool's own keys
    slots = table._slots.tolist()
    for bucket, spilled in table.spilled.items():
        assert spilled
        values = slots[bucket * SLOTS_PER_BUCKET : (bucket + 1) * SLOTS_PER_BUCKET]
        assert all(v and v & 0xFF != 0xFE for v in values), "a hint kept a slot while a pool key spilled"
    assert table.hints == sum(1 for v in slots if v and v & 0xFF == 0xFE)
    assert table.entries == len(idx.objects) + sum(len(h) for h in idx.parts.values() if h)


def test_a_hint_leaves_room_in_its_bucket_and_the_pool_takes_it_over():
    idx, reader, table = _table(buckets=1)
    sid = idx.open_session()
    fp = table.fingerprints
    keys = [os.urandom(8) for _ in range(SLOTS_PER_BUCKET)]
    placed = [k for k in keys if table.hint(fp.of_object("ns", k))]
    assert len(placed) == SLOTS_PER_BUCKET - HINT_FREE_SLOTS
    assert reader.lookup_tiers("ns", placed) == (0, len(placed))
    assert reader.lookup_prefix("ns", placed) == 0
    # the pool stores a hinted key: it is present, no longer hinted
    assert _store(idx, sid, placed[0])
    assert reader.lookup_tiers("ns", placed) == (1, len(placed) - 1)
    # the pool fills the bucket: its keys take the hints' slots, never spill while a hint is there
    others = [os.urandom(8) for _ in range(SLOTS_PER_BUCKET)]
    for k in others:
        _store(idx, sid, k)
    assert table.hints == 0 and bucket_of(fp.of_object("ns", others[0]), 1) == 0
    assert reader.lookup_prefix("ns", [placed[0], *others[: SLOTS_PER_BUCKET - 1]]) == SLOTS_PER_BUCKET


def test_directory_keeps_the_most_recent_keys_within_its_bound():
    d = Tier2Directory(max_entries=3)
    for i in range(3):
        assert d.add("ns", b"%d" % i, 10, 20) == []
    d.touch("ns", b"0")
    assert d.add("ns", b"3", 10, 20) == [("ns", b"1")]
    assert ("ns", b"1") not in d and ("ns", b"0") in d
    assert d.entry("ns", b"3") == (10, 20) and d.forgotten == 1
    assert [k for (_, k), _ in d.recent(2)] == [b"3", b"0"]
    with pytest.raises(ValueError, match="at least one key"):
        Tier2Directory(0)


# ---- pool serve's tier options ------------------------------------------------------------------
def _tier_args(*argv: str):
    import argparse

    from maru_vllm.pool.tier2 import cli as tier_cli

    parser = argparse.ArgumentParser()
    tier_cli.add_arguments(parser)
    return tier_cli.settings_from(parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    "option",
    [
        ("--mooncake-protocol", "rdma"),
        ("--mooncake-metadata", "http://127.0.0.1:8080/metadata"),
        ("--mooncake-segment-size", "64M"),
        ("--mooncake-host", "127.0.0.1"),
        ("--tier2-put-budget", "10M"),
        ("--tier2-queue", "8"),
    ],
)
def test_a_tier_option_without_a_master_is_refused_naming_it(option: tuple[str, str]) -> None:
    with pytest.raises(ValueError, match=f"^{option[0]} needs --mooncake-master"):
        _tier_args(*option)


def test_no_tier_options_no_tier_and_the_protocol_defaults_to_tcp() -> None:
    assert _tier_args() is None
    settings = _tier_args("--mooncake-master", "127.0.0.1:50051")
    assert settings is not None and settings.mooncake.protocol == "tcp"
    rdma = _tier_args("--mooncake-master", "127.0.0.1:50051", "--mooncake-protocol", "rdma")
    assert rdma is not None and rdma.mooncake.protocol == "rdma"
