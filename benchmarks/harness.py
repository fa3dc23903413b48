"""What the benchmarks share: their result files (`write_json`), the order their configurations
run in between repeats, so that none always runs first or right after the same one (`rotated`,
`alternated`), and summaries of repeated timings (`spread`, `percentile`, `min_time`).

benchmarks/ is not a package: scripts import this as `harness` (a script's folder is on `sys.path`
when it runs; tests, and scripts that import other scripts, put benchmarks/ there).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def write_json(
    path: str | Path,
    data: Any,
    *,
    indent: int = 2,
    sort_keys: bool = False,
    default: Callable[[Any], Any] | None = None,
) -> None:
    """Write `data` to `path` as UTF-8 JSON indented by `indent`, ending in one newline; keys in
    insertion order unless `sort_keys`; `default` converts what JSON has no type for (as in
    `json.dumps`). Missing parent folders are made: a long run does not lose its figures to a typo."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=indent, sort_keys=sort_keys, default=default) + "\n", encoding="utf-8")


def rotated(items: Sequence[T], repeat: int) -> list[T]:
    """`items` rotated left by `repeat`: in any len(items) consecutive repeats each item goes first
    exactly once; the cyclic order stays (each item follows the same one, bar the wrap). Empty in,
    empty out."""
    if not items:
        return []
    k = repeat % len(items)
    return [*items[k:], *items[:k]]


def alternated(items: Sequence[T], repeat: int) -> list[T]:
    """`items` in their order on even repeats and reversed on odd ones: of two, each goes first
    every other repeat; of more, the first and the last take turns at the front."""
    return list(items) if repeat % 2 == 0 else list(reversed(items))


def spread(values: Iterable[float]) -> dict[str, float | None]:
    """``{"min", "median", "max"}`` of `values`, in that key order (median as `statistics.median`:
    the mean of the middle two of an even count); each None when there are no values."""
    xs = list(values)
    if not xs:
        return {"min": None, "median": None, "max": None}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile `q` (0-100) of `values`: the smallest value with at least q% of
    them at or below it (p100 the largest); NaN when there are none."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def min_time(fn: Callable[[], object], repeats: int) -> float:
    """The shortest wall time in seconds (`time.perf_counter`) of `repeats` calls of `fn`, one after
    the other; `repeats` must be at least 1."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be at least 1")
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
