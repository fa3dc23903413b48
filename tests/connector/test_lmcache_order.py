"""Engines with and without LMCache's block kernel share objects, at any TP size, bit for bit.

LMCache's kernel writes its block order (``[2, layers, tokens, heads * head_size]``), the torch
copies write layer after layer of pages; both end with the format trailer, so each reads the
other's objects. No CUDA device here: the kernel is LMCache's own torch implementation of
``multi_layer_block_kv_transfer`` (real LMCache code with the compiled kernel's signature) over
CPU tensors, and `RecordingCompiledKernel` (test_gpu_path.py) is the named stand-in for the
compiled binding where what is checked is that it is never handed another format's bytes.
"""

from __future__ import annotations

import struct

import pytest
import torch

from maru_vllm.connector import worker as worker_module
from maru_vllm.connector.chunks import own_slice, rank_heads, splits_for
from maru_vllm.connector.layouts import KVCacheSet
from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
from maru_vllm.connector.object_format import (
    ORDER_LMCACHE,
    TRAILER_BYTES,
    HeadRange,
    ObjectFormat,
    read_format,
)
from maru_vllm.connector.page_layout import LayoutMismatch
from maru_vllm.connector.transfer import LMCacheBlockCopier, TorchPageCopier
from maru_vllm.launch.stack import PoolProcess
from tests.connector.chunk_meta import chunk_meta
from tests.connector.test_gpu_path import RecordingCompiledKernel
from tests.connector.test_object_format import BS as OF_BS
from tests.connector.test_object_format import DST as OF_DST
from tests.connector.test_object_format import HEADS as OF_HEADS
from tests.connector.test_object_format import LAYOUTS, _back_to_logical, _caches, _logical
from tests.connector.test_object_format import NB as OF_NB
from tests.connector.test_object_format import SRC as OF_SRC
from tests.connector.worker_side import worker_side

lmcache_torch = pytest.importorskip(
    "lmcache.v1.platform.torch_ops.mp_mem_kernels", reason="LMCache (make setup installs it) is needed for its kernels"
)

HEADS, LAYERS, BLOCKS, BS, HEAD_SIZE, BPC = 4, 3, 16, 8, 16, 2
HND = "LBHNC"  # vLLM 0.31's CPU layout: [block, head, token, K|V]


def full_cache(seed: int) -> dict[str, torch.Tensor]:
    """Every layer's pages of all 4 KV heads: ``[block, head, token, K|V]``."""
    torch.manual_seed(seed)
    return {f"layer{i}": torch.randn(BLOCKS, HEADS, BS, 2 * HEAD_SIZE).to(torch.bfloat16) for i in range(LAYERS)}


def rank_cache(full: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    return {name: t[:, lo:hi].clone() for name, t in full.items()}


def pages_copier(kv: dict[str, torch.Tensor], heads: HeadRange) -> TorchPageCopier:
    codec = KVCacheSet(kv, BS, num_blocks=BLOCKS, backend_name="CPU_ATTN")
    codec.use_format(heads)
    return TorchPageCopier(codec)


def lmcache_copier(kv: dict[str, torch.Tensor], heads: HeadRange, kernel=None) -> LMCacheBlockCopier:
    """LMCache's block copier over `kv`, with the torch copies for other formats (what the worker builds)."""
    return LMCacheBlockCopier(
        kernel or lmcache_torch.multi_layer_block_kv_transfer,
        kv,
        block_size=BS,
        num_blocks=BLOCKS,
        blocks_per_chunk=BPC,
        kv_layout=HND,
        heads=heads,
        pages=pages_copier(kv, heads),
    )


def all_heads() -> HeadRange:
    return HeadRange(0, HEADS, HEADS)


def packed(copier, block_ids: list[int]) -> bytearray:
    obj = bytearray(copier.chunk_nbytes(len(block_ids)))
    copier.pack(block_ids, memoryview(obj))
    return obj


def equal_blocks(dst: dict, dst_ids: list[int], src: dict, src_ids: list[int], lo: int = 0, hi: int = HEADS) -> bool:
    return all(torch.equal(dst[n][dst_ids], src[n][src_ids][:, lo:hi]) for n in dst)


def test_lmcache_objects_state_their_order_and_the_torch_copies_read_them() -> None:
    src, dst = full_cache(1), full_cache(2)
    obj = packed(lmcache_copier(src, all_heads()), [3, 4])
    written = read_format(torch.frombuffer(obj, dtype=torch.uint8))
    assert written.order == ORDER_LMCACHE and "lmcache-block" in written.describe()
    # vLLM 0.31's CPU pages keep K then V in one axis per head; LMCache's rows do too.
    assert written.axes == (("tokens", BS), ("heads", HEADS), ("kv", 2), ("dim", HEAD_SIZE))
    pages_copier(dst, all_heads()).unpack([9, 12], memoryview(obj))
    assert equal_blocks(dst, [9, 12], src, [3, 4])


def test_the_block_copier_reads_page_objects_without_handing_them_to_its_kernel() -> None:
    src, dst = full_cache(1), full_cache(2)
    obj = packed(pages_copier(src, all_heads()), [3, 4])
    kernel = RecordingCompiledKernel()
    reader = lmcache_copier(dst, all_heads(), kernel)
    reader.unpack([5, 6], memoryview(obj))
    reader.unpack_many([([7, 8], memoryview(obj), 0)])
    assert kernel.calls == []  # the kernel reads registered memory in its own order only
    assert equal_blocks(dst, [5, 6], src, [3, 4]) and equal_blocks(dst, [7, 8], src, [3, 4])
    # Its own objects still go to the kernel, in one launch.
    reader.unpack_many([([7, 8], memoryview(packed(lmcache_copier(src, all_heads()), [3, 4])), 0)])
    assert len(kernel.calls) == 1


# Each page layout of test_object_format with the name vLLM gives it (what tells LMCache's
# detector whether heads or tokens come first in a page).
VLLM_NAME = {
    "cpu_LBHNC": "LBHNC",
    "views_LBNHC": "LBNHC",
    "flash_attn_NHD": "LBNHC",
    "flash_attn_HND": "LBHNC",
    "flashinfer_NHD": "LBNHC",
    "flashinfer_HND": "LBHNC",
}


def _layout_copier(kind: str, layout: tuple, logical: list, kernel=None):
    name, build, backend = layout
    caches = _caches(build, logical)
    codec = KVCacheSet(caches, OF_BS, backend_name=backend)
    codec.use_format(OF_HEADS)
    if kind == "pages":
        return TorchPageCopier(codec), caches
    copier = LMCacheBlockCopier(
        kernel or lmcache_torch.multi_layer_block_kv_transfer,
        caches,
        block_size=OF_BS,
        num_blocks=OF_NB,
        blocks_per_chunk=len(OF_SRC),
        kv_layout=VLLM_NAME[name],
        heads=OF_HEADS,
        pages=TorchPageCopier(codec),
    )
    return copier, caches


@pytest.mark.parametrize("reader_kind", ["pages", "lmcache"])
@pytest.mark.parametrize("reader", LAYOUTS, ids=lambda c: c[0])
@pytest.mark.parametrize("writer", LAYOUTS, ids=lambda c: c[0])
def test_every_page_layout_pair_reads_lmcache_objects_bit_for_bit(writer, reader, reader_kind) -> None:
    """LMCache's kernel writes from each layout; torch copies and LMCache's kernel read in each."""
    logical = _logical(31)
    w, _ = _layout_copier("lmcache", writer, logical)
    obj = bytearray(w.chunk_nbytes(len(OF_SRC)))
    w.pack(OF_SRC, memoryview(obj))
    r, caches = _layout_copier(reader_kind, reader, _logical(32))
    r.unpack(OF_DST, memoryview(obj))
    for layer, t in enumerate(caches.values()):
        got = _back_to_logical(reader[1], t)
        for s, d in zip(OF_SRC, OF_DST):
            assert torch.equal(got[d].view(torch.int16), logical[layer][s].view(torch.int16)), (layer, s, d)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c[0])
def test_lmcache_reading_a_layout_otherwise_than_vllm_laid_it_out_is_refused(layout) -> None:
    # Told the other of heads-first and tokens-first, LMCache's detector reads the heads and
    # tokens of a page swapped: that copier is refused (the worker copies with torch instead).
    name, build, backend = layout
    caches = _caches(build, _logical(1))
    codec = KVCacheSet(caches, OF_BS, backend_name=backend)
    codec.use_format(OF_HEADS)
    wrong = "LBNHC" if VLLM_NAME[name] == "LBHNC" else "LBHNC"
    with pytest.raises(LayoutMismatch, match="LMCache's kernel reads these caches as"):
        LMCacheBlockCopier(
            lmcache_torch.multi_layer_block_kv_transfer,
            caches,
            block_size=OF_BS,
            num_blocks=OF_NB,
            blocks_per_chunk=2,
            kv_layout=wrong,
            heads=OF_HEADS,
            pages=TorchPageCopier(codec),
        )


def test_a_chunk_shared_in_part_and_skipped_blocks_read_from_lmcache_order() -> None:
    src, dst = full_cache(1), full_cache(2)
    obj = packed(lmcache_copier(src, all_heads()), [3, 4])
    before = dst["layer0"][10].clone()
    pages_copier(dst, all_heads()).unpack([11], memoryview(obj), skip_blocks=1)
    assert equal_blocks(dst, [11], src, [4]) and torch.equal(dst["layer0"][10], before)
    pages_copier(dst, all_heads()).unpack([13], memoryview(obj), chunk_blocks=2)
    assert equal_blocks(dst, [13], src, [3])


@pytest.mark.parametrize("reader", ["pages", "lmcache"])
def test_a_rank_takes_its_heads_out_of_a_coarser_lmcache_object(reader: str) -> None:
    full = full_cache(1)
    obj = packed(lmcache_copier(full, all_heads()), [3, 4])  # TP 1: all 4 heads
    for rank in range(2):  # TP 2 readers
        lo, hi = rank_heads(HEADS, 2, rank)
        mine = rank_cache(full_cache(7), lo, hi)
        heads = HeadRange(lo, hi, HEADS)
        copier = pages_copier(mine, heads) if reader == "pages" else lmcache_copier(mine, heads)
        copier.unpack([0, 1], memoryview(obj))
        assert equal_blocks(mine, [0, 1], full, [3, 4], lo, hi)


@pytest.mark.parametrize("writer", ["pages", "lmcache"])
def test_a_rank_assembles_its_heads_from_finer_objects_of_either_order(writer: str) -> None:
    full = full_cache(1)
    objs = []
    for rank in range(2):  # TP 2 writers, TP 1 reader
        lo, hi = rank_heads(HEADS, 2, rank)
        part, heads = rank_cache(full, lo, hi), HeadRange(lo, hi, HEADS)
        objs.append(packed(pages_copier(part, heads) if writer == "pages" else lmcache_copier(part, heads), [3, 4]))
    dst = full_cache(9)
    lmcache_copier(dst, all_heads()).unpack_heads([5, 6], [memoryview(o) for o in objs])
    assert equal_blocks(dst, [5, 6], full, [3, 4])


def test_what_cannot_be_read_is_a_miss_and_nothing_is_copied() -> None:
    src, dst = full_cache(1), full_cache(2)
    before = {n: t.clone() for n, t in dst.items()}
    good = packed(lmcache_copier(src, all_heads()), [3, 4])
    fmt = read_format(torch.frombuffer(good, dtype=torch.uint8))
    readers = [pages_copier(dst, all_heads()), lmcache_copier(dst, all_heads())]
    bad_objects = {
        # LMCache's block objects as they were before they had a trailer: the size does not match.
        "no trailer": good[:-TRAILER_BYTES],
        # Another dtype stated: never read as this engine's.
        "another dtype": good[:-TRAILER_BYTES] + ObjectFormat(**{**fmt.__dict__, "dtype": 3}).trailer(),
        # An order byte this code does not know.
        "unknown order": good[:-TRAILER_BYTES] + good[-TRAILER_BYTES:-54] + b"\x07" + good[-53:],
    }
    for why, obj in bad_objects.items():
        for reader in readers:
            with pytest.raises(LayoutMismatch):
                reader.unpack([0, 1], memoryview(bytearray(obj)))
            assert all(torch.equal(dst[n], before[n]) for n in dst), (why, type(reader).__name__)
    # A reader that predates the order byte reads bytes 8-11 as one layer count: 65,536 layers
    # more than it has, so it takes the object for another model's (a miss), not as pages.
    old_layers = struct.unpack_from("<I", good, len(good) - TRAILER_BYTES + 8)[0]
    assert old_layers == LAYERS + (ORDER_LMCACHE << 16)


# ---- worker sides over a real pool ----------------------------------------------------------------
@pytest.fixture
def lmcache_workers(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Worker sides built while this is active copy with LMCache's block copier (its torch
    kernel on CPU tensors) where their id is in the yielded set; the others with torch pages."""
    chosen: set[int] = set()
    real = worker_module.make_copier

    def make(codec, kv_caches, kernels, **kwargs):
        if id(kv_caches) in chosen:
            assert codec.format is not None
            return lmcache_copier(dict(kv_caches), codec.format.heads)
        return real(codec, kv_caches, kernels, **kwargs)

    monkeypatch.setattr(worker_module, "make_copier", make)
    return chosen


def engine(address: str, ns: str, tp: int, full: dict, lmcache: bool, chosen: set[int]) -> list[tuple]:
    splits = splits_for(HEADS, tp, 1, False)
    ranks = []
    for r in range(tp):
        lo, hi = rank_heads(HEADS, tp, r)
        caches = rank_cache(full, lo, hi)
        if lmcache:
            chosen.add(id(caches))
        side = worker_side(
            address,
            ns,
            caches,
            block_size=BS,
            num_blocks=BLOCKS,
            heads=HeadRange(lo, hi, HEADS),
            slot=own_slice(HEADS, tp, r, 0, False),
            splits=splits,
            blocks_per_chunk=BPC,
        )
        assert side.copier is not None and (type(side.copier) is LMCacheBlockCopier) == lmcache
        ranks.append((side, caches))
    return ranks


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        (("lmcache", 1), ("pages", 1)),
        (("pages", 1), ("lmcache", 1)),
        (("lmcache", 2), ("pages", 1)),
        (("pages", 1), ("lmcache", 2)),
        (("lmcache", 1), ("lmcache", 2)),
    ],
    ids=lambda e: f"{e[0]}-tp{e[1]}",
)
def test_engines_with_and_without_the_kernel_share_through_the_pool(
    pool: PoolProcess, lmcache_workers: set[int], writer: tuple[str, int], reader: tuple[str, int]
) -> None:
    ns = f"kv:test:lmo-{writer[0]}{writer[1]}-{reader[0]}{reader[1]}"
    written = full_cache(3)
    for side, _ in engine(pool.address, ns, writer[1], written, writer[0] == "lmcache", lmcache_workers):
        side.store(MaruConnectorMetadata(stores=[ChunkStore("w", b"chunk", [3, 4], chunk_meta(0))]))
        assert side.writer.wait(timeout=30)
        assert side.take_counters().chunks_stored == 1
    splits = splits_for(HEADS, reader[1], 1, False)
    split = next(i for i, s in enumerate(splits) if s.writer_tp == writer[1])
    for side, caches in engine(pool.address, ns, reader[1], full_cache(99), reader[0] == "lmcache", lmcache_workers):
        side.load(MaruConnectorMetadata(loads=[ChunkLoad("r", b"chunk", [10, 11], split=split)]))
        assert side.take_failed_blocks() == set()
        assert side.take_counters().chunks_loaded == 1
        assert equal_blocks(caches, [10, 11], written, [3, 4], side.heads.lo, side.heads.hi)


def test_mla_latent_objects_are_shared_between_lmcache_and_page_copies() -> None:
    gen = torch.Generator().manual_seed(5)
    latent = [torch.randint(-500, 500, (OF_NB, OF_BS, 96), generator=gen).to(torch.bfloat16) for _ in range(2)]
    src = {f"l{i}": t.clone() for i, t in enumerate(latent)}
    mla = HeadRange(0, 1, 1, True)
    codec = KVCacheSet(src, OF_BS, backend_name="FLASHMLA")
    codec.use_format(mla)
    writer = LMCacheBlockCopier(
        lmcache_torch.multi_layer_block_kv_transfer,
        src,
        block_size=OF_BS,
        num_blocks=OF_NB,
        blocks_per_chunk=len(OF_SRC),
        heads=mla,
        pages=TorchPageCopier(codec),
    )
    assert writer.object_format.axes == (("tokens", OF_BS), ("latent", 96))
    obj = bytearray(writer.chunk_nbytes(len(OF_SRC)))
    writer.pack(OF_SRC, memoryview(obj))
    four = {f"l{i}": torch.zeros(OF_NB, 1, OF_BS, 96, dtype=torch.bfloat16) for i in range(2)}
    reader = KVCacheSet(four, OF_BS, backend_name="CPU_MLA")
    reader.use_format(mla)
    reader.unpack(OF_DST, memoryview(obj))
    for i in range(2):
        for s, d in zip(OF_SRC, OF_DST):
            assert torch.equal(four[f"l{i}"][d, 0], latent[i][s])
    # A K/V engine never reads LMCache's MLA object.
    with pytest.raises(LayoutMismatch):
        pages_copier(full_cache(1), all_heads()).unpack([0, 1, 2], memoryview(obj))
