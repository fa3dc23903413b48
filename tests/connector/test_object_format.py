"""The object format trailer: every pair of page layouts reads the other's objects bit for bit, or
misses; no load ever copies bytes in an order they were not written in (CPU tensors of each layout)."""

from __future__ import annotations

import itertools

import pytest
import torch

from maru_vllm.connector import namespace
from maru_vllm.connector.layouts import KVCacheSet
from maru_vllm.connector.object_format import (
    FORMAT_VERSION,
    KIND_OPAQUE,
    TRAILER_BYTES,
    HeadRange,
    ObjectFormat,
)
from maru_vllm.connector.page_layout import LayoutMismatch
from maru_vllm.native import ENV_NATIVE_COPY, copy_kernel
from maru_vllm.pool.objects import payload_checksum, payload_hasher

NB, BS, H, D = 10, 8, 4, 16
SRC = [3, 4, 7]
DST = [6, 0, 1]
HEADS = HeadRange(0, H, H)
MLA = HeadRange(0, 1, 1, True)


def _logical(seed, dtype=torch.float16, layers=3):
    """Per layer, the logical KV ``[NB, 2, BS, H, D]`` (block, K/V, token, head, dim)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-2000, 2000, (NB, 2, BS, H, D), generator=gen).to(dtype) for _ in range(layers)]


# Each layout vLLM hands over: (name, build(logical layer) -> cache tensor, backend name, to_logical).
def _cpu_0_31_hnc(kv):  # [B, H, N, C], C = K then V, heads before tokens (LBHNC)
    nb, _, bs, h, d = kv.shape
    return kv.permute(0, 3, 2, 1, 4).reshape(nb, h, bs, 2 * d).contiguous()


def _views_nhc(kv):  # [B, H, N, C] view over tokens-before-heads storage (LBNHC)
    nb, _, bs, h, d = kv.shape
    return kv.permute(0, 2, 3, 1, 4).reshape(nb, bs, h, 2 * d).contiguous().permute(0, 2, 1, 3)


def _flash_kv_first(kv):  # [2, B, N, H, D]
    return kv.permute(1, 0, 2, 3, 4).contiguous()


def _flash_kv_first_hnd(kv):  # [2, B, N, H, D] view over [2, B, H, N, D] storage
    return kv.permute(1, 0, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)


def _flashinfer(kv):  # [B, 2, N, H, D]
    return kv.contiguous()


def _flashinfer_hnd(kv):  # [B, 2, N, H, D] view over [B, 2, H, N, D] storage
    return kv.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)


LAYOUTS = [
    ("cpu_LBHNC", _cpu_0_31_hnc, "CPU_ATTN"),
    ("views_LBNHC", _views_nhc, "FLASH_ATTN"),
    ("flash_attn_NHD", _flash_kv_first, "FLASH_ATTN"),
    ("flash_attn_HND", _flash_kv_first_hnd, "FLASH_ATTN"),
    ("flashinfer_NHD", _flashinfer, "FLASHINFER"),
    ("flashinfer_HND", _flashinfer_hnd, "FLASHINFER"),
]


def _caches(build, logical):
    return {f"model.layers.{i}.attn": build(kv) for i, kv in enumerate(logical)}


def _codec(build, logical, backend, heads=HEADS):
    caches = _caches(build, logical)
    codec = KVCacheSet(caches, BS, backend_name=backend)
    codec.use_format(heads)
    return codec, caches


def _back_to_logical(build, tensor, h=H):
    """Recover the logical [NB, 2, BS, h, D] of one cache tensor built by `build`."""
    probe = torch.arange(NB * 2 * BS * h * D, dtype=torch.float64).reshape(NB, 2, BS, h, D)
    where = build(probe).reshape(-1).to(torch.int64)  # element i of the cache is logical where[i]
    out = torch.empty(NB * 2 * BS * h * D, dtype=tensor.dtype)
    out[where] = tensor.reshape(-1)
    return out.reshape(NB, 2, BS, h, D)


def _pack(codec, ids=SRC):
    buf = bytearray(codec.chunk_nbytes(len(ids)))
    codec.pack(ids, memoryview(buf))
    return bytes(buf)


@pytest.fixture(params=["native", "torch"])
def copier_path(request, monkeypatch):
    if request.param == "native":
        if copy_kernel() is None:
            pytest.skip("compiled copy kernel not built")
    else:
        monkeypatch.setenv(ENV_NATIVE_COPY, "0")
    return request.param


@pytest.mark.parametrize(
    ("writer", "reader"), list(itertools.product(LAYOUTS, LAYOUTS)), ids=lambda c: c[0] if isinstance(c, tuple) else c
)
def test_every_pair_of_layouts_reads_the_other_bit_for_bit(writer, reader, copier_path):
    src_logical = _logical(1)
    wcodec, _ = _codec(writer[1], src_logical, writer[2])
    payload = _pack(wcodec)
    assert len(payload) == 3 * len(SRC) * 2 * BS * H * D * 2 + TRAILER_BYTES
    rcodec, rcaches = _codec(reader[1], _logical(2), reader[2])
    before = [_back_to_logical(reader[1], t).clone() for t in rcaches.values()]
    hasher = payload_hasher()
    rcodec.unpack(DST, memoryview(payload), hasher=hasher)
    assert hasher.checksum() == payload_checksum(payload)
    for layer, (t, old) in enumerate(zip(rcaches.values(), before)):
        got = _back_to_logical(reader[1], t)
        for s, d in zip(SRC, DST):
            assert torch.equal(got[d].view(torch.int16), src_logical[layer][s].view(torch.int16)), (layer, s, d)
        for b in range(NB):
            if b not in DST:
                assert torch.equal(got[b].view(torch.int16), old[b].view(torch.int16))


def test_fused_and_split_kv_and_both_head_orders_describe_the_same_axes():
    formats = {name: _codec(build, _logical(1), backend)[0].format for name, build, backend in LAYOUTS}
    assert {tuple(sorted(f.axes)) for f in formats.values()} == {
        tuple(sorted((("kv", 2), ("tokens", BS), ("heads", H), ("dim", D))))
    }
    assert formats["cpu_LBHNC"].axes == (("heads", H), ("tokens", BS), ("kv", 2), ("dim", D))
    # K/V outside the page's tokens (FlashAttention's [2, B, ...], FlashInfer's [B, 2, ...]): one format.
    assert formats["flash_attn_NHD"] == formats["flashinfer_NHD"]
    assert formats["flash_attn_NHD"].axes == (("kv", 2), ("tokens", BS), ("heads", H), ("dim", D))
    assert formats["views_LBNHC"].axes == (("tokens", BS), ("heads", H), ("kv", 2), ("dim", D))
    for f in formats.values():
        assert ObjectFormat.from_trailer(f.trailer()) == f
        assert f.version == FORMAT_VERSION == namespace.OBJECT_FORMAT


def _misses(reader_codec, payload):
    with pytest.raises(LayoutMismatch):
        reader_codec.unpack(DST, memoryview(payload), hasher=payload_hasher())


def test_another_dtype_head_range_or_old_object_is_a_miss(copier_path):
    build, backend = _cpu_0_31_hnc, "CPU_ATTN"
    w, _ = _codec(build, _logical(1), backend)
    payload = _pack(w)
    # Another KV head range (another TP rank's or TP size's slice), same sizes.
    other_rank, caches = _codec(build, _logical(2), backend, heads=HeadRange(H, 2 * H, 2 * H))
    before = {n: t.clone() for n, t in caches.items()}
    _misses(other_rank, payload)
    assert all(torch.equal(before[n], t) for n, t in caches.items()), "nothing is copied before the check"
    # Another dtype of the same byte size.
    bf, _ = _codec(build, [t.to(torch.bfloat16) for t in _logical(2)], backend)
    _misses(bf, payload)
    # An object of the older format (no trailer): its size is already not what a reader expects,
    # and the same size without a valid trailer is refused too.
    old = KVCacheSet(_caches(build, _logical(1)), BS, backend_name=backend)
    old_payload = _pack(old)
    with pytest.raises(LayoutMismatch):
        w.unpack(DST, memoryview(old_payload))
    _misses(w, old_payload + bytes(TRAILER_BYTES))
    # A trailer of a version this code does not read.
    bumped = bytearray(payload)
    bumped[-TRAILER_BYTES + 4] = FORMAT_VERSION + 1
    _misses(w, bytes(bumped))


def test_mla_3d_and_4d_caches_share_objects_as_they_are():
    gen = torch.Generator().manual_seed(5)
    latent = [torch.randint(-500, 500, (NB, BS, 96), generator=gen).to(torch.bfloat16) for _ in range(2)]
    three = {f"l{i}": t.clone() for i, t in enumerate(latent)}
    four = {f"l{i}": torch.zeros(NB, 1, BS, 96, dtype=torch.bfloat16) for i in range(2)}
    a = KVCacheSet(three, BS, backend_name="FLASHMLA")
    b = KVCacheSet(four, BS, backend_name="CPU_MLA")
    assert a.use_format(MLA) == b.use_format(MLA)
    assert a.format is not None and a.format.axes == (("tokens", BS), ("latent", 96))
    b.unpack(DST, memoryview(_pack(a)))
    for i in range(2):
        for s, d in zip(SRC, DST):
            assert torch.equal(four[f"l{i}"][d, 0], latent[i][s])
    # A K/V engine never reads an MLA object, and the other way round.
    kv, _ = _codec(_cpu_0_31_hnc, _logical(1), "CPU_ATTN")
    with pytest.raises(LayoutMismatch):
        b.unpack(DST, memoryview(_pack(kv)))


def test_kernel_block_split_is_part_of_the_format():
    logical = _logical(3, layers=2)
    whole = _codec(_cpu_0_31_hnc, logical, "CPU_ATTN")[0]
    split_caches = {
        n: t.reshape(NB, H, 2, BS // 2, 2 * D).permute(0, 2, 1, 3, 4).reshape(2 * NB, H, BS // 2, 2 * D).contiguous()
        for n, t in _caches(_cpu_0_31_hnc, logical).items()
    }
    split = KVCacheSet(split_caches, BS, num_blocks=NB, backend_name="FLASH_ATTN")
    split.use_format(HEADS)
    assert split.format is not None and split.format.group == 2 and ("tgroup", 2) in split.format.axes
    with pytest.raises(LayoutMismatch):
        split.unpack(DST, memoryview(_pack(whole)))
    with pytest.raises(LayoutMismatch):
        whole.unpack(DST, memoryview(_pack(split)))


def test_layers_of_different_geometry_are_opaque_and_read_only_by_their_own_format():
    gen = torch.Generator().manual_seed(7)
    caches = {
        "a": torch.randint(-9, 9, (NB, H, BS, 2 * D), generator=gen).to(torch.float16),
        "b": torch.randint(-9, 9, (NB, H, BS, 4 * D), generator=gen).to(torch.float16),
    }
    a = KVCacheSet(caches, BS, backend_name="CPU_ATTN")
    fmt = a.use_format(HEADS)
    assert fmt.kind == KIND_OPAQUE
    b = KVCacheSet({n: torch.zeros_like(t) for n, t in caches.items()}, BS, backend_name="CPU_ATTN")
    b.use_format(HEADS)
    b.unpack(DST, memoryview(_pack(a)))


def test_batched_loads_fall_back_chunk_by_chunk_for_a_foreign_order(copier_path):
    from maru_vllm.connector.copier import WholeChunk
    from maru_vllm.connector.transfer import TorchPageCopier

    w, _ = _codec(_views_nhc, _logical(1), "FLASH_ATTN")
    r, _ = _codec(_cpu_0_31_hnc, _logical(2), "CPU_ATTN")
    copier = TorchPageCopier(r)
    items = [WholeChunk(DST, memoryview(_pack(w)), 0, True)]
    if copier_path == "native":
        with pytest.raises(LayoutMismatch):
            copier.unpack_whole_many(items)
    same = [WholeChunk(DST, memoryview(_pack(r, ids=[1, 2, 5])), 0, True)]
    digests = copier.unpack_whole_many(same)
    if copier_path == "native":
        assert digests is not None and digests[0] is not None


@pytest.mark.parametrize(
    ("total", "tp", "expect"),
    [
        (8, 1, [(0, 8)]),
        (8, 2, [(0, 4), (4, 8)]),
        (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
        (1, 2, [(0, 1), (0, 1)]),
    ],
)
def test_head_range_follows_vllms_split(total, tp, expect):
    assert [(r.lo, r.hi) for r in (HeadRange.for_rank(total, tp, k) for k in range(tp))] == expect
    assert HeadRange.for_rank(total, tp, 0, mla=True) == MLA


VLLM_LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


@pytest.mark.parametrize(("writer", "reader"), list(itertools.product(VLLM_LAYOUTS, VLLM_LAYOUTS)))
def test_every_vllm_kv_cache_layout_pair_reads_bit_for_bit(writer, reader):
    """vLLM's own allocation and ``[B, H, N, C]`` views, for each of its `KVCacheLayout`s."""
    vkv = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from tests.connector.test_layouts import _vllm_views

    spec = vkv.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float16)
    a = _vllm_views(vkv, spec, KVCacheLayout[writer], NB, 3, seed=11)
    b = _vllm_views(vkv, spec, KVCacheLayout[reader], NB, 3, seed=-1)
    heads = HeadRange(0, 2, 2)
    wa, rb = KVCacheSet(a, BS, backend_name="FLASH_ATTN"), KVCacheSet(b, BS, backend_name="FLASH_ATTN")
    wa.use_format(heads)
    rb.use_format(heads)
    rb.unpack(DST, memoryview(_pack(wa)), hasher=payload_hasher())
    for name in a:  # the views are logical [B, H, N, C] whatever the storage order
        for s, d in zip(SRC, DST):
            assert torch.equal(b[name][d].view(torch.int16), a[name][s].view(torch.int16)), (name, s, d)


def _rank_codec(build, backend, logical, total, tp, rank):
    heads = HeadRange.for_rank(total, tp, rank)
    mine = [kv[:, :, :, heads.lo : heads.hi].contiguous() for kv in logical]
    codec, caches = _codec(build, mine, backend, heads=heads)
    return codec, caches, heads


def _assert_heads(build, caches, logical, heads):
    for layer, t in enumerate(caches.values()):
        got = _back_to_logical(build, t, heads.hi - heads.lo)
        for s, d in zip(SRC, DST):
            want = logical[layer][s][:, :, heads.lo : heads.hi]
            assert torch.equal(got[d].view(torch.int16), want.view(torch.int16)), (layer, s, d)


@pytest.mark.parametrize("reader", LAYOUTS, ids=lambda c: c[0])
@pytest.mark.parametrize("writer", LAYOUTS[:3], ids=lambda c: c[0])
def test_a_rank_reads_its_heads_out_of_a_coarser_split(writer, reader):
    logical = _logical(21)
    w, _, _ = _rank_codec(writer[1], writer[2], logical, H, 1, 0)
    payload = _pack(w)
    for tp in (2, 4, 8):  # 8 > H: replicated heads (GQA)
        for rank in range(tp):
            r, caches, heads = _rank_codec(reader[1], reader[2], _logical(22), H, tp, rank)
            hasher = payload_hasher()
            r.unpack(DST, memoryview(payload), hasher=hasher)
            assert hasher.checksum() == payload_checksum(payload)
            _assert_heads(reader[1], caches, logical, heads)


@pytest.mark.parametrize("reader", LAYOUTS, ids=lambda c: c[0])
@pytest.mark.parametrize("writer", LAYOUTS[:3], ids=lambda c: c[0])
def test_a_rank_reads_its_heads_out_of_a_finer_split(writer, reader):
    logical = _logical(31)
    for wtp, rtp in ((2, 1), (4, 1), (4, 2)):
        payloads = [_pack(_rank_codec(writer[1], writer[2], logical, H, wtp, k)[0]) for k in range(wtp)]
        for rank in range(rtp):
            r, caches, heads = _rank_codec(reader[1], reader[2], _logical(32), H, rtp, rank)
            mine = [p for p, k in zip(payloads, range(wtp)) if heads.lo <= k * H // wtp < heads.hi]
            r.unpack_heads(DST, [memoryview(p) for p in mine])
            _assert_heads(reader[1], caches, logical, heads)
            with pytest.raises(LayoutMismatch):  # one part missing: nothing is read
                r.unpack_heads(DST, [memoryview(p) for p in mine[1:]])
            with pytest.raises(LayoutMismatch):  # a finer object alone is not this rank's heads
                r.unpack(DST, memoryview(mine[0]))


def test_heads_outside_the_object_or_of_another_model_are_misses():
    logical = _logical(41)
    w, _, _ = _rank_codec(_cpu_0_31_hnc, "CPU_ATTN", logical, H, 2, 0)  # heads 0-2
    r, caches, _ = _rank_codec(_cpu_0_31_hnc, "CPU_ATTN", _logical(42), H, 2, 1)  # heads 2-4
    before = {n: t.clone() for n, t in caches.items()}
    _misses(r, _pack(w))
    assert all(torch.equal(before[n], t) for n, t in caches.items())
    other_model, _ = _codec(
        _cpu_0_31_hnc, [kv[:, :, :, :2].contiguous() for kv in logical], "CPU_ATTN", heads=HeadRange(0, 2, 2)
    )
    _misses(r, _pack(other_model))


def test_device_staged_copies_write_and_check_the_trailer():
    """The GPU path's staged copies (run here on CPU tensors) make the page path's objects,
    trailer included, and read other page orders through the same checks."""
    logical = _logical(51)
    cs, _ = _codec(_cpu_0_31_hnc, logical, "CPU_ATTN")
    page = _pack(cs)
    staged = bytearray(len(page))
    cs.staged_pack(SRC, memoryview(staged))
    assert bytes(staged) == page
    r, caches = _codec(_views_nhc, _logical(52), "FLASH_ATTN")
    r.staged_unpack(DST, memoryview(page))
    _assert_heads(_views_nhc, caches, logical, HEADS)
    other, _ = _codec(_cpu_0_31_hnc, _logical(53), "CPU_ATTN", heads=HeadRange(0, H, 2 * H))
    with pytest.raises(LayoutMismatch):
        other.staged_unpack(DST, memoryview(page))
