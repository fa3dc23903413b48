"""The GPU data path: CUDA host registration of the pool region, LMCache's block kernel, fused load.

Where no CUDA device exists (CI, this machine) the dispatch logic runs on CPU tensors:
* the kernel is LMCache's own torch implementation of ``multi_layer_block_kv_transfer`` (real
  LMCache code with the compiled kernel's signature), or a named recorder standing in for the
  compiled binding where the pointer-passing convention is what is checked;
* `cudart` is a named recorder standing in for ``torch.cuda.cudart()``.
The tests at the end run the real thing and skip, saying why, without a CUDA device.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from maru_vllm.connector import transfer
from maru_vllm.connector.cuda_host import HOST_REGISTER_FLAGS, HostRegistry, buffer_address
from maru_vllm.connector.layouts import KVCacheSet
from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
from maru_vllm.connector.object_format import HeadRange
from maru_vllm.connector.page_layout import LayoutMismatch
from maru_vllm.connector.transfer import LMCacheBlockCopier, TorchPageCopier, make_copier
from maru_vllm.launch.stack import PoolProcess
from maru_vllm.pool import PoolClient
from tests.connector.chunk_meta import chunk_meta
from tests.connector.worker_side import worker_side
from tests.running_pool import running_pool

L, NB, H, BS, C = 4, 16, 2, 8, 64  # layers, blocks, kv heads, block size, 2 * head size
HND = "LBHNC"  # vLLM's name for the layout `caches` builds: [layer, block, head, token, K|V]
BPC = 2
NO_CUDA = "needs a CUDA device (none here): the CPU-tensor tests above cover the dispatch logic"

lmcache_fallback = pytest.importorskip(
    "lmcache.v1.platform.torch_ops.mp_mem_kernels", reason="LMCache (make setup installs it) is needed for its kernels"
)


def caches(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    big = torch.randn(L, NB, H, BS, C).to(torch.bfloat16).to(device)  # vLLM 0.31: one allocation
    return {f"model.layers.{i}.self_attn.attn": big[i] for i in range(L)}


def block_copier(kv: dict[str, torch.Tensor], kernel=None, kv_layout: str = HND) -> LMCacheBlockCopier:
    return LMCacheBlockCopier(
        kernel or lmcache_fallback.multi_layer_block_kv_transfer,
        kv,
        block_size=BS,
        num_blocks=NB,
        blocks_per_chunk=BPC,
        kv_layout=kv_layout,
    )


def pages(kv: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t[block] for t in kv.values()]


# ---- LMCache's block kernel: the copies and the object format ---------------------------------
def test_block_kernel_store_then_load_into_other_blocks_of_another_cache() -> None:
    src, dst = caches(1), caches(2)
    a, b = block_copier(src), block_copier(dst)
    obj = bytearray(a.chunk_nbytes(BPC))
    a.pack([3, 4], memoryview(obj))
    b.unpack([9, 12], memoryview(obj))
    assert all(torch.equal(x, y) for x, y in zip(pages(dst, 9), pages(src, 3)))
    assert all(torch.equal(x, y) for x, y in zip(pages(dst, 12), pages(src, 4)))
    # LMCache's block order, not the page order: the same size, other bytes, and a trailer each
    # saying which (test_lmcache_order.py reads each in the other).
    maru = bytearray(a.chunk_nbytes(BPC))
    codec = KVCacheSet(src, BS, num_blocks=NB, backend_name="CPU_ATTN")
    codec.use_format(HeadRange(0, H, H))
    TorchPageCopier(codec).pack([3, 4], memoryview(maru))
    assert len(maru) == len(obj) and maru[:-64] != obj[:-64]


def test_block_kernel_load_skips_the_blocks_the_engine_has() -> None:
    src, dst = caches(1), caches(2)
    before = dst["model.layers.0.self_attn.attn"][5].clone()
    obj = bytearray(block_copier(src).chunk_nbytes(BPC))
    block_copier(src).pack([3, 4], memoryview(obj))
    block_copier(dst).unpack([6], memoryview(obj), skip_blocks=1)
    assert all(torch.equal(x, y) for x, y in zip(pages(dst, 6), pages(src, 4)))
    assert torch.equal(dst["model.layers.0.self_attn.attn"][5], before)


def test_fused_load_equals_chunk_by_chunk() -> None:
    src = caches(1)
    objs = []
    for ids in ([0, 1], [2, 3], [4, 5]):
        o = bytearray(block_copier(src).chunk_nbytes(BPC))
        block_copier(src).pack(ids, memoryview(o))
        objs.append(o)
    one, fused = caches(2), caches(2)
    items = [([8, 9], memoryview(objs[0]), 0), ([10, 11], memoryview(objs[1]), 0), ([13], memoryview(objs[2]), 1)]
    block_copier(one).unpack_many([])  # nothing to do is fine
    for ids, o, skip in items:
        block_copier(one).unpack(ids, o, skip_blocks=skip)
    block_copier(fused).unpack_many(items)
    assert all(torch.equal(one[k], fused[k]) for k in one)


def test_block_kernel_reads_pages_by_the_layout_vllm_reports() -> None:
    # Heads and block tokens swap places between vLLM's layouts and a page's shape cannot tell
    # which is which: the object (token-major) must be the same whichever layout holds the KV.
    hnd = caches(1)
    nhd = {k: t.transpose(1, 2).contiguous() for k, t in hnd.items()}  # [block, token, head, K|V]
    from_hnd, from_nhd, misread = (bytearray(block_copier(hnd).chunk_nbytes(BPC)) for _ in range(3))
    block_copier(hnd, kv_layout=HND).pack([3, 4], memoryview(from_hnd))
    block_copier(nhd, kv_layout="LBNHC").pack([3, 4], memoryview(from_nhd))
    assert from_hnd == from_nhd
    # The NHD pages read as if heads came first: the geometry is wrong, so the object is refused.
    with pytest.raises(LayoutMismatch):
        block_copier(nhd, kv_layout=HND).pack([3, 4], memoryview(misread))
    # A layout LMCache's kernel cannot address (heads outermost) is refused, not misread.
    with pytest.raises(NotImplementedError):
        block_copier(hnd, kv_layout="LHBNC")


class RecordingCompiledKernel:
    """Named stand-in for the compiled binding (not a Python function: takes device pointers)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def __call__(self, *args):
        self.calls.append(args)
        if self.fail:
            raise RuntimeError("CUDA error: invalid argument (recorded stand-in)")


def test_compiled_kernel_gets_pointers_and_at_most_four_objects_per_launch() -> None:
    kv = caches(1)
    rec = RecordingCompiledKernel()
    cp = block_copier(kv, rec)
    objs = [bytearray(cp.chunk_nbytes(BPC)) for _ in range(6)]
    for o in objs:  # objects in its own format (a kernel is never handed another's)
        o[-64:] = cp.object_format.trailer()
    cp.unpack_many([([2 * i, 2 * i + 1], memoryview(o), 0) for i, o in enumerate(objs)])
    assert [len(c[1]) for c in rec.calls] == [4, 2]  # LMCache's per-launch object limit
    ptrs, obj_ptrs, block_ids = rec.calls[0][:3]
    assert ptrs.dtype == torch.int64 and ptrs.numel() >= 1
    assert obj_ptrs == [buffer_address(memoryview(o)) for o in objs[:4]]  # the pool buffers themselves
    assert block_ids.tolist() == list(range(8))
    assert int(rec.calls[0][4]) == int(cp._api.TransferDirection.H2D)
    assert rec.calls[0][6] == BPC * BS  # tokens per object


def test_a_failing_compiled_kernel_falls_back_to_lmcache_torch_in_the_same_format() -> None:
    src, dst = caches(1), caches(2)
    cp = block_copier(src, RecordingCompiledKernel(fail=True))
    obj = bytearray(cp.chunk_nbytes(BPC))
    cp.pack([3, 4], memoryview(obj))
    assert cp.name == "lmcache-torch"
    ref = bytearray(obj)
    block_copier(src).pack([3, 4], memoryview(ref))
    assert obj == ref
    block_copier(dst).unpack([0, 1], memoryview(obj))
    assert all(torch.equal(x, y) for x, y in zip(pages(dst, 0), pages(src, 3)))


# ---- which copier, which format ----------------------------------------------------------------
def test_cpu_caches_always_use_torch_pages_even_when_kernels_resolve(monkeypatch) -> None:
    class Kernels:
        multi_layer_block_kv_transfer = staticmethod(lmcache_fallback.multi_layer_block_kv_transfer)

    kv = caches(1)
    codec = KVCacheSet(kv, BS, num_blocks=NB, backend_name="CPU_ATTN")
    assert isinstance(
        make_copier(codec, kv, Kernels(), block_size=BS, num_blocks=NB, blocks_per_chunk=BPC), TorchPageCopier
    )
    assert transfer.copy_format("cpu", True) == transfer.FORMAT_PAGES
    monkeypatch.setattr(transfer, "resolve_lmcache_kernels", lambda enabled: Kernels())
    assert transfer.copy_format("cuda", True) == transfer.FORMAT_LMCACHE_BLOCK
    assert transfer.copy_format("cuda", False) == transfer.FORMAT_PAGES
    monkeypatch.setattr(transfer, "resolve_lmcache_kernels", lambda enabled: None)
    assert transfer.copy_format("cuda", True) == transfer.FORMAT_PAGES


# ---- CUDA host registration ------------------------------------------------------------------
class RecordingCudart:
    """Named stand-in for torch.cuda.cudart(): records calls, returns CUDA error codes."""

    def __init__(self, rc: int = 0) -> None:
        self.rc = rc
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered.append((ptr, size, flags))
        return self.rc

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    with running_pool("16M") as pool:
        yield pool


def test_region_is_registered_once_per_mapping_and_again_after_a_pool_restart(pool: PoolProcess) -> None:
    cudart = RecordingCudart()
    reg = HostRegistry(cudart)
    client = PoolClient.connect(pool.address)
    view = client.region_view
    assert reg.ensure(view) and reg.ensure(client.region_view)
    assert cudart.registered == [(buffer_address(view), view.nbytes, HOST_REGISTER_FLAGS)]
    # A reservation's buffer lies inside the registered mapping.
    (res,) = client.reserve([(b"k", 4096)], "ns")
    assert reg.covers(buffer_address(res.buffer), 4096)
    client.abort([res])
    pool.serve()
    client.reconnect()
    assert reg.ensure(client.region_view)
    assert len(cudart.registered) == 2 and cudart.registered[1][0] == buffer_address(client.region_view)
    reg.close()
    assert set(cudart.unregistered) >= {cudart.registered[1][0]}
    client.close()


def test_refused_registration_is_reported_once_and_copies_still_go(pool: PoolProcess, caplog) -> None:
    cudart = RecordingCudart(rc=712)  # cudaErrorHostMemoryAlreadyRegistered, say
    reg = HostRegistry(cudart)
    client = PoolClient.connect(pool.address)
    assert not reg.ensure(client.region_view) and not reg.ensure(client.region_view)
    assert len(cudart.registered) == 1
    assert sum("cudaHostRegister" in r.message for r in caplog.records) == 1
    client.close()


# ---- on a CUDA device ---------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


@cuda
def test_cuda_store_and_load_through_the_registered_region(pool: PoolProcess) -> None:
    # Every pair of copiers: the torch copies and LMCache's kernel each read the other's objects.
    for kernels_a, kernels_b in ((False, False), (True, True), (True, False), (False, True)):
        ns = f"cuda-{kernels_a}-{kernels_b}"
        kv_a, kv_b = caches(1, "cuda"), caches(2, "cuda")
        sides = []
        for kv, use_kernels in ((kv_a, kernels_a), (kv_b, kernels_b)):
            side = worker_side(
                pool.address,
                ns,
                kv,
                block_size=BS,
                num_blocks=NB,
                backend="FLASH_ATTN",
                who="t",
                use_lmcache_kernels=use_kernels,
                enable_fused_load=use_kernels,
                kv_layout=HND,
                blocks_per_chunk=BPC,
            )
            assert side.codec is not None and side.host_registry is not None
            sides.append(side)
        a, b = sides
        a.store(MaruConnectorMetadata(stores=[ChunkStore("r", b"c0", [3, 4], chunk_meta(0))]))
        assert a.writer.wait(timeout=60)
        b.load(MaruConnectorMetadata(loads=[ChunkLoad("r2", b"c0", [7, 8])]))
        torch.cuda.synchronize()
        assert b.take_failed_blocks() == set()
        assert all(torch.equal(x, y) for x, y in zip(pages(kv_b, 7), pages(kv_a, 3)))
        assert a.host_registry.registered and b.host_registry.registered
        for side in sides:
            side.shutdown()
            side.host_registry.close()


def test_load_waits_for_the_copies_before_unpinning_the_objects(pool: PoolProcess) -> None:
    # An asynchronous kernel reads the pinned objects after its launch returns: the pins may only
    # go once the copier says the reads are done.
    side = worker_side(pool.address, "order", caches(1), block_size=BS, num_blocks=NB, who="t", blocks_per_chunk=BPC)
    side.store(MaruConnectorMetadata(stores=[ChunkStore("r", b"o0", [0, 1], chunk_meta(0))]))
    assert side.writer.wait(timeout=30)
    events: list[str] = []
    side.copier.finish = lambda: events.append("copies done")

    def recorded(op):
        def call(*args, **kwargs):
            events.append(op.__name__)
            return op(*args, **kwargs)

        return call

    side.pool.acquire = recorded(side.pool.acquire)
    side.pool.release = recorded(side.pool.release)
    side.load(MaruConnectorMetadata(loads=[ChunkLoad("r2", b"o0", [5, 6])]))
    assert events == ["acquire", "copies done", "release"]
    side.shutdown()


def test_gpu_batches_move_each_chunk_whole_and_hash_it_beside_the_copies() -> None:
    # The batched path GPU caches take (one DMA per chunk, payloads hashed on host threads),
    # run on CPU tensors: same objects and checksums as the chunk-by-chunk path, and a batch
    # with one wrong chunk copies nothing.
    from maru_vllm.connector.copier import WholeChunk
    from maru_vllm.pool.objects import checksum_from_digest, payload_checksum

    src = caches(1)
    cp = TorchPageCopier(KVCacheSet(src, BS, num_blocks=NB, backend_name="CPU_ATTN"))
    ids = [[3, 4], [9, 10], [0, 1]]
    objs = [bytearray(cp.chunk_nbytes(BPC)) for _ in ids]
    digests = cp._device_whole_many([WholeChunk(i, memoryview(o)) for i, o in zip(ids, objs)], load=False)
    for i, o, d in zip(ids, objs, digests):
        ref = bytearray(cp.chunk_nbytes(BPC))
        cp.pack(i, memoryview(ref))
        assert o == ref and checksum_from_digest(d) == payload_checksum(memoryview(o))
    dst = caches(2)
    into = TorchPageCopier(KVCacheSet(dst, BS, num_blocks=NB, backend_name="CPU_ATTN"))
    items = [WholeChunk([7, 8], memoryview(objs[0])), WholeChunk([12], memoryview(objs[1]), 1, False)]
    got = into._device_whole_many(items, load=True)
    assert checksum_from_digest(got[0]) == payload_checksum(memoryview(objs[0])) and got[1] is None
    assert all(torch.equal(x, y) for x, y in zip(pages(dst, 7), pages(src, 3)))
    assert all(torch.equal(x, y) for x, y in zip(pages(dst, 12), pages(src, 10)))
    before = {k: v.clone() for k, v in dst.items()}
    with pytest.raises(LayoutMismatch):
        into._device_whole_many([WholeChunk([0, 1], memoryview(objs[2])), WholeChunk([2], memoryview(b"x"))], load=True)
    assert all(torch.equal(before[k], dst[k]) for k in dst)
