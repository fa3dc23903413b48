"""benchmarks/harness.py: the result files the benchmarks write, the order their configurations
take between repeats, and the summaries of their timings."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import harness  # benchmarks/ is not a package: found through sys.path


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_rotation_puts_each_configuration_first_once_in_as_many_repeats(n: int) -> None:
    configs = [f"c{i}" for i in range(n)]
    for start in (0, 7):  # any n consecutive repeats, not only the first n
        orders = [harness.rotated(configs, r) for r in range(start, start + n)]
        assert sorted(o[0] for o in orders) == configs
        assert all(sorted(o) == configs for o in orders)
    # the cyclic order stays: what follows c0 is always c1 (bar the wrap)
    assert all(o[(o.index("c0") + 1) % n] == configs[1 % n] for o in orders)
    assert harness.rotated(configs, 1) == configs[1:] + configs[:1]
    assert harness.rotated([], 3) == []


def test_alternation_reverses_every_other_repeat() -> None:
    assert [harness.alternated(("a", "b"), r) for r in range(4)] == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    assert harness.alternated(["x", "y", "z"], 3) == ["z", "y", "x"]
    firsts = Counter(harness.alternated(["a", "b"], r)[0] for r in range(10))
    assert firsts == {"a": 5, "b": 5}


@pytest.mark.parametrize(
    ("kwargs", "dumps"),
    [
        ({}, {"indent": 2}),
        ({"indent": 1}, {"indent": 1}),
        ({"sort_keys": True, "default": str}, {"indent": 2, "sort_keys": True, "default": str}),
    ],
)
def test_write_json_round_trips_with_the_formatting_asked(
    tmp_path: Path, kwargs: dict[str, object], dumps: dict[str, object]
) -> None:
    data: dict[str, object] = {"z": 1, "a": [1.5, {"y": None, "b": "é"}]}
    if "default" in kwargs:
        data["path"] = Path("/x")  # what JSON has no type for: converted by `default`
    out = tmp_path / "new" / "dir" / "result.json"  # parent folders are made
    harness.write_json(out, data, **kwargs)  # type: ignore[arg-type]
    text = out.read_text(encoding="utf-8")
    # byte for byte what the benchmarks wrote by hand: json.dumps with their options, one newline
    assert text == json.dumps(data, **dumps) + "\n"  # type: ignore[arg-type]
    assert text.endswith("}\n") and not text.endswith("\n\n")
    back = json.loads(text)
    assert list(back) == (sorted(data) if kwargs.get("sort_keys") else list(data))
    assert back["a"] == [1.5, {"y": None, "b": "é"}] and back.get("path", "/x") == "/x"


def test_write_json_without_a_default_refuses_what_json_has_no_type_for(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        harness.write_json(tmp_path / "r.json", {"p": Path("/x")})


def test_spread_is_min_median_max_in_that_order_and_none_when_empty() -> None:
    assert list(harness.spread([3.0, 1.0, 2.0]).items()) == [("min", 1.0), ("median", 2.0), ("max", 3.0)]
    assert harness.spread(x for x in (4.0, 1.0, 2.0, 3.0))["median"] == 2.5  # a generator; mean of the middle two
    assert harness.spread([]) == {"min": None, "median": None, "max": None}


def test_min_time_is_the_shortest_of_the_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    durations = iter([3.0, 1.0, 2.0])
    monkeypatch.setattr(harness.time, "perf_counter", lambda: clock[0])

    def call() -> None:
        clock[0] += next(durations)

    assert harness.min_time(call, 3) == 1.0
    with pytest.raises(StopIteration):  # exactly 3 calls were made: the durations are used up
        call()
    with pytest.raises(ValueError, match="repeats=0: must be at least 1"):
        harness.min_time(call, 0)


def test_percentile_is_nearest_rank_and_nan_for_none() -> None:
    values = [float(i) for i in range(100, 0, -1)]  # unsorted in
    assert [harness.percentile(values, q) for q in (0, 1, 50, 90, 99, 100)] == [1.0, 1.0, 50.0, 90.0, 99.0, 100.0]
    assert harness.percentile([3.0, 1.0, 2.0], 50) == 2.0  # a value of the list, never an interpolation
    assert math.isnan(harness.percentile([], 50))
