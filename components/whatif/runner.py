"""Run the what-if: every worker count x configuration, `repeats` times, medians, progress on stderr."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, TextIO

from maru_dynamo.components.whatif import dynamo_backend, pool_model
from maru_dynamo.components.whatif.spec import KV_POOL, ClusterSpec, RunResult
from maru_dynamo.components.whatif.timing import mocker_timing
from maru_dynamo.components.whatif.trace import TraceRequest, write_trace

MODEL = "model"  # the pool model (all four configurations)
DYNAMO = "dynamo"  # Dynamo's offline replay as shipped (kv-pool fails in 1.6.1)
SIMULATORS = (MODEL, DYNAMO)


@dataclasses.dataclass(frozen=True)
class Row:
    """Median over the successful runs of one configuration at one worker count (None: none succeeded)."""

    workers: int
    config: str
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    prefill_tokens: int | None
    input_tokens: int
    output_tokens_per_s: float | None
    runs: int
    failed_runs: int
    host_weight: float | None = None
    errors: tuple[str, ...] = ()

    def as_json(self, with_weight: bool = False) -> dict[str, object]:
        out: dict[str, object] = {
            "workers": self.workers,
            "config": self.config,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p90_ms": self.ttft_p90_ms,
            "prefill_tokens": self.prefill_tokens,
            "input_tokens": self.input_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "runs": self.runs,
            "failed_runs": self.failed_runs,
        }
        if with_weight:
            out["host_weight"] = self.host_weight
        return out


def _median_row(
    workers: int, config: str, results: list[RunResult], errors: list[str], input_tokens: int, host_weight: float | None
) -> Row:
    if not results:
        return Row(workers, config, None, None, None, input_tokens, None, 0, len(errors), host_weight, tuple(errors))
    return Row(
        workers,
        config,
        ttft_p50_ms=statistics.median(r.ttft_p50_ms for r in results),
        ttft_p90_ms=statistics.median(r.ttft_p90_ms for r in results),
        prefill_tokens=int(statistics.median(r.prefill_tokens for r in results)),
        input_tokens=int(statistics.median(r.input_tokens for r in results)),  # of the requests served
        output_tokens_per_s=statistics.median(r.output_tokens_per_s for r in results),
        runs=len(results),
        failed_runs=len(errors),
        host_weight=host_weight,
        errors=tuple(errors),
    )


class WhatIf:
    """Replays one trace on one simulator; `run` and `sweep` return table rows."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        spec: ClusterSpec,
        simulator: str = MODEL,
        repeats: int = 1,
        progress: TextIO | Literal["stderr"] | None = "stderr",
    ) -> None:
        if simulator not in SIMULATORS:
            raise ValueError(f"unknown simulator {simulator!r}: use {', '.join(SIMULATORS)}")
        if repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {repeats}")
        self.requests = list(requests)
        self.spec = spec
        self.simulator = simulator
        self.repeats = repeats
        self.progress = progress
        self.input_tokens = sum(r.input_length for r in self.requests)
        self._tmp = tempfile.TemporaryDirectory(prefix="maru-whatif-")
        self.trace_path = str(Path(self._tmp.name) / "trace.jsonl")
        write_trace(self.trace_path, self.requests)

    def close(self) -> None:
        self._tmp.cleanup()

    def __enter__(self) -> WhatIf:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def replay_once(self, spec: ClusterSpec, config: str, workers: int) -> RunResult:
        if self.simulator == DYNAMO:
            return dynamo_backend.replay(self.trace_path, spec, config, workers)
        return pool_model.replay(self.requests, spec, config, workers, mocker_timing(spec))

    def _say(self, text: str) -> None:
        """A progress line: on stderr (looked up now, not at import) unless another stream or None was given."""
        stream = sys.stderr if isinstance(self.progress, str) else self.progress  # str: "stderr"
        if stream is not None:
            print(text, file=stream, flush=True)

    def one(self, config: str, workers: int, spec: ClusterSpec | None = None) -> Row:
        spec = spec or self.spec
        results: list[RunResult] = []
        errors: list[str] = []
        for run in range(1, self.repeats + 1):
            t0 = time.monotonic()
            try:
                r = self.replay_once(spec, config, workers)
            except RuntimeError as exc:
                errors.append(str(exc))
                self._say(
                    f"[whatif] {workers} workers {config} (weight {spec.host_weight:g}) run {run}/{self.repeats}: "
                    f"FAILED in {time.monotonic() - t0:.1f}s: {exc}"
                )
                continue
            results.append(r)
            self._say(
                f"[whatif] {workers} workers {config} run {run}/{self.repeats}: prefill {r.prefill_tokens:,} of "
                f"{r.input_tokens:,} tokens, TTFT p50 {r.ttft_p50_ms:.0f} ms p90 {r.ttft_p90_ms:.0f} ms "
                f"({self.simulator}, {time.monotonic() - t0:.1f}s)"
            )
        weight = spec.host_weight if config == KV_POOL else None
        return _median_row(workers, config, results, errors, self.input_tokens, weight)

    def run(self, configs: Sequence[str], workers: Sequence[int]) -> list[Row]:
        return [self.one(c, w) for w in workers for c in configs]

    def sweep(self, weights: Sequence[float], workers: Sequence[int]) -> list[Row]:
        return [self.one(KV_POOL, w, self.spec.with_weight(x)) for w in workers for x in weights]


SWEEP_METRICS: dict[str, Callable[[Row], tuple]] = {
    "ttft_p90": lambda r: (r.ttft_p90_ms, r.prefill_tokens),
    "ttft_p50": lambda r: (r.ttft_p50_ms, r.prefill_tokens),
    "prefill_tokens": lambda r: (r.prefill_tokens, r.ttft_p90_ms),
}


def best_weights(rows: Sequence[Row], metric: str) -> dict[int, Row]:
    """Per worker count, the sweep row with the lowest `metric` (ties: the other metric)."""
    key = SWEEP_METRICS[metric]
    best: dict[int, Row] = {}
    for r in rows:
        if r.runs == 0:
            continue
        if r.workers not in best or key(r) < key(best[r.workers]):
            best[r.workers] = r
    return best
