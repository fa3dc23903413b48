"""The load side of `real_traffic.py`: Mooncake-format traffic scaled to this machine, and AIPerf.

* `scale_trace` turns a Mooncake trace (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids`` of ``TRACE_BLOCK_TOKENS``-token blocks) into one for a small CPU engine: each hash
  id stands for ``block_tokens`` tokens instead, lengths shrink by the same factor (inputs stay
  within their hash blocks), arrivals are divided by ``speedup``.
* `sample_sessions` keeps every k-th conversation session of a trace (all of its turns, at their
  own times), so a short replay keeps the whole trace's prefix reuse: the first N requests of a
  conversation trace share less than the whole, because later turns of its sessions fall outside.
* `synthetic_trace` writes the prefix-ratio workload of Dynamo's router benchmark in the same
  format: every request starts with one of ``prefixes`` shared prefixes covering ``prefix_ratio``
  of its input, the rest is its own; Poisson arrivals at ``rate`` requests/s.
* `aiperf_command` / `read_aiperf` run AIPerf 0.13 (``aiperf profile``, in its own venv
  ``.venv-aiperf``, made by ``make aiperf``) on a trace with ``--fixed-schedule`` and read its
  per-request export: TTFT, ITL, output tokens, errors and how late each request was sent.

Errors in inputs are `TrafficError` with one line naming the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path

from harness import percentile
from maru_dynamo.components.whatif.trace import TraceError, TraceRequest, read_trace, write_trace

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces as published
REPO = Path(__file__).resolve().parents[1]
AIPERF_VENV = REPO / ".venv-aiperf"
AIPERF_BIN = AIPERF_VENV / "bin" / "aiperf"


class TrafficError(ValueError):
    """Traffic that cannot be built; the message names the bad value and what is allowed."""


@dataclasses.dataclass(frozen=True)
class Traffic:
    """A trace ready to replay: its requests (scaled), where it came from and what was dropped."""

    name: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]
    dropped_too_long: int = 0

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @property
    def duration_s(self) -> float:
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000 if self.requests else 0.0

    def unique_prefix_tokens(self) -> int:
        """Input tokens an ideal shared cache computes: each distinct hash-id prefix once."""
        seen: set[tuple[int, ...]] = set()
        total = 0
        for r in self.requests:
            for i in range(len(r.hash_ids)):
                key = r.hash_ids[: i + 1]
                if key in seen:
                    continue
                seen.add(key)
                total += min(self.block_tokens, r.input_length - i * self.block_tokens)
        return total

    def write(self, path: Path) -> Path:
        write_trace(path, self.requests)
        return path


def _positive(name: str, value: float, allowed: str) -> None:
    if not value > 0:
        raise TrafficError(f"{name} {value!r}: use {allowed}")


def read_mooncake(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests of a Mooncake JSONL trace, validated as the what-if reads it
    (`maru_dynamo.components.whatif.trace`); a bad line is one line naming it."""
    try:
        return read_trace(path, TRACE_BLOCK_TOKENS, limit)
    except TraceError as exc:
        # its messages begin "trace PATH ...": the option is --trace
        raise TrafficError(f"--{exc}") from None


def scale_trace(
    requests: Sequence[TraceRequest],
    *,
    name: str,
    block_tokens: int,
    speedup: float = 1.0,
    max_output: int = 32,
    max_total: int = 4096,
    min_output: int = 4,
) -> Traffic:
    """`requests` with each hash id standing for `block_tokens` tokens (see the module doc).

    Lengths shrink by ``block_tokens / 512`` (an input keeps its number of hash blocks: at least
    one token in its last block); outputs are kept within `min_output`..`max_output` (a reply of
    one token from a byte-level fixture model can be an incomplete UTF-8 byte, streamed as no
    text, which AIPerf counts as a failed request); requests whose input and output exceed
    `max_total` (the engines' context) are dropped and counted.
    """
    if not 1 <= block_tokens <= TRACE_BLOCK_TOKENS:
        raise TrafficError(f"--trace-block-size {block_tokens}: use 1 to {TRACE_BLOCK_TOKENS} tokens per hash id")
    _positive("--speedup", speedup, "a number > 0 (arrival gaps are divided by it)")
    _positive("--max-output-tokens", max_output, "an integer >= 1")
    factor = block_tokens / TRACE_BLOCK_TOKENS
    t0 = requests[0].timestamp_ms if requests else 0.0
    out: list[TraceRequest] = []
    dropped = 0
    for r in requests:
        blocks = len(r.hash_ids)
        length = min(blocks * block_tokens, max((blocks - 1) * block_tokens + 1, math.ceil(r.input_length * factor)))
        output = max(min(min_output, max_output), min(max_output, round(r.output_length * factor)))
        if length + output > max_total:
            dropped += 1
            continue
        out.append(TraceRequest(round((r.timestamp_ms - t0) / speedup, 3), length, output, r.hash_ids))
    if not out:
        raise TrafficError(f"no request of the trace fits {max_total} tokens at {block_tokens} tokens per hash id")
    return Traffic(name, block_tokens, tuple(out), dropped)


def session_of(requests: Sequence[TraceRequest]) -> list[int]:
    """Each request's conversation session, numbered in order of first appearance.

    A session is the requests whose second hash id is the same (the first one is the system
    prompt every request of the Mooncake traces shares; a later turn repeats the whole earlier
    conversation, so its prefix starts with the session's first own block). A request of one
    hash id is a session of its own.
    """
    number: dict[object, int] = {}
    out = []
    for i, r in enumerate(requests):
        key: object = r.hash_ids[1] if len(r.hash_ids) > 1 else ("single", i)
        out.append(number.setdefault(key, len(number)))
    return out


def sample_sessions(requests: Sequence[TraceRequest], every: int) -> list[TraceRequest]:
    """The requests of sessions 0, k, 2k, ... (`session_of`), in trace order, times unchanged.

    The rule depends only on the order sessions appear in, never on what any configuration does.
    """
    if every < 1:
        raise TrafficError(f"--sample-sessions {every}: use an integer >= 1 (keep every k-th session)")
    return [r for r, s in zip(requests, session_of(requests)) if s % every == 0]


@dataclasses.dataclass(frozen=True)
class PrefixWorkload:
    """Dynamo's router benchmark's workload shape: shared prefixes covering a share of each input."""

    requests: int = 64
    input_tokens: int = 1024
    output_tokens: int = 16
    prefix_ratio: float = 0.75
    prefixes: int = 4
    rate: float = 2.0  # requests per second, Poisson
    seed: int = 0

    def validate(self) -> None:
        if self.requests < 1:
            raise TrafficError(f"--requests {self.requests}: use an integer >= 1")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise TrafficError("--synthetic-isl/--synthetic-osl: use integers >= 1")
        if not 0.0 <= self.prefix_ratio <= 1.0:
            raise TrafficError(f"--prefix-ratio {self.prefix_ratio}: use a share from 0.0 to 1.0")
        if self.prefixes < 1:
            raise TrafficError(f"--prefixes {self.prefixes}: use an integer >= 1")
        _positive("--rate", self.rate, "requests per second > 0")


def synthetic_trace(w: PrefixWorkload, block_tokens: int) -> Traffic:
    """`w` as a Mooncake trace: prefix hash ids shared per group, the rest unique to the request."""
    w.validate()
    if block_tokens < 1:
        raise TrafficError(f"--trace-block-size {block_tokens}: use an integer >= 1")
    rng = random.Random(w.seed)
    blocks = math.ceil(w.input_tokens / block_tokens)
    shared = min(blocks, round(w.input_tokens * w.prefix_ratio) // block_tokens)
    prefix_ids = [[g * shared + i for i in range(shared)] for g in range(w.prefixes)]
    next_id = w.prefixes * shared
    t = 0.0
    out = []
    for _ in range(w.requests):
        group = rng.randrange(w.prefixes)
        own = list(range(next_id, next_id + blocks - shared))
        next_id += blocks - shared
        out.append(TraceRequest(round(t, 3), w.input_tokens, w.output_tokens, tuple(prefix_ids[group] + own)))
        t += rng.expovariate(w.rate) * 1000
    name = f"synthetic(prefix_ratio={w.prefix_ratio:g}, prefixes={w.prefixes}, isl={w.input_tokens})"
    return Traffic(name, block_tokens, tuple(out))


# -- AIPerf ----------------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")
TOKENIZER_REPO = "maru-fixture/tokenizer"


def tokenizer_cache(model_dir: Path, cache_dir: Path) -> tuple[str, dict[str, str]]:
    """The model directory's tokenizer as a local Hugging Face cache entry: (name, environment).

    AIPerf 0.13's dataset workers load the tokenizer offline through the hub cache
    (``snapshot_download(local_files_only=True)``), which refuses a directory path; the same files
    laid out as a cached snapshot load with no network and no ``builtin`` stand-in.
    """
    digest = hashlib.sha1(str(model_dir.resolve()).encode()).hexdigest()
    repo = cache_dir / ("models--" + TOKENIZER_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / digest
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = model_dir / name
        if src.exists():
            shutil.copyfile(src, snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(digest, encoding="utf-8")
    env = {"HF_HUB_CACHE": str(cache_dir), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return TOKENIZER_REPO, env


def aiperf_command(
    *, url: str, model: str, tokenizer: str, trace_file: Path, artifact_dir: Path, block_tokens: int, slo_ms: float
) -> list[str]:
    """`aiperf profile` replaying `trace_file` on the frontend's OpenAI completions endpoint, streaming."""
    return [
        str(AIPERF_BIN),
        "profile",
        "--model",
        model,
        "--url",
        url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        tokenizer,
        "--input-file",
        str(trace_file),
        "--custom-dataset-type",
        "mooncake_trace",
        "--fixed-schedule",
        "--isl-block-size",
        str(block_tokens),
        "--extra-inputs",
        "ignore_eos:true",
        "--random-seed",
        "0",
        "--goodput",
        f"time_to_first_token:{slo_ms:g}",
        "--artifact-dir",
        str(artifact_dir),
        "--ui-type",
        "none",
    ]


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What AIPerf measured on one run (per request, from its JSONL export; lag from its summary)."""

    completed: int
    failed: int
    ttft_ms: tuple[float, ...]  # of completed requests, sorted
    itl_ms: tuple[float, ...]
    output_tokens: int  # as the server counted them (usage.completion_tokens)
    duration_s: float  # first request sent to last one done
    schedule_lag_p50_ms: float = math.nan  # how late AIPerf sent requests against the trace's schedule
    schedule_lag_p99_ms: float = math.nan
    goodput_rps: float = math.nan

    def ttft(self, q: float) -> float:
        return percentile(self.ttft_ms, q)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


def _metric(record: dict[str, object], name: str) -> float | None:
    metrics = record.get("metrics")
    m = metrics.get(name) if isinstance(metrics, dict) else None
    v = m.get("value") if isinstance(m, dict) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _summary_value(summary: dict[str, object], name: str) -> float:
    m = summary.get(name)
    v = m.get("avg") if isinstance(m, dict) else None
    return float(v) if isinstance(v, (int, float)) else math.nan


def read_aiperf(artifact_dir: Path) -> LoadResult:
    """Parse AIPerf's per-record export (and its summary, when there) under `artifact_dir`."""
    records_file = next(artifact_dir.rglob("profile_export.jsonl"), None)
    if records_file is None:
        raise RuntimeError(f"AIPerf wrote no profile_export.jsonl under {artifact_dir}")
    ttft, itl = [], []
    completed = failed = out_tokens = 0
    starts, ends = [], []
    for line in records_file.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        t = _metric(rec, "time_to_first_token")
        if rec.get("error") or t is None:
            failed += 1
            continue
        completed += 1
        ttft.append(t)
        if (i := _metric(rec, "inter_token_latency")) is not None:
            itl.append(i)
        out = _metric(rec, "usage_completion_tokens")
        out = out if out is not None else _metric(rec, "output_sequence_length")
        out_tokens += int(out or 0)
        meta = rec.get("metadata")
        if isinstance(meta, dict) and isinstance(meta.get("request_start_ns"), (int, float)):
            starts.append(float(meta["request_start_ns"]))
            ends.append(float(meta.get("request_end_ns") or meta["request_start_ns"]))
    duration = (max(ends) - min(starts)) / 1e9 if starts else 0.0
    summary_file = next(artifact_dir.rglob("profile_export_aiperf.json"), None)
    summary = json.loads(summary_file.read_text(encoding="utf-8")) if summary_file else {}
    return LoadResult(
        completed,
        failed,
        tuple(sorted(ttft)),
        tuple(itl),
        out_tokens,
        duration,
        _summary_value(summary, "replay_sched_lag_p50"),
        _summary_value(summary, "replay_sched_lag_p99"),
        _summary_value(summary, "goodput"),
    )


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
