"""benchmarks/bench_connector.py: what it reports is the minimum over samples, per length and
system, and its calibration file is one the what-if replay accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_connector
from maru_vllm.fixtures.calibration import read_calibration


def _row(tokens: int, sample: int, scale: float) -> dict:
    return {
        "tokens": tokens,
        "sample": sample,
        "cold_plain": 2.0 * scale,
        "cold_maru": 2.02 * scale,
        "cold_lmc": 2.2 * scale,
        "cold_lmc_cached": 0,
        "hit_maru": 0.06 * scale,
        "hit_maru_cached": tokens,
        "local_maru": 0.05 * scale,
        "local_maru_cached": tokens,
        "hit_lmc": 0.12 * scale,
        "hit_lmc_cached": tokens,
        "local_lmc": 0.05 * scale,
        "local_lmc_cached": tokens,
    }


def test_summary_takes_minimum_per_length_and_calibration_reads_back(tmp_path: Path) -> None:
    rows = [_row(1024, 0, 1.5), _row(1024, 1, 1.0), _row(4096, 0, 4.0), _row(4096, 1, 5.0)]
    loads = [
        {"tokens": 4096, "bytes_loaded": 64 << 20, "load_seconds": 0.01, "load_acquire_seconds": 0.001},
        {"tokens": 4096, "bytes_loaded": 64 << 20, "load_seconds": 0.02},
    ]
    prof = {"checksum_share_of_load": 0.1}
    res = bench_connector.summarize(
        rows, loads, {"bytes_stored": 1e9, "store_seconds": 0.5}, 20.0, prof, 16384, 4096, ["maru", "lmc"]
    )
    t = res["table"]["1024"]
    assert t["cold_plain"] == 2.0 and t["hit_maru"] == 0.06  # min of the two samples
    assert t["miss_tax_maru"] == pytest.approx(1.01) and t["hit_over_local_lmc"] == pytest.approx(2.4)
    assert res["table"]["4096"]["cold_plain"] == 8.0
    assert res["load_GBps_in_engine"] == pytest.approx((64 << 20) / 0.01 / 1e9)  # best sample
    assert res["load_parts_ms_in_engine"]["acquire"] == pytest.approx(1.0)
    assert res["prefill_tokens_per_s"] == pytest.approx(4096 / 8.0)
    path = tmp_path / "cal.json"
    bench_connector.write_calibration(path, bench_connector.calibration_of({**res, "model": "medium"}))
    cal = read_calibration(path)
    assert (cal.kv_bytes_per_token, cal.memcpy_gbps, cal.store_gbps) == (16384, 20.0, 2.0)
    assert cal.model == "medium"
