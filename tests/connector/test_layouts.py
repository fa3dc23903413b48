"""Round-trip tests for maru_vllm.connector.layouts on CPU tensors of every layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from maru_vllm.connector.layouts import KVCacheSet
from maru_vllm.connector.page_layout import (
    AmbiguousLayout,
    LayoutError,
    LayoutMismatch,
    PageLayout,
    block_runs,
    layout_for_backend,
)

NB, BS, H, D = 12, 16, 4, 32
SRC_IDS = [3, 4, 5, 9]
DST_IDS = [7, 0, 1, 10]  # other ids, not in order, partly consecutive


def _rand(shape, dtype, gen):
    if dtype in (torch.uint8,) or (dtype.is_floating_point and dtype.itemsize == 1):
        return torch.randint(1, 255, shape, dtype=torch.uint8, generator=gen).view(dtype)
    return (torch.rand(shape, generator=gen) + 0.5).to(dtype)  # never zero


# name, storage shape, permute to logical, block dim, backend, group (kernel blocks)
CASES = [
    ("cpu_0_31_LBHNC", (NB, H, BS, 2 * D), None, 0, "CPU_ATTN", 1),
    ("views_LBNHC", (NB, BS, H, 2 * D), (0, 2, 1, 3), 0, "FLASH_ATTN", 1),
    ("views_LHBNC", (H, NB, BS, 2 * D), (1, 0, 2, 3), 0, "ROCM_ATTN", 1),
    ("flash_attn_2_nb", (2, NB, BS, H, D), None, 1, "FLASH_ATTN", 1),
    ("flash_attn_HND", (2, NB, H, BS, D), (0, 1, 3, 2, 4), 1, "FLASH_ATTN", 1),
    ("flashinfer_nb_2", (NB, 2, BS, H, D), None, 0, "FLASHINFER", 1),
    ("flashinfer_HND", (NB, 2, H, BS, D), (0, 1, 3, 2, 4), 0, "FLASHINFER", 1),
    ("triton_nb_2", (NB, 2, BS, H, D), None, 0, "TRITON_ATTN", 1),
    ("mla_3d", (NB, BS, 576), None, 0, "FLASHMLA", 1),
    ("mla_4d_0_31", (NB, 1, BS, 576), None, 0, "CPU_MLA", 1),
    ("kernel_split_x2", (2 * NB, H, BS // 2, 2 * D), None, 0, "FLASH_ATTN", 2),
]


def _make(case, dtype, seed, zero=False, layers=3):
    _, shape, perm, _, _, _ = case
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        t = torch.zeros(shape, dtype=dtype) if zero else _rand(shape, dtype, gen)
        out[f"model.layers.{i}.self_attn.attn"] = t.permute(perm) if perm else t
    return out


def _page(t, bd, group, b):
    if group > 1:
        t = t.unflatten(bd, (-1, group))
    return t.select(bd, b)


def _eq(a, b):
    """Bitwise equality (random int8 bytes viewed as bf16 contain NaNs)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _roundtrip(caches_a, caches_b, block_size, bd, group, **kw):
    a = KVCacheSet(caches_a, block_size, **kw)
    b = KVCacheSet(caches_b, block_size, **kw)
    assert a.layout_signature() == b.layout_signature()
    before = {n: t.clone() for n, t in caches_b.items()}
    buf = bytearray(a.chunk_nbytes(len(SRC_IDS)))
    assert a.pack(SRC_IDS, memoryview(buf)) == len(buf)
    b.unpack(DST_IDS, memoryview(bytes(buf)))  # read-only source, like the pool
    for name, tb in caches_b.items():
        ta = caches_a[name]
        for s, d in zip(SRC_IDS, DST_IDS):
            assert _eq(_page(tb, bd, group, d), _page(ta, bd, group, s)), (name, s, d)
        untouched = [x for x in range(b.num_blocks) if x not in DST_IDS]
        for x in untouched:
            assert _eq(_page(tb, bd, group, x), _page(before[name], bd, group, x)), (name, x)
    return a, buf


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_roundtrip_every_layout(case):
    _name, _, _, bd, backend, group = case
    a = _make(case, torch.bfloat16, seed=1)
    b = _make(case, torch.bfloat16, seed=2, zero=True)
    num_blocks = NB if group > 1 else None
    codec, buf = _roundtrip(a, b, BS, bd, group, backend_name=backend, num_blocks=num_blocks)
    t0 = next(iter(a.values()))
    page_bytes = t0.numel() * t0.element_size() // NB
    assert codec.bytes_per_block == 3 * page_bytes
    assert len(buf) == 4 * 3 * page_bytes
    # Object format: layer after layer, pages contiguous per layer, in block order:
    # the first page-sized slice holds exactly layer 0's page SRC_IDS[0] ...
    first = _page(t0, bd, group, SRC_IDS[0])
    got = torch.frombuffer(buf[:page_bytes], dtype=torch.bfloat16)
    assert torch.equal(got.sort().values, first.reshape(-1).sort().values)
    # ... and the last one layer 2's page SRC_IDS[-1].
    last = _page(list(a.values())[-1], bd, group, SRC_IDS[-1])
    got = torch.frombuffer(buf[-page_bytes:], dtype=torch.bfloat16)
    assert torch.equal(got.sort().values, last.reshape(-1).sort().values)
    if case[2] is None and bd == 0:  # storage order == logical order: plain bytes
        assert torch.equal(torch.frombuffer(buf[:page_bytes], dtype=torch.bfloat16), first.reshape(-1))


@pytest.mark.parametrize("case", CASES[:1] + CASES[3:4] + CASES[8:9], ids=lambda c: c[0])
def test_roundtrip_detection_without_backend_hint(case):
    _, _, _, bd, _, group = case
    _roundtrip(_make(case, torch.float16, 3), _make(case, torch.float16, 4, zero=True), BS, bd, group)


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: c[0])
def test_roundtrip_dtypes(case, dtype):
    _, _, _, bd, backend, group = case
    codec, _buf = _roundtrip(
        _make(case, dtype, 5), _make(case, dtype, 6, zero=True), BS, bd, group, backend_name=backend
    )
    assert str(dtype).removeprefix("torch.") in codec.layout_signature()


def test_shared_single_allocation_uses_one_stacked_copy_and_roundtrips():
    """vLLM 0.31 style: all layers are views of one buffer at a constant stride."""
    L = 4
    for alloc, view in (
        ((L, NB, H, BS, 2 * D), lambda big, i: big[i]),  # layer-outermost (LBHNC)
        ((NB, L, H, BS, 2 * D), lambda big, i: big[:, i]),  # block-outermost (BLHNC)
    ):
        big_a = _rand(alloc, torch.bfloat16, torch.Generator().manual_seed(7))
        big_b = torch.zeros(alloc, dtype=torch.bfloat16)
        a = {f"l{i}": view(big_a, i) for i in range(L)}
        b = {f"l{i}": view(big_b, i) for i in range(L)}
        codec, _ = _roundtrip(a, b, BS, 0, 1)
        assert codec._stack is not None
        assert codec.bytes_per_block == L * H * BS * 2 * D * 2


def test_single_allocation_and_separate_tensors_exchange_objects():
    """Same geometry, different allocation (stacked vs per-layer copy): same bytes."""
    L = 3
    big = _rand((L, NB, H, BS, 2 * D), torch.float16, torch.Generator().manual_seed(11))
    a = {f"l{i}": big[i] for i in range(L)}
    b = {f"l{i}": torch.zeros(NB, H, BS, 2 * D, dtype=torch.float16) for i in range(L)}
    codec_a, buf = _roundtrip(a, b, BS, 0, 1)
    codec_b = KVCacheSet(b, BS)
    assert codec_a._stack is not None and codec_b._stack is None
    again = bytearray(len(buf))
    codec_b.pack(DST_IDS, again)
    assert again == buf


def test_shared_storage_layers_copied_once():
    gen = torch.Generator().manual_seed(8)
    shared_a = _rand((NB, H, BS, 2 * D), torch.float16, gen)
    other_a = _rand((NB, H, BS, 2 * D), torch.float16, gen)
    shared_b = torch.zeros_like(shared_a)
    other_b = torch.zeros_like(other_a)
    # Same tensor twice and a second view object over the same bytes.
    a = {"l0": shared_a, "l1": shared_a.view(shared_a.shape), "l2": other_a}
    b = {"l0": shared_b, "l1": shared_b.view(shared_b.shape), "l2": other_b}
    codec, _buf = _roundtrip(a, b, BS, 0, 1)
    page = H * BS * 2 * D * 2
    assert codec.bytes_per_block == 2 * page
    assert codec.unique_layers == ("l0", "l2")
    assert codec.aliases == {"l0": "l0", "l1": "l0", "l2": "l2"}
    assert "layers=2;" in codec.layout_signature()
    for s, d in zip(SRC_IDS, DST_IDS):
        assert torch.equal(b["l1"][d], shared_a[s])


def test_wrong_size_buffer_raises_layout_mismatch():
    case = CASES[0]
    codec = KVCacheSet(_make(case, torch.float16, 9), BS)
    n = codec.chunk_nbytes(len(SRC_IDS))
    for size in (n - 1, n + 1, 0, codec.chunk_nbytes(len(SRC_IDS) - 1)):
        with pytest.raises(LayoutMismatch, match=f"{n} expected"):
            codec.unpack(SRC_IDS, memoryview(bytes(size)))
        with pytest.raises(LayoutMismatch):
            codec.pack(SRC_IDS, bytearray(size))
    with pytest.raises(LayoutMismatch, match="writable"):
        codec.pack(SRC_IDS, memoryview(bytes(n)))
    # An object written with another geometry (bf16 vs fp16: same size!) is only
    # caught by the signature, which must differ.
    other = KVCacheSet(_make(case, torch.bfloat16, 9), BS)
    assert other.chunk_nbytes(4) == n
    assert other.layout_signature() != codec.layout_signature()


def test_pack_into_uint8_tensor_and_block_id_range():
    case = CASES[0]
    caches = _make(case, torch.float32, 10)
    codec = KVCacheSet(caches, BS)
    out = torch.empty(codec.chunk_nbytes(2), dtype=torch.uint8)
    codec.pack([11, 0], out)
    first = next(iter(caches.values()))
    assert torch.equal(out[: first[11].numel() * 4].view(torch.float32), first[11].reshape(-1))
    with pytest.raises(IndexError, match="12"):
        codec.pack([12, 0], out)
    assert codec.pack([], bytearray()) == 0


def test_ambiguous_shape_error_names_shape_and_supported_layouts():
    t = torch.zeros(2, 2, BS, H, D)  # [2, NB=2, ...] or [NB=2, 2, ...]?
    with pytest.raises(AmbiguousLayout) as err:
        PageLayout.detect(t, BS)
    msg = str(err.value)
    assert "[2, 2, 16, 4, 32]" in msg and "ambiguous" in msg
    assert "Supported:" in msg and "[2, B, N, H, D]" in msg and "backend" in msg
    with pytest.raises(AmbiguousLayout):
        KVCacheSet({"l0": t}, BS)
    # The backend name settles it.
    assert layout_for_backend("FLASH_ATTN", t, BS).block_dim == 1
    assert layout_for_backend("FLASHINFER", t, BS).block_dim == 0
    assert KVCacheSet({"l0": t}, BS, block_dims={"l0": 1}).layouts["l0"].block_dim == 1


def test_unsupported_shape_errors_name_the_layer():
    with pytest.raises(LayoutError, match=r"layer 'bad'.*\[3, 5\].*unsupported"):
        KVCacheSet({"bad": torch.zeros(3, 5)}, BS)
    with pytest.raises(LayoutError, match="num_blocks"):
        KVCacheSet({"a": torch.zeros(NB, H, BS, D), "b": torch.zeros(NB + 1, H, BS, D)}, BS)


def test_signature_ignores_num_blocks_but_not_geometry():
    def sig(shape, perm=None, dtype=torch.float16, layers=2):
        t = torch.zeros(shape, dtype=dtype)
        t = t.permute(perm) if perm else t
        return KVCacheSet({f"l{i}": t.clone() if not perm else t + 0 for i in range(layers)}, BS).layout_signature()

    base = sig((NB, H, BS, 2 * D))
    assert base == sig((NB + 30, H, BS, 2 * D))
    assert base.startswith("maru-pages/v1;layers=2;2*(")
    assert base != sig((NB, H, BS, 2 * D), layers=3)
    assert base != sig((NB, H, BS, 2 * D), dtype=torch.bfloat16)
    assert base != sig((NB, H, BS, 4 * D))
    lbnhc = KVCacheSet({"l": torch.zeros(NB, BS, H, 2 * D).permute(0, 2, 1, 3)}, BS)
    lbhnc = KVCacheSet({"l": torch.zeros(NB, H, BS, 2 * D)}, BS)
    assert lbnhc.layout_signature() != lbhnc.layout_signature()


def test_block_runs_groups_consecutive_ids():
    assert block_runs([]) == []
    assert block_runs([3, 4, 5, 9]) == [(3, 0, 3), (9, 3, 1)]
    assert block_runs([7, 0, 1, 10]) == [(7, 0, 1), (0, 1, 2), (10, 3, 1)]
    assert block_runs([0, 0]) == [(0, 0, 1), (0, 1, 1)]


@pytest.fixture(scope="module")
def vkv():
    return pytest.importorskip("vllm.v1.kv_cache_interface")


def _vllm_views(vkv, spec, layout, num_blocks, layers, seed, kernel_block_size=None):
    """Allocate like vLLM's worker: one int8 buffer, per-layer [B, H, N, C] views."""
    page = spec.page_size_bytes
    interleaved = layers * page if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = vkv.compute_layout_strides(
        spec, num_blocks, layers, layout, fixed_strides=(None, interleaved, None, None, None)
    )
    names = [f"model.layers.{i}.attn" for i in range(layers)]
    kvt = vkv.KVCacheTensor(
        size=page * num_blocks * layers, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-100, 100, (kvt.size,), dtype=torch.int8, generator=gen)
    if seed < 0:
        raw.zero_()
    views = vkv.create_kv_cache_views(raw, spec, num_blocks, layout, kvt, kernel_block_size=kernel_block_size)
    return dict(zip(names, views))


def test_vllm_cpu_backend_layout_roundtrip(vkv):
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    backend = cpu_attn.CPUAttentionBackend
    (layout,) = backend.supported_kv_cache_layouts()
    spec = vkv.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    a = _vllm_views(vkv, spec, layout, 12, 3, seed=1)
    b = _vllm_views(vkv, spec, layout, 16, 3, seed=-1)  # other instance, more blocks
    t = next(iter(a.values()))
    assert tuple(t.shape) == (12, 2, BS, 128), "vLLM changed the CPU cache view shape"
    codec, _ = _roundtrip(a, b, BS, 0, 1, backend_name=backend.get_name())
    assert codec.bytes_per_block == 3 * spec.page_size_bytes


@pytest.mark.parametrize("layout_name", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_vllm_every_kv_cache_layout_roundtrip(vkv, layout_name):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = vkv.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float16)
    a = _vllm_views(vkv, spec, layout, 12, 3, seed=2)
    b = _vllm_views(vkv, spec, layout, 12, 3, seed=-1)
    codec, _ = _roundtrip(a, b, BS, 0, 1, backend_name="FLASH_ATTN")
    assert codec.bytes_per_block == 3 * spec.page_size_bytes
    if layout.is_block_compact:
        # Each page is one run of bytes and layers are equally spaced: one copy per run.
        assert codec._stack is not None


def test_vllm_mla_and_kernel_block_split(vkv):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    mla = vkv.MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    a = _vllm_views(vkv, mla, KVCacheLayout.LBHNC, 12, 2, seed=3)
    b = _vllm_views(vkv, mla, KVCacheLayout.LBHNC, 12, 2, seed=-1)
    assert tuple(next(iter(a.values())).shape) == (12, 1, BS, 576)
    _roundtrip(a, b, BS, 0, 1, backend_name="FLASHMLA")

    spec = vkv.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float16)
    a = _vllm_views(vkv, spec, KVCacheLayout.LBHNC, 12, 2, seed=4, kernel_block_size=BS // 2)
    b = _vllm_views(vkv, spec, KVCacheLayout.LBHNC, 12, 2, seed=-1, kernel_block_size=BS // 2)
    assert next(iter(a.values())).shape[0] == 24  # kernel blocks, not manager blocks
    codec, _ = _roundtrip(a, b, BS, 0, 2, num_blocks=12)
    assert codec.num_blocks == 12 and codec.bytes_per_block == 2 * spec.page_size_bytes


def test_vllm_forward_context_has_no_virtual_engine():
    """If vLLM brings the field back, resolve_layer_kv callers must pass it."""
    fc = pytest.importorskip("vllm.forward_context")
    names = {f.name for f in dataclasses.fields(fc.ForwardContext)}
    assert "virtual_engine" not in names


def test_unpack_skips_leading_blocks_of_a_chunk() -> None:
    """A chunk whose first blocks the engine already has locally: only the rest is written."""
    torch.manual_seed(3)
    src = {f"l{i}": torch.randn(12, 2, 16, 8) for i in range(3)}
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    a = KVCacheSet(src, 16, num_blocks=12)
    b = KVCacheSet(dst, 16, num_blocks=12)
    buf = bytearray(a.chunk_nbytes(4))
    a.pack([2, 3, 4, 5], buf)
    b.unpack([9, 10], memoryview(bytes(buf)), skip_blocks=2)
    for name in src:
        assert torch.equal(dst[name][9], src[name][4])
        assert torch.equal(dst[name][10], src[name][5])
        others = [i for i in range(12) if i not in (9, 10)]
        assert torch.count_nonzero(dst[name][others]) == 0
    with pytest.raises(LayoutMismatch):
        b.unpack([9, 10], memoryview(bytes(buf)), skip_blocks=1)


@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "single-allocation"])
def test_unpack_reads_a_block_range_out_of_a_longer_chunk(stacked) -> None:
    """A chunk shared in part: blocks [skip, skip + n) of every layer, out of the layer-major object."""
    L, nb = 3, 12
    g = torch.Generator().manual_seed(5)
    if stacked:
        big_src = torch.randn(L, nb, 2, 16, 8, generator=g)
        big_dst = torch.zeros_like(big_src)
        src = {f"l{i}": big_src[i] for i in range(L)}
        dst = {f"l{i}": big_dst[i] for i in range(L)}
    else:
        src = {f"l{i}": torch.randn(nb, 2, 16, 8, generator=g) for i in range(L)}
        dst = {name: torch.zeros_like(t) for name, t in src.items()}
    a = KVCacheSet(src, 16, num_blocks=nb)
    b = KVCacheSet(dst, 16, num_blocks=nb)
    assert (a._stack is not None) == stacked
    buf = bytes(_packed(a, [2, 3, 4, 5]))
    b.unpack([9, 10], memoryview(buf), skip_blocks=1, chunk_blocks=4)  # blocks 1 and 2 of the chunk
    b.unpack([7], memoryview(buf), chunk_blocks=4)  # block 0 only
    for name in src:
        assert torch.equal(dst[name][9], src[name][3]) and torch.equal(dst[name][10], src[name][4])
        assert torch.equal(dst[name][7], src[name][2])
        assert torch.count_nonzero(dst[name][[i for i in range(nb) if i not in (7, 9, 10)]]) == 0
    with pytest.raises(ValueError, match=r"blocks \[3, 5\) are not all in a chunk of 4 blocks"):
        b.unpack([9, 10], memoryview(buf), skip_blocks=3, chunk_blocks=4)
    with pytest.raises(LayoutMismatch):  # the object is not a chunk of 5 blocks
        b.unpack([9], memoryview(buf), chunk_blocks=5)


def _packed(codec: KVCacheSet, block_ids: list[int]) -> bytearray:
    buf = bytearray(codec.chunk_nbytes(len(block_ids)))
    codec.pack(block_ids, buf)
    return buf


class _Recorder:
    """A hasher stand-in that records every byte fed to it, in order."""

    def __init__(self) -> None:
        self.data = bytearray()

    def update(self, buf) -> None:
        self.data += bytes(buf)


@pytest.mark.parametrize("tile", [1, 1 << 30], ids=["tile-per-layer", "one-tile"])
@pytest.mark.parametrize("stacked", [True, False], ids=["single-allocation", "separate-tensors"])
def test_verifying_unpack_feeds_every_byte_in_order_and_copies_the_same(monkeypatch, tile, stacked):
    """The checksum seen while copying covers the whole object (skipped blocks included), in
    storage order, and the pages copied are the same as without it, however it is tiled."""
    from maru_vllm.connector import layouts

    monkeypatch.setattr(layouts, "TILE_BYTES", tile)
    L = 4
    gen = torch.Generator().manual_seed(11)
    if stacked:
        big_a = _rand((L, NB, H, BS, 2 * D), torch.bfloat16, gen)
        a = {f"l{i}": big_a[i] for i in range(L)}
        big_b, big_c = torch.zeros_like(big_a), torch.zeros_like(big_a)
        b = {f"l{i}": big_b[i] for i in range(L)}
        c = {f"l{i}": big_c[i] for i in range(L)}
    else:
        a = {f"l{i}": _rand((NB, H, BS, 2 * D), torch.bfloat16, gen) for i in range(L)}
        b = {f"l{i}": torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for i in range(L)}
        c = {f"l{i}": torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for i in range(L)}
    ca, cb, cc = (KVCacheSet(x, BS, backend_name="CPU_ATTN") for x in (a, b, c))
    assert (ca._stack is not None) == stacked
    src_ids, dst_ids = [1, 2, 5], [6, 4]  # the first source block is skipped (a local hit)
    buf = bytearray(ca.chunk_nbytes(len(src_ids)))
    ca.pack(src_ids, memoryview(buf))
    rec = _Recorder()
    cb.unpack(dst_ids, memoryview(bytes(buf)), skip_blocks=1, hasher=rec)
    cc.unpack(dst_ids, memoryview(bytes(buf)), skip_blocks=1)
    assert bytes(rec.data) == bytes(buf)
    for name in a:
        assert _eq(b[name], c[name])
        for s, d in zip(src_ids[1:], dst_ids):
            assert _eq(b[name][d], a[name][s])


@pytest.mark.parametrize("one_allocation", [True, False])
def test_device_staged_copies_make_and_read_the_same_objects_as_page_copies(one_allocation):
    """Caches on a GPU gather a chunk's pages into one device buffer and move it in one copy
    (and the reverse for loads). The object must be byte for byte the page path's, whole or with
    leading blocks skipped, or a chunk shared in part; run here on CPU tensors, where the same
    code moves the same bytes (the CUDA test in test_gpu_path runs it on a GPU)."""
    gen = torch.Generator().manual_seed(7)
    layers = 3
    if one_allocation:
        big = torch.randn(layers, NB, H, BS, 2 * D, generator=gen).to(torch.bfloat16)
        src = {f"l{i}": big[i] for i in range(layers)}
    else:
        src = {f"l{i}": torch.randn(NB, H, BS, 2 * D, generator=gen).to(torch.bfloat16) for i in range(layers)}
    cs = KVCacheSet(src, BS, backend_name="CPU_ATTN")
    ids = [5, 6, 2]
    page = bytearray(cs.chunk_nbytes(len(ids)))
    cs.pack(ids, memoryview(page))
    staged = torch.zeros(len(page), dtype=torch.uint8)
    cs._staged_pack(ids, staged, len(ids))
    assert bytes(staged.numpy()) == bytes(page)

    def fresh():
        return {k: torch.zeros_like(v) for k, v in src.items()}

    for dst_ids, skip, chunk in (([8, 9, 10], 0, None), ([11, 0], 1, None), ([4], 1, 3)):
        by_pages, by_stage = fresh(), fresh()
        KVCacheSet(by_pages, BS, backend_name="CPU_ATTN").unpack(
            dst_ids, memoryview(page), skip_blocks=skip, chunk_blocks=chunk
        )
        KVCacheSet(by_stage, BS, backend_name="CPU_ATTN")._staged_unpack(
            dst_ids, torch.frombuffer(bytearray(page), dtype=torch.uint8), chunk or skip + len(dst_ids), skip
        )
        assert all(torch.equal(by_pages[k], by_stage[k]) for k in src)
        assert any(by_stage[k].abs().sum() > 0 for k in src)  # something was copied
