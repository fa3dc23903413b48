"""Binary chunk metadata: the relay announces exactly what it announces from the JSON form.

Every scenario below runs twice, once with the pool objects' metadata as JSON (what a pool that
predates binary metadata serves) and once as binary (`chunk_codec`, read page-wise as columns),
and the KV event batches the relay would send must decode to the same vLLM events.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.pool_view import NamespaceFilter, PoolView
from maru_vllm.events.types import PoolChunk, PoolObject, PoolSnapshot
from maru_vllm.pool import chunk_codec
from maru_vllm.pool import messages as M
from tests.events.helpers import BLOCK, chunk_key, chunk_meta, ext

NS = "kv:m:1"


def _obj(prefix: int, chunk: int, binary: bool, rank: int = 0, **kw: Any) -> PoolObject:
    meta = chunk_meta(prefix, chunk, rank=rank, **kw)
    stored: Any = msgspec.json.encode(meta)
    if binary:
        stored = chunk_codec.encode(msgspec.convert(meta, chunk_codec.ChunkMeta))
        assert stored is not None
    else:
        stored = msgspec.Raw(stored)
    return PoolObject(NS, chunk_key(prefix, chunk, rank=rank).hex(), 100, stored)


def _events(announcements: list[Any]) -> list[tuple[Any, ...]]:
    """What Dynamo's publisher would decode from the relay's batches."""
    out: list[tuple[Any, ...]] = []
    for i in range(0, len(announcements), 7):  # several batches, as the relay cuts them
        batch = vf.decode_batch(vf.encode_announcements(announcements[i : i + 7], "CPU_PINNED"))
        for e in batch.events:
            if isinstance(e, vf.BlockStored):
                out.append(("stored", tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.block_size))
            else:
                out.append(("removed", tuple(e.block_hashes)))
    return out


def _snap(objects: list[PoolObject], part: int = 0, last: bool = True, full: bool = False) -> PoolSnapshot:
    return PoolSnapshot("p", "i", 0, tuple(objects), part=part, last=last, total=len(objects), full=full)


def _both(scenario: Any, ordered: bool = True) -> None:
    """Run `scenario(view, make_obj)` (-> lists of announcements) on JSON and on binary
    metadata and compare the events (`ordered`: in the same order, else as multisets)."""
    got = {}
    for binary in (False, True):
        view = PoolView(NamespaceFilter.exactly(NS), BLOCK, int_hashes=True)
        steps = scenario(view, lambda *a, b=binary, **kw: _obj(*a, binary=b, **kw))
        got[binary] = [_events(step) if ordered else sorted(_events(step), key=repr) for step in steps]
        got[(binary, "blocks")] = sorted(view.blocks)
    assert got[True] == got[False]
    assert got[(True, "blocks")] == got[(False, "blocks")]
    assert any(step for step in got[True])  # the scenario announced something


def test_resync_differences_and_a_second_resync_match_json() -> None:
    def scenario(view: PoolView, o: Any) -> list[list[Any]]:
        first = view.resync(_snap([o(p, c) for p in range(3) for c in range(3)]))
        # prefix 0 gone, prefix 3 new, prefix 1 grows by a chunk
        second = view.resync(_snap([o(p, c) for p in (1, 2, 3) for c in range(3)] + [o(1, 3)]))
        return [first, second]

    _both(scenario)


def test_pages_children_before_parents_tp_ranks_and_full_resyncs_match_json() -> None:
    def scenario(view: PoolView, o: Any) -> list[list[Any]]:
        # part 0 holds only children whose parents come in part 1; rank 1 repeats rank 0's blocks
        a = view.resync(_snap([o(7, 2), o(7, 1), o(7, 1, rank=1)], part=0, last=False))
        b = view.resync(_snap([o(7, 0), o(8, 0), o(8, 1)], part=1, last=True))
        full = view.resync(_snap([o(7, c) for c in range(3)], full=True))
        return [a, b, full]

    _both(scenario)


def test_partly_announced_chunks_and_live_events_match_json() -> None:
    def scenario(view: PoolView, o: Any) -> list[list[Any]]:
        live = view.stored(o(5, 0)) + view.stored(o(5, 1))
        # prefix 6 shares nothing; an unfinished resync then a fresh one
        unfinished = view.resync(_snap([o(5, 0), o(6, 0)], part=0, last=False))
        again = view.resync(_snap([o(5, 1), o(6, 0), o(6, 1)]))
        gone = view.removed(o(6, 1))
        return [live, unfinished, again, gone]

    _both(scenario)


def test_other_geometries_and_lora_chunks_take_the_per_chunk_path_with_the_same_result() -> None:
    def scenario(view: PoolView, o: Any) -> list[list[Any]]:
        objs = [o(1, 0), o(1, 1), o(2, 0, blocks_per_chunk=3), o(3, 0, block_size=BLOCK * 2)]
        return [view.resync(_snap(objs))]

    _both(scenario, ordered=False)  # columns first, then the rest: parents still before children
    meta = msgspec.convert(chunk_meta(4, 1), chunk_codec.ChunkMeta)
    lora = chunk_codec.encode(msgspec.structs.replace(meta, lora_name="adapter-a"))
    assert lora is not None
    view = PoolView(NamespaceFilter.exactly(NS), BLOCK, int_hashes=True)
    ann = view.resync(_snap([PoolObject(NS, "aa", 1, lora)]))
    assert [a.lora_name for a in ann] == ["adapter-a"]
    assert PoolChunk.from_meta(lora) is not None and PoolChunk.from_meta(lora).block_hashes == (ext(4, 2), ext(4, 3))


def test_column_events_decode_like_vllms_own_encoding_at_any_hash_value() -> None:
    """Full-width ints (uint64 hashes, uint32 tokens) decode to what vLLM's struct would send,
    including hash 0 and hashes above 2^63."""
    meta = chunk_codec.ChunkMeta(
        v=1,
        chunk=1,
        block_size=2,
        block_hashes=["00" * 32, "ff" * 32],
        parent_block_hash="11" * 24 + "80" + "00" * 7,  # announced as its low 64 bits: 2^63
        token_ids=[[0, 1], [2**32 - 1, 7]],
    )
    data = chunk_codec.encode(meta)
    assert data is not None
    view = PoolView(NamespaceFilter(), 2, int_hashes=True)
    ann = view.resync(_snap([PoolObject("n", "k", 1, data)]))
    (e,) = vf.decode_batch(vf.encode_announcements(ann, "CPU_PINNED")).events
    assert isinstance(e, vf.BlockStored)
    ref = vf.BlockStored(
        block_hashes=[0, 2**64 - 1],
        parent_block_hash=2**63,
        token_ids=[0, 1, 2**32 - 1, 7],
        block_size=2,
        lora_id=None,
        medium="CPU_PINNED",
        lora_name=None,
    )
    assert e == ref


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda b: b[:3] + b"\x09" + b[4:], r"binary chunk metadata format 9 is not supported \(supported: 1\)"),
        (lambda b: b[:4] + b"\x07\x00" + b[6:], r"chunk metadata version 7 is not supported \(supported: \[1\]\)"),
        (lambda b: b[:-4], r"binary chunk metadata is \d+ bytes; its header implies \d+"),
        (lambda b: b[:10], r"binary chunk metadata of 10 bytes is shorter than its 32-byte header"),
    ],
)
def test_damaged_or_unknown_binary_metadata_is_refused_in_one_line_and_never_announced(damage: Any, why: str) -> None:
    good = chunk_codec.encode(msgspec.convert(chunk_meta(1, 1), chunk_codec.ChunkMeta))
    assert good is not None
    bad = damage(good)
    with pytest.raises(M.MessageError, match="not MaruKVConnector chunk metadata: " + why):
        chunk_codec.decode_chunk_meta(bad)
    assert chunk_codec.problem(bad) is not None and "\n" not in chunk_codec.problem(bad)
    view = PoolView(NamespaceFilter(), BLOCK, int_hashes=True)
    # in a page with a good chunk: the good one is announced, the bad one is not
    ann = view.resync(_snap([PoolObject("n", "bad", 1, bad), PoolObject("n", "good", 1, good)]))
    assert [e[1] for e in _events(ann)] == [(ext(1, 2), ext(1, 3))]
    assert view.stored(PoolObject("n", "bad2", 1, bad)) == []


def test_binary_form_round_trips_and_odd_chunks_have_none() -> None:
    meta = msgspec.convert(chunk_meta(3, 2, rank=5), chunk_codec.ChunkMeta)
    data = chunk_codec.encode(meta)
    assert data is not None and chunk_codec.is_binary(data) and chunk_codec.decode(data) == meta
    assert chunk_codec.decode_chunk_meta(data) == meta
    uneven = msgspec.structs.replace(meta, block_hashes=["00" * 16, "00" * 32])
    assert chunk_codec.encode(uneven) is None  # stored as JSON instead
    assert chunk_codec.encode(msgspec.structs.replace(meta, token_ids=[[2**32] * BLOCK] * 2)) is None


@pytest.mark.parametrize("binary", [False, True])
def test_salted_and_adapter_chunks_are_announced_with_their_keys_on_every_block(binary: bool) -> None:
    """A tenant's (cache_salt) and an adapter's (LoRA) chunks carry both in every block's
    `extra_keys`, as vLLM names them: Dynamo's router hashes each block with them, so it credits
    such a chunk only to requests with the same salt and adapter. Plain chunks carry none."""
    meta = msgspec.convert(chunk_meta(5, 1), chunk_codec.ChunkMeta)
    salted = msgspec.structs.replace(meta, cache_salt="dynamo-cache-salt:tenant-a", lora_name="adapter-a")
    stored: Any = chunk_codec.encode(salted) if binary else msgspec.Raw(msgspec.json.encode(salted))
    assert stored is not None
    if binary:
        assert chunk_codec.decode(stored) == salted
    plain = _obj(6, 1, binary)
    view = PoolView(NamespaceFilter.exactly(NS), BLOCK, int_hashes=True)
    ann = view.resync(_snap([PoolObject(NS, "aa", 1, stored), plain]))
    events = {e.block_hashes[0]: e for e in vf.decode_batch(vf.encode_announcements(ann, "CPU_PINNED")).events}
    mine = events[ext(5, 2)]
    assert mine.lora_name == "adapter-a"
    assert mine.extra_keys == [("adapter-a", "dynamo-cache-salt:tenant-a")] * 2
    assert events[ext(6, 2)].extra_keys is None and events[ext(6, 2)].lora_name is None
