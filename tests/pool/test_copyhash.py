"""The compiled fused copy + checksum kernel (maru_vllm.native._copyhash) against the `xxhash` package.

Its hash must be bit-identical to XXH3-64 (the object format's checksum), whatever the length,
the segmentation of the copy, the direction or the CPU implementation; its copies must be exact.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from maru_vllm import native
from maru_vllm.native import _copyhash
from maru_vllm.pool.objects import OBJ_HEADER_SIZE, checksum_of, payload_checksum, payload_hasher, write_header

ISAS = [isa for isa in ("avx512f", "avx2", "portable") if _copyhash.use_isa(isa)]
_copyhash.use_isa(native.copy_kernel().isa() if native.copy_kernel() else "portable")


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    default = _copyhash.isa()
    assert _copyhash.use_isa(request.param)
    yield request.param
    _copyhash.use_isa(default)


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_hash_equals_xxh3_64_for_every_length_around_stripe_and_block_boundaries(isa: str) -> None:
    data = _bytes(20_000, 1)
    for n in range(20_000):
        got = _copyhash.hash(data[:n])
        if n <= 240:
            assert got is None, n  # the long-input algorithm only; the package hashes short ones
        else:
            assert got == xxhash.xxh3_64_intdigest(data[:n]), (isa, n)


def test_hash_equals_xxh3_64_on_random_multi_mib_payloads_at_any_alignment(isa: str) -> None:
    rng = random.Random(2)
    big = _bytes(9 << 20, 2)
    for _ in range(6):
        start = rng.randrange(0, 4096)
        n = rng.randrange(1 << 20, (9 << 20) - start)
        assert _copyhash.hash(big[start : start + n]) == xxhash.xxh3_64_intdigest(big[start : start + n])


def _cut(n: int, rng: random.Random, pieces: int) -> list[int]:
    return [0, *sorted(rng.sample(range(1, n), pieces)), n]


def _segments(bounds: list[int], memory: np.ndarray, keep: set[int] | None = None) -> np.ndarray:
    """Segments mapping payload [a, b) to memory [a, b); only the pieces in `keep` (all when None)."""
    rows = [
        (a, memory.ctypes.data + a, b - a)
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
        if keep is None or i in keep
    ]
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


@pytest.mark.parametrize("n", [241, 1000, 1024, 1025, 4096, 65_537, 3 << 20])
def test_load_and_store_copy_exactly_and_hash_the_payload_for_any_segmentation(isa: str, n: int) -> None:
    rng = random.Random(n)
    payload = _bytes(n, n)
    want = xxhash.xxh3_64_intdigest(payload)
    for pieces in (0, 1, 7, min(n - 1, 300)):
        bounds = _cut(n, rng, pieces)  # odd sizes and offsets: segments that split stripes
        memory = np.zeros(n, dtype=np.uint8)
        assert _copyhash.copy(payload, _segments(bounds, memory), True) == want
        assert np.array_equal(memory, payload)
        memory[:] = 0
        assert _copyhash.copy(payload, _segments(bounds, memory), True, False) is None  # a plain copy
        assert np.array_equal(memory, payload)
        out = np.zeros(n, dtype=np.uint8)
        assert _copyhash.copy(out, _segments(bounds, payload), False) == want
        assert np.array_equal(out, payload)


@pytest.mark.parametrize("n", [300, 5000, 1 << 20])
def test_bytes_outside_every_segment_are_hashed_but_not_copied(isa: str, n: int) -> None:
    """A leading range (blocks the engine already has) and gaps (a chunk shared in part)."""
    rng = random.Random(n + 1)
    payload = _bytes(n, n + 1)
    bounds = _cut(n, rng, 9)
    keep = {i for i in range(1, 10) if i % 3}  # piece 0 (leading) and every third piece only hashed
    memory = np.zeros(n, dtype=np.uint8)
    assert _copyhash.copy(payload, _segments(bounds, memory, keep), True) == xxhash.xxh3_64_intdigest(payload)
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        assert np.array_equal(memory[a:b], payload[a:b] if i in keep else np.zeros(b - a, np.uint8)), i
    # Storing: the payload already holds the uncopied ranges; the hash covers them and the copies.
    out = payload.copy()
    out[np.concatenate([np.arange(a, b) for i, (a, b) in enumerate(itertools.pairwise(bounds)) if i in keep])] = 0
    assert _copyhash.copy(out, _segments(bounds, payload, keep), False) == xxhash.xxh3_64_intdigest(payload)
    assert np.array_equal(out, payload)


def test_short_payloads_are_copied_and_left_to_the_package_to_hash() -> None:
    payload = _bytes(200, 3)
    memory = np.zeros(200, dtype=np.uint8)
    assert _copyhash.copy(payload, _segments([0, 77, 200], memory), True) is None
    assert np.array_equal(memory, payload)
    assert payload_checksum(memoryview(payload)) == xxhash.xxh3_64_intdigest(payload) & 0xFFFFFFFF


@pytest.mark.parametrize(
    "rows, what",
    [
        ([(0, 0, 10), (5, 0, 10)], "overlapping"),
        ([(10, 0, 10), (0, 0, 5)], "out of order"),
        ([(990, 0, 20)], "past the payload"),
    ],
)
def test_bad_segments_are_refused_with_the_reason(rows, what) -> None:
    with pytest.raises(ValueError, match="out of order, overlapping or past the payload's 1000 bytes"):
        _copyhash.copy(np.zeros(1000, np.uint8), np.array(rows, dtype=np.uint64), True)
    with pytest.raises(ValueError, match="not a multiple of 24"):
        _copyhash.copy(np.zeros(1000, np.uint8), np.zeros(4, np.uint64), True)


def test_store_direction_needs_a_writable_payload() -> None:
    src = _bytes(1000, 4)
    with pytest.raises(BufferError):
        _copyhash.copy(bytes(1000), _segments([0, 1000], src), False)


def test_payload_checksum_and_streamed_hasher_agree_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    payload = memoryview(_bytes(70_001, 5).tobytes())
    want = xxhash.xxh3_64_intdigest(payload) & 0xFFFFFFFF
    assert native.copy_kernel() is not None
    assert payload_checksum(payload) == want
    h = payload_hasher()
    for i in range(0, len(payload), 4096):
        h.update(payload[i : i + 4096])
    assert checksum_of(h) == want
    monkeypatch.setenv(native.ENV_NATIVE_COPY, "0")
    assert native.copy_kernel() is None and native.path_name() == "pure"
    assert payload_checksum(payload) == want


def test_a_known_checksum_is_written_as_is_and_otherwise_computed() -> None:
    payload = memoryview(_bytes(5000, 6).tobytes())
    crc = payload_checksum(payload)
    for known in (None, crc):
        hdr = memoryview(bytearray(OBJ_HEADER_SIZE))
        write_header(hdr, 7, len(payload), b"d" * 16, payload, True, known_checksum=known)
        assert int.from_bytes(hdr[40:44], "little") == crc


def test_the_path_in_use_is_logged_once_per_setting(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    native._load.cache_clear()
    with caplog.at_level(logging.INFO, logger="maru_vllm.native"):
        for _ in range(3):
            native.copy_kernel()
        monkeypatch.setenv(native.ENV_NATIVE_COPY, "0")
        for _ in range(3):
            native.copy_kernel()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "fused copy + checksum kernel" in lines[0] and "MARU_NATIVE_COPY=0" in lines[1]
