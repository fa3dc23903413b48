import json

import pytest

from maru_vllm.fixtures.calibration import Calibration, read_calibration, write_calibration


def _cal(**kw):
    base = dict(
        model="bench",
        kv_bytes_per_token=4096,
        load_gbps=5.0,
        store_gbps=4.0,
        prefill_tokens_per_s=1500.0,
        memcpy_gbps=11.0,
    )
    base.update(kw)
    return Calibration(**base)


def test_round_trip(tmp_path):
    p = tmp_path / "cal.json"
    write_calibration(p, _cal())
    assert read_calibration(p) == _cal()
    measured = _cal(
        prefill_points=[(16, 20.5), (1536, 250.0)], decode_points=[(528, 12.0), (8320, 16.5)], step_tokens=2048
    )
    write_calibration(p, measured)
    assert read_calibration(p) == measured


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d.update(load_gbps=0), "load_gbps must be > 0"),
        (lambda d: d.update(kv_bytes_per_token=-1), "kv_bytes_per_token must be > 0"),
        (lambda d: d.update(bogus=1), "bogus"),
        (lambda d: d.pop("model"), "model"),
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d.update(prefill_points=[[16, 20.0]]), "prefill_points must be at least two (tokens, ms) pairs"),
        (lambda d: d.update(decode_points=[[500, 12.0], [100, 14.0]]), "decode_points must be at least two"),
        (lambda d: d.update(prefill_points=[[16, 20.0], [512, 0]]), "prefill_points must be at least two"),
        (lambda d: d.update(step_tokens=0), "step_tokens must be >= 1, got 0"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, mutate, needle):
    p = tmp_path / "cal.json"
    write_calibration(p, _cal())
    d = json.loads(p.read_text())
    mutate(d)
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError) as ei:
        read_calibration(p)
    assert needle in str(ei.value) and str(p) in str(ei.value) and "\n" not in str(ei.value)


def test_missing_and_garbage(tmp_path):
    with pytest.raises(ValueError, match=r"calibration file .*missing"):
        read_calibration(tmp_path / "missing.json")
    g = tmp_path / "g.json"
    g.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_calibration(g)
