"""Engines of different TP sizes share chunks: each rank reads exactly its KV heads, over a real pool.

A "TP t engine" here is t worker sides over CPU caches holding their rank's share of 4 KV heads
(vLLM 0.31's CPU layout ``[blocks, heads, tokens, 2 * head_size]``), made from one full 4-head
cache, so what every rank must end up with after a load is known: its heads of the writer's
pages, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from maru_vllm.connector.chunks import Slice, own_slice, rank_heads, slices_to_read, splits_for
from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
from maru_vllm.connector.namespace import identity_from_vllm
from maru_vllm.connector.object_format import HeadRange
from maru_vllm.connector.parallel_place import ParallelPlace
from maru_vllm.connector.worker import MaruWorkerSide
from maru_vllm.launch.stack import PoolProcess
from tests.connector.chunk_meta import chunk_meta
from tests.connector.sched_harness import BLOCK_SIZE, make_vllm_config
from tests.connector.worker_side import worker_side

HEADS = 4
LAYERS = 2
BLOCKS = 16


def full_cache(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {f"layer{i}": torch.randn(BLOCKS, HEADS, 8, 32).to(torch.bfloat16) for i in range(LAYERS)}


def engine(address: str, ns: str, tp: int, full: dict[str, torch.Tensor]) -> list[tuple[MaruWorkerSide, dict]]:
    """The worker sides of a TP `tp` engine whose ranks hold their heads of `full`."""
    splits = splits_for(HEADS, tp, 1, False)
    ranks = []
    for r in range(tp):
        lo, hi = rank_heads(HEADS, tp, r)
        caches = {name: t[:, lo:hi].clone() for name, t in full.items()}
        side = worker_side(
            address,
            ns,
            caches,
            block_size=8,
            num_blocks=BLOCKS,
            heads=HeadRange(lo, hi, HEADS),
            slot=own_slice(HEADS, tp, r, 0, False),
            splits=splits,
        )
        ranks.append((side, caches))
    return ranks


def split_index(reader_tp: int, writer_tp: int) -> int:
    splits = splits_for(HEADS, reader_tp, 1, False)
    return next(i for i, s in enumerate(splits) if s.writer_tp == writer_tp)


def test_splits_name_heads_not_ranks() -> None:
    tp1, tp2 = splits_for(HEADS, 1, 1, False), splits_for(HEADS, 2, 1, False)
    assert [s.name for s in tp1[0].slices] == ["p0h0-4"]
    assert [s.name for s in tp2[0].slices] == ["p0h0-2", "p0h2-4"]
    # Each engine tries every other TP size's split after its own, each once.
    assert [s.writer_tp for s in tp1] == [1, 2, 4] and [s.writer_tp for s in tp2] == [2, 1, 4]
    # MLA: the latent is whole on every rank, so every TP size writes the same one slice.
    assert [[s.name for s in sp.slices] for sp in splits_for(1, 4, 1, True)] == [["p0h0-1"]]
    # Fewer KV heads than ranks: ranks holding the same (replicated) head share its object.
    assert [s.name for s in splits_for(2, 4, 1, False)[0].slices] == ["p0h0-1", "p0h1-2"]
    # A rank reads the slices that hold its heads, of its pipeline stage only.
    assert slices_to_read(tp2[0], Slice(0, 0, 4)) == list(tp2[0].slices)
    assert slices_to_read(tp1[0], Slice(0, 2, 4)) == [Slice(0, 0, 4)]
    assert slices_to_read(splits_for(HEADS, 1, 2, False)[0], Slice(1, 0, 4)) == [Slice(1, 0, 4)]


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1), (1, 4), (4, 2), (2, 4)])
def test_a_rank_loads_exactly_its_heads_from_another_tp_sizes_objects(
    pool: PoolProcess, writer_tp: int, reader_tp: int
) -> None:
    ns = f"kv:test:xtp{writer_tp}{reader_tp}"
    written = full_cache(writer_tp * 10 + reader_tp)
    writers = engine(pool.address, ns, writer_tp, written)
    for side, _ in writers:
        side.store(MaruConnectorMetadata(stores=[ChunkStore("w", b"chunk", [3, 4], chunk_meta(0))]))
        assert side.writer.wait(timeout=30)
        assert side.take_counters().chunks_stored == 1
    readers = engine(pool.address, ns, reader_tp, full_cache(99))
    split = split_index(reader_tp, writer_tp)
    for side, caches in readers:
        side.load(MaruConnectorMetadata(loads=[ChunkLoad("r", b"chunk", [10, 11], split=split)]))
        assert side.take_failed_blocks() == set()
        lo, hi = side.heads.lo, side.heads.hi
        for name, cache in caches.items():
            assert torch.equal(cache[10:12], written[name][3:5, lo:hi]), (name, lo, hi)


def test_a_missing_slice_is_a_miss_and_nothing_is_copied(pool: PoolProcess) -> None:
    ns = "kv:test:xtp-missing"
    written = full_cache(5)
    writers = engine(pool.address, ns, 2, written)
    side, _ = writers[0]  # rank 1 never stores its slice
    side.store(MaruConnectorMetadata(stores=[ChunkStore("w", b"chunk", [3, 4], chunk_meta(0))]))
    assert side.writer.wait(timeout=30)
    ((reader, caches),) = engine(pool.address, ns, 1, full_cache(6))
    before = {name: cache.clone() for name, cache in caches.items()}
    reader.load(MaruConnectorMetadata(loads=[ChunkLoad("r", b"chunk", [10, 11], split=split_index(1, 2))]))
    assert reader.take_failed_blocks() == {10, 11}
    assert all(torch.equal(caches[n], before[n]) for n in caches)
    # An unknown split (a scheduler of another layout) is a miss too, never another rank's bytes.
    reader.load(MaruConnectorMetadata(loads=[ChunkLoad("r", b"chunk", [12, 13], split=9)]))
    assert reader.take_failed_blocks() == {12, 13}


def _kv_cache_config(heads_per_rank: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=heads_per_rank, head_size=64, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def test_engines_of_every_tp_size_get_one_namespace_and_each_others_splits(tiny_model) -> None:
    """From vLLM's own configs: TP 1 and TP 2 engines of one model share a namespace (so the pool,
    and the router's credit, which follows the namespace), each tries the other's split."""
    config = make_vllm_config(tiny_model, "unix:///tmp/unused.sock")
    tp1 = identity_from_vllm(config, _kv_cache_config(2), "").namespace()
    place1 = ParallelPlace.of_engine(config)
    config.parallel_config.tensor_parallel_size = 2
    tp2 = identity_from_vllm(config, _kv_cache_config(1), "").namespace()
    place2 = ParallelPlace.of_engine(config)
    assert tp1 == tp2
    assert place1.slice.name == "p0h0-2" and place2.slice.name == "p0h0-1"  # scheduler-side view: rank 0
    assert [s.writer_tp for s in place1.splits()] == [1, 2]
    assert [s.writer_tp for s in place2.splits()] == [2, 1]
