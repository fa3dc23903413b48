"""KVCacheSet and the worker with the fused copy + checksum kernel (maru_vllm.native) vs without.

Both paths must give the same object bytes, the same checksums and the same pages, for the
vLLM 0.31 single allocation and for separate per-layer tensors, for partial loads (a skipped
leading range, a chunk shared in part); a corrupted object is a miss on either path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maru_vllm import native
from maru_vllm.connector.layouts import KVCacheSet
from maru_vllm.connector.metadata import ChunkLoad, ChunkStore, MaruConnectorMetadata
from maru_vllm.pool import objects
from maru_vllm.pool.objects import checksum_of, payload_checksum, payload_hasher
from tests.connector.chunk_meta import chunk_meta
from tests.connector.worker_side import buffer_address, small_worker

NS = "kv:test:native"

NB, BS, H, D, L = 12, 16, 2, 32, 5


def _caches(stacked: bool, seed: int, zero: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def make(shape):
        return (
            torch.zeros(shape, dtype=torch.bfloat16) if zero else torch.randn(shape, generator=gen).to(torch.bfloat16)
        )

    if stacked:  # vLLM 0.31: one allocation, every layer a view at a constant stride
        big = make((L, NB, H, BS, 2 * D))
        return {f"l{i}": big[i] for i in range(L)}
    return {f"l{i}": make((NB, H, BS, 2 * D)) for i in range(L)}


def _set(caches: dict[str, torch.Tensor]) -> KVCacheSet:
    return KVCacheSet(caches, BS, backend_name="CPU_ATTN")


@pytest.fixture(params=["native", "pure"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "pure":
        monkeypatch.setenv(native.ENV_NATIVE_COPY, "0")
    else:
        monkeypatch.delenv(native.ENV_NATIVE_COPY, raising=False)
        assert native.copy_kernel() is not None, "the compiled kernel is built by `pip install -e .` / make setup"
    return request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("stacked", [True, False], ids=["single-allocation", "per-layer"])
def test_pack_gives_the_same_bytes_and_checksum_as_the_pure_path(
    monkeypatch: pytest.MonkeyPatch, stacked: bool
) -> None:
    codec = _set(_caches(stacked, 1))
    assert (codec._stack is not None) == stacked and codec._segments is not None
    assert codec.copy_path() == native.path_name() != "pure"  # what the worker logs as its copies
    ids = [3, 4, 5, 9, 0]  # runs and jumps
    fused = bytearray(codec.chunk_nbytes(len(ids)))
    crc = codec.pack_with_checksum(ids, fused)
    monkeypatch.setenv(native.ENV_NATIVE_COPY, "0")
    assert codec.copy_path() == "torch"
    pure = bytearray(codec.chunk_nbytes(len(ids)))
    assert codec.pack_with_checksum(ids, pure) is None  # the pure path leaves hashing to the client
    assert fused == pure
    assert crc == payload_checksum(memoryview(pure))


@pytest.mark.parametrize("stacked", [True, False], ids=["single-allocation", "per-layer"])
@pytest.mark.parametrize(
    "skip, chunk_blocks, dst",
    [
        (0, None, [7, 0, 1, 10]),  # whole chunk
        (1, None, [0, 1, 10]),  # leading block already local: hashed, not copied
        (1, 4, [8, 2]),  # blocks 1..2 of a 4-block chunk shared in part
        (0, 4, [6]),  # block 0 only
    ],
)
def test_verifying_unpack_copies_and_checks_the_same_on_both_paths(
    path: str, stacked: bool, skip: int, chunk_blocks: int | None, dst: list[int]
) -> None:
    src = _caches(stacked, 2)
    a = _set(src)
    src_ids = [3, 4, 5, 9]
    buf = bytes(_packed(a, src_ids))
    out = _caches(stacked, 3, zero=True)
    b = _set(out)
    h = payload_hasher()
    b.unpack(dst, memoryview(buf), skip_blocks=skip, chunk_blocks=chunk_blocks, hasher=h)
    assert checksum_of(h) == payload_checksum(memoryview(buf))  # every byte hashed, copied or not
    copied = dict(zip(dst, src_ids[skip:]))
    for name in src:
        for block in range(NB):
            want = src[name][copied[block]] if block in copied else torch.zeros_like(src[name][0])
            assert torch.equal(_bits(out[name][block]), _bits(want)), (name, block)


def _packed(codec: KVCacheSet, ids: list[int]) -> bytearray:
    buf = bytearray(codec.chunk_nbytes(len(ids)))
    codec.pack(ids, buf)
    return buf


def test_a_corrupted_object_fails_the_fused_check(path: str) -> None:
    a = _set(_caches(True, 4))
    buf = _packed(a, [1, 2, 3])
    crc = payload_checksum(memoryview(buf))
    buf[5000] ^= 0x01
    h = payload_hasher()
    _set(_caches(True, 5, zero=True)).unpack([4, 5, 6], memoryview(bytes(buf)), hasher=h)
    assert checksum_of(h) != crc


def test_the_fused_path_is_not_used_for_other_hashers_or_mixed_geometries(path: str) -> None:
    """A hasher that is not a fresh PayloadHasher is fed bytes (the pure path); layers of different
    page geometry have no segment plan at all."""
    a = _set(_caches(False, 6))
    buf = bytes(_packed(a, [1, 2]))
    fed = bytearray()

    class Recorder:
        def update(self, data) -> None:
            fed.extend(bytes(data))

    a.unpack([3, 4], memoryview(buf), hasher=Recorder())
    assert bytes(fed) == buf
    mixed = {
        "l0": torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16),
        "l1": torch.zeros(NB, 2 * H, BS, 2 * D, dtype=torch.bfloat16),
    }
    assert _set(mixed)._segments is None


def test_store_checksum_is_computed_in_the_copy_and_not_again_at_commit(
    pool, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    hashed: list[int] = []
    real = objects.payload_checksum
    monkeypatch.setattr(objects, "payload_checksum", lambda p: hashed.append(len(p)) or real(p))
    a, _a_kv = small_worker(pool.address, 7, NS)
    a.store(MaruConnectorMetadata(stores=[ChunkStore("r1", f"cs-{path}".encode(), [1, 2], chunk_meta(0))]))
    assert a.writer.wait(timeout=30)
    assert a.take_counters().chunks_stored == 1
    assert hashed == ([] if path == "native" else [a.codec.chunk_nbytes(2)])
    (pin,) = a.pool.client.acquire([f"cs-{path}/r0".encode()], NS, verify_payload=False)
    assert pin is not None and pin.checksum == real(pin.data)
    a.pool.client.release([pin])


def test_corrupt_object_is_a_miss_on_both_paths(pool, path: str) -> None:
    a, _a_kv = small_worker(pool.address, 8, NS)
    b, b_kv = small_worker(pool.address, 9, NS)
    before = {n: t.clone() for n, t in b_kv.items()}
    key = f"bad-{path}".encode()
    a.store(MaruConnectorMetadata(stores=[ChunkStore("r1", key, [3, 4], chunk_meta(1))]))
    assert a.writer.wait(timeout=30)
    client = a.pool.client
    (pin,) = client.acquire([key + b"/r0"], NS, verify_payload=False)
    region = client._region.view
    start = buffer_address(pin.data) - buffer_address(region)
    region[start + 700] = region[start + 700] ^ 0x10
    client.release([pin])
    b.load(MaruConnectorMetadata(loads=[ChunkLoad("r9", key, [12, 13])]))
    assert b.take_failed_blocks() == {12, 13}  # recomputed, never served
    assert b.take_counters().load_failures == 1
    for name in b_kv:  # the other blocks are untouched
        keep = [i for i in range(16) if i not in (12, 13)]
        assert torch.equal(b_kv[name][keep], before[name][keep])


def test_segments_merge_contiguous_pages_into_one_copy() -> None:
    codec = _set(_caches(False, 10))
    seg = codec._segments.segments([3, 4, 5, 9], 4)
    assert seg.dtype == np.uint64 and seg.shape == (2 * L, 3)  # per layer: the run 3..5, then 9
    page = codec.bytes_per_block // L
    assert seg[0, 2] == 3 * page and seg[1, 0] == 3 * page and seg[1, 2] == page


@pytest.mark.parametrize("bad", ["corrupted", "wrong-size"])
def test_a_steps_chunks_load_together_and_only_the_bad_one_misses(pool, path: str, bad: str) -> None:
    """Two chunks in one step (one batched kernel pass where the kernel is built): a good one and
    a corrupted one (the batch's own digests catch it), or one whose object does not fit the
    blocks asked for (the batch refuses before copying; chunk by chunk instead). Only the good
    chunk's blocks are served, byte for byte; the bad one's are reported for recomputation."""
    a, a_kv = small_worker(pool.address, 10, NS)
    b, b_kv = small_worker(pool.address, 11, NS)
    keys = [f"batch-{path}-{bad}-{i}".encode() for i in range(2)]
    a.store(
        MaruConnectorMetadata(
            stores=[ChunkStore("w", k, [2 * i, 2 * i + 1], chunk_meta(i)) for i, k in enumerate(keys)]
        )
    )
    assert a.writer.wait(timeout=30)
    bad_blocks = [10, 11]
    if bad == "corrupted":
        client = a.pool.client
        (pin,) = client.acquire([keys[1] + b"/r0"], NS, verify_payload=False)
        region = client._region.view
        start = buffer_address(pin.data) - buffer_address(region)
        region[start + 333] = region[start + 333] ^ 0x01
        client.release([pin])
    else:
        bad_blocks = [10, 11, 12]  # a 2-block object asked for 3 blocks
    before = {n: t.clone() for n, t in b_kv.items()}
    b.load(MaruConnectorMetadata(loads=[ChunkLoad("r", keys[0], [8, 9]), ChunkLoad("r", keys[1], bad_blocks)]))
    assert b.take_failed_blocks() == set(bad_blocks)
    counters = b.take_counters()
    assert counters.chunks_loaded == 1 and counters.load_failures == 1
    for name in b_kv:
        assert torch.equal(_bits(b_kv[name][8:10]), _bits(a_kv[name][0:2]))
        assert torch.equal(b_kv[name][:8], before[name][:8])


@pytest.mark.parametrize("stacked", [True, False], ids=["single-allocation", "per-layer"])
def test_segments_of_many_chunks_at_once_equal_one_by_one(stacked: bool) -> None:
    codec = _set(_caches(stacked, 12))
    planner = codec._segments
    ids = np.array([[3, 4], [9, 1], [5, 6]])
    for n, skip in ((2, 0), (3, 1), (4, 2)):
        many = planner.segments_many(ids, n, skip)
        assert len(many) == 3
        for row, seg in zip(ids, many):
            assert np.array_equal(seg, planner.segments(list(row), n, skip))


@pytest.mark.parametrize("stacked", [True, False], ids=["single-allocation", "per-layer"])
def test_a_batched_pack_writes_what_pack_writes_chunk_by_chunk(stacked: bool) -> None:
    from maru_vllm.connector.transfer import TorchPageCopier, WholeChunk

    copier = TorchPageCopier(_set(_caches(stacked, 13)))
    chunks = [[3, 4], [9, 0], [5, 6]]
    one_by_one = [bytearray(copier.chunk_nbytes(2)) for _ in chunks]
    sums = [copier.pack(ids, out) for ids, out in zip(chunks, one_by_one)]
    batched = [bytearray(copier.chunk_nbytes(2)) for _ in chunks]
    assert copier.pack_whole_many([WholeChunk(ids, memoryview(out)) for ids, out in zip(chunks, batched)]) == sums
    assert batched == one_by_one
    assert sums == [payload_checksum(memoryview(b)) for b in batched]


def test_a_job_with_a_chunk_that_cannot_be_copied_stores_the_others(pool, path: str) -> None:
    """The batch refuses before copying (a block id the cache does not have); chunk by chunk,
    only that chunk fails and its reservation is aborted; the others are stored and verify."""
    a, _ = small_worker(pool.address, 14, NS)
    keys = [f"job-{path}-{i}".encode() for i in range(3)]
    blocks = [[0, 1], [2, 999], [4, 5]]
    a.store(
        MaruConnectorMetadata(
            stores=[ChunkStore("w", k, ids, chunk_meta(i)) for i, (k, ids) in enumerate(zip(keys, blocks))]
        )
    )
    assert a.writer.wait(timeout=30)
    counters = a.take_counters()
    assert counters.chunks_stored == 2 and counters.store_failures == 1
    client = a.pool.client
    assert client.lookup([k + b"/r0" for k in keys], NS) == [True, False, True]
    pins = client.acquire([keys[0] + b"/r0", keys[2] + b"/r0"], NS, verify_payload=True)
    assert all(p is not None and p.payload_verified for p in pins)
    client.release(pins)


@pytest.mark.parametrize("native", ["1", "0"])
def test_payload_digests_on_threads_are_each_payloads_checksum_in_order(native, monkeypatch):
    from maru_vllm.connector.payload_digests import PayloadDigests
    from maru_vllm.pool.objects import checksum_from_digest, payload_checksum

    monkeypatch.setenv("MARU_NATIVE_COPY", native)
    rng = np.random.default_rng(3)
    payloads = [memoryview(rng.integers(0, 255, size, dtype=np.uint8).tobytes()) for size in (5 << 20, 100, 3 << 20)]
    d = PayloadDigests()
    d.add(payloads[0])
    d.add(None)  # a payload not to be hashed keeps its place
    for p in payloads[1:]:
        d.add(p)
    got = d.results()
    assert got[1] is None
    assert [checksum_from_digest(x) for x in (got[0], got[2], got[3])] == [payload_checksum(p) for p in payloads]
