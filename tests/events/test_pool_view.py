"""PoolView: namespace/metadata filtering, per-block reference counts, snapshot diffs."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from maru_vllm.events.pool_view import NamespaceFilter, PoolView
from maru_vllm.events.types import BlocksRemoved, BlocksStored, PoolChunk, PoolEvent, PoolObject, PoolSnapshot
from maru_vllm.pool import messages as M
from maru_vllm.pool.chunk_codec import model_namespace_prefix
from tests.connector.identity import IDENTITY
from tests.events.helpers import BLOCK, block_hash, chunk_meta, ext, obj


def view(**kw) -> PoolView:
    return PoolView(NamespaceFilter(prefixes=("kv:m:",)), block_size=BLOCK, **kw)


def test_stored_chunk_announces_its_blocks_chained_on_its_parent() -> None:
    v = view()
    [a0] = v.stored(obj(1, 0))
    assert isinstance(a0, BlocksStored)
    assert a0.block_hashes == (ext(1, 0), ext(1, 1)) and a0.parent_block_hash is None
    assert a0.block_size == BLOCK and len(a0.token_ids) == 2 * BLOCK
    assert tuple(a0.token_ids[:BLOCK]) == tuple(chunk_meta(1, 0)["token_ids"][0])
    [a1] = v.stored(obj(1, 1))
    assert a1.block_hashes == (ext(1, 2), ext(1, 3)) and a1.parent_block_hash == ext(1, 1)
    assert v.stored(obj(1, 1)) == []  # duplicate stored event
    assert v.blocks == {ext(1, b) for b in range(4)}


def test_removed_withdraws_blocks_only_when_the_last_object_holding_them_goes() -> None:
    v = view()
    v.stored(obj(1, 0, rank=0))
    assert v.stored(obj(1, 0, rank=1)) == []  # second TP rank of the same chunk: nothing new
    assert v.removed(obj(1, 0, rank=0)) == []
    assert v.removed(obj(1, 0, rank=1)) == [BlocksRemoved((ext(1, 0), ext(1, 1)))]
    assert v.removed(obj(1, 0, rank=1)) == []  # unknown object
    assert len(v) == 0 and not v.blocks


@pytest.mark.parametrize(
    "o",
    [
        obj(1, 0, namespace="kv:other:1"),  # another model's namespace
        PoolObject("kv:m:1", "aa", 1, {"block": 3}),  # not chunk metadata
        PoolObject("kv:m:1", "aa", 1, None),
        PoolObject("kv:m:1", "aa", 1, {**chunk_meta(1, 0), "v": 99}),  # unknown metadata version
        PoolObject("kv:m:1", "aa", 1, {**chunk_meta(1, 0), "token_ids": [[1, 2]]}),  # tokens do not fit
        obj(1, 0, block_size=8),  # another block size
    ],
)
def test_foreign_or_malformed_objects_are_never_announced(o: PoolObject) -> None:
    v = view()
    assert v.stored(o) == [] and len(v) == 0


def test_apply_routes_events() -> None:
    v = view()
    o = obj(2, 0)
    ev = PoolEvent("stored", 1, "inc", "p", o)
    assert v.apply(ev) and v.apply(PoolEvent("removed", 2, "inc", "p", o)) == [BlocksRemoved((ext(2, 0), ext(2, 1)))]


def test_resync_announces_only_the_difference_parents_first() -> None:
    v = view()
    v.stored(obj(1, 0))
    v.stored(obj(1, 1))
    v.stored(obj(2, 0))
    snap = PoolSnapshot("p", "inc2", 9, (obj(3, 1), obj(1, 0), obj(3, 0), obj(9, 0, namespace="x")))
    out = v.resync(snap)
    assert isinstance(out[0], BlocksRemoved)
    assert set(out[0].block_hashes) == {ext(1, 2), ext(1, 3), ext(2, 0), ext(2, 1)}
    stores = out[1:]
    assert [s.block_hashes[0] for s in stores] == [ext(3, 0), ext(3, 2)]  # parent chunk first
    assert v.resync(snap) == []  # idempotent
    assert v.blocks == {ext(1, 0), ext(1, 1)} | {ext(3, b) for b in range(4)}
    assert obj(3, 1).oid in v and obj(2, 0).oid not in v and len(v) == 3
    cleared = v.clear()
    assert len(cleared) == 1 and set(cleared[0].block_hashes) == {ext(1, 0), ext(1, 1)} | {ext(3, b) for b in range(4)}
    assert not v.blocks


def test_a_snapshot_in_parts_announces_each_part_and_removals_at_the_end() -> None:
    v = view()
    v.stored(obj(1, 0))
    v.stored(obj(2, 0))
    part0 = PoolSnapshot("p", "inc", 5, (obj(3, 1),), part=0, last=False, total=3)  # a child before its parent
    part1 = PoolSnapshot("p", "inc", 5, (obj(1, 0), obj(3, 0)), part=1, last=True)
    assert v.resync(part0) == []  # held until its parent is announced
    out = v.resync(part1)
    assert out[0] == BlocksRemoved((ext(2, 0), ext(2, 1)))
    assert [s.block_hashes[0] for s in out[1:]] == [ext(3, 0), ext(3, 2)]
    assert v.blocks == {ext(1, 0), ext(1, 1)} | {ext(3, b) for b in range(4)}


def test_an_unfinished_resync_is_withdrawn_by_the_next_one() -> None:
    v = view()
    [stored] = v.resync(PoolSnapshot("p", "inc", 5, (obj(4, 0),), part=0, last=False))
    assert stored.block_hashes == (ext(4, 0), ext(4, 1))
    # the pool restarted mid-snapshot: a new resync starts; object 4 is gone by now
    out = v.resync(PoolSnapshot("p", "inc2", 1, (obj(5, 0),)))
    assert BlocksRemoved((ext(4, 0), ext(4, 1))) in out and not {ext(4, 0), ext(4, 1)} & v.blocks


def test_a_full_resync_announces_every_block_once() -> None:
    v = view()
    for o in (obj(1, 1), obj(1, 0), obj(1, 0, rank=1)):
        v.stored(o)
    out = v.resync(PoolSnapshot("p", "inc", 3, (obj(1, 1), obj(1, 0), obj(1, 0, rank=1)), full=True))
    withdrawn, *stores = out  # what was announced before is withdrawn first (Dynamo counts stores)
    assert isinstance(withdrawn, BlocksRemoved) and set(withdrawn.block_hashes) == {ext(1, b) for b in range(4)}
    assert [a.block_hashes for a in stores] == [(ext(1, 0), ext(1, 1)), (ext(1, 2), ext(1, 3))]
    assert v.resync(PoolSnapshot("p", "inc", 3, (obj(1, 1), obj(1, 0), obj(1, 0, rank=1)))) == []


def test_every_block_is_stored_at_most_once_more_than_it_is_removed() -> None:
    """Dynamo 1.6.1's publisher counts each block's stores and passes a removal on to the router
    only once as many removals came: after any number of full re-announcements, the pool's
    removal of a chunk must still withdraw it (stores - removals per block: 1 while held, 0 after)."""
    v = view()
    balance: dict[object, int] = {}

    def send(announcements) -> None:
        for a in announcements:
            for h in a.block_hashes:
                balance[h] = balance.get(h, 0) + (-1 if isinstance(a, BlocksRemoved) else 1)
                assert balance[h] in (0, 1), (h, balance[h])

    held = (obj(1, 0), obj(1, 1), obj(2, 0))
    for o in held:
        send(v.stored(o))
    for _ in range(3):  # e.g. the re-announcements after a resync, a late subscriber
        send(v.resync(PoolSnapshot("p", "inc", 3, held, full=True)))
    send(v.removed(obj(1, 1)))
    assert {h for h, n in balance.items() if n} == {ext(1, 0), ext(1, 1), ext(2, 0), ext(2, 1)} == v.blocks


def test_the_view_keeps_block_keys_not_tokens() -> None:
    """What a relay holds per pool object is a few table slots: 10^4 chunks of 4 blocks of 64
    tokens each cost the view's tables well under 100 bytes per block."""
    v = PoolView(NamespaceFilter(), block_size=64)
    objs = [
        PoolObject("kv:m:1", f"{i:08x}", 1, chunk_meta(i, 0, blocks_per_chunk=4, block_size=64)) for i in range(10_000)
    ]
    v.resync(PoolSnapshot("p", "inc", 1, tuple(objs), total=len(objs)))
    assert len(v) == 10_000 and v.block_count == 40_000
    assert v.nbytes < 100 * 40_000


def test_partial_overlap_announces_only_new_runs_with_the_right_parent() -> None:
    v = PoolView(NamespaceFilter(), block_size=BLOCK)
    v.stored(obj(1, 0))  # blocks 0,1
    four = PoolObject("kv:m:1", "ff", 1, {**chunk_meta(1, 0, blocks_per_chunk=4)})  # blocks 0..3
    [a] = v.stored(four)
    assert a.block_hashes == (ext(1, 2), ext(1, 3)) and a.parent_block_hash == ext(1, 1)
    assert len(a.token_ids) == 2 * BLOCK


def test_namespace_filters() -> None:
    assert NamespaceFilter().accepts("anything")
    f = NamespaceFilter.exactly("kv:m:1")
    assert f.accepts("kv:m:1") and not f.accepts("kv:m:2") and f.single_namespace == "kv:m:1"
    g = NamespaceFilter.for_model("/models/Llama-3.1-8B/")
    assert g.accepts("kv:Llama-3.1-8B:abc") and not g.accepts("kv:Llama-3.1-8B-x:abc")
    assert g.single_namespace is None


def test_model_prefix_matches_the_connector_namespace() -> None:
    ident = dataclasses.replace(IDENTITY, model="/x/some-very-long-model-name-that-goes-beyond-forty-characters")
    prefix = model_namespace_prefix(ident.model)
    assert ident.namespace().startswith(prefix) and ident.namespace()[len(prefix) :] == ident.digest()


def test_chunk_meta_parsing() -> None:
    c = PoolChunk.from_meta(chunk_meta(5, 1))
    assert c is not None and c.chunk_index == 1 and c.parent_of(0) == ext(5, 1) and c.parent_of(1) == ext(5, 2)
    assert list(c.tokens_of(1, 2)) == chunk_meta(5, 1)["token_ids"][1]
    raw = PoolChunk.from_meta(M.encode_meta_json(chunk_meta(5, 1)))  # the JSON events and pages carry
    assert raw is not None and raw.block_hashes == c.block_hashes and list(raw.tokens) == list(c.tokens)
    assert PoolChunk.from_meta(chunk_meta(5, 1), int_hashes=False).block_hashes == (block_hash(5, 2), block_hash(5, 3))
    assert PoolChunk.from_meta({**chunk_meta(5, 0), "block_hashes": ["zz", "00"]}) is None
    assert PoolChunk.from_meta({**chunk_meta(5, 0), "lora_name": 3}) is None
    for bad_tokens in ([[1, 2, 3], [4, 5, 6, 7]], [[1, 2, 3, -4], [5, 6, 7, 8]], [[1, 2, 3, 1 << 32], [5, 6, 7, 8]]):
        bad = M.encode_meta_json({**chunk_meta(5, 0), "token_ids": bad_tokens})
        assert PoolChunk.from_meta(bad) is None and PoolChunk.from_meta(msgspec.json.decode(bad)) is None
