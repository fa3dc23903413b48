"""Mooncake-format request traces: read, validate, cut, write.

One JSON object per line: ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens) and
``hash_ids`` (one id per ``trace_block_size`` tokens of the prompt; equal ids at equal positions
are a shared prefix, the last block may be partial). This is the format Dynamo's offline replay
reads (``trace_format="mooncake"``); the pool model reads the same requests through this module,
and `write_trace` hands Dynamo exactly the requests the pool model sees.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path


class TraceError(ValueError):
    """A trace that cannot be replayed; the message is one line naming the file and line."""


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _field_int(obj: dict, name: str, where: str, minimum: int) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_line(line: str, where: str, trace_block_size: int) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a number of ms >= 0, got {ts!r}")
    input_length = _field_int(obj, "input_length", where, 1)
    output_length = _field_int(obj, "output_length", where, 1)
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers >= 0")
    need = -(-input_length // trace_block_size)
    if len(hash_ids) < need:
        raise TraceError(
            f"{where}: {len(hash_ids)} hash_ids cover {len(hash_ids) * trace_block_size} tokens at "
            f"--trace-block-size {trace_block_size}, but input_length is {input_length}"
        )
    return TraceRequest(float(ts), input_length, output_length, tuple(hash_ids[:need]))


def read_trace(path: str | Path, trace_block_size: int = 512, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests of the trace at `path` (all when None), validated."""
    p = Path(path)
    try:
        fh = p.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"trace {p}: {exc.strerror or exc}") from None
    requests: list[TraceRequest] = []
    with fh:
        for number, line in enumerate(fh, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            requests.append(parse_line(line, f"trace {p} line {number}", trace_block_size))
    if not requests:
        raise TraceError(f"trace {p}: no requests")
    return requests


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    with Path(path).open("w", encoding="utf-8") as fh:
        for r in requests:
            ts = int(r.timestamp_ms) if float(r.timestamp_ms).is_integer() else r.timestamp_ms
            fh.write(
                json.dumps(
                    {
                        "timestamp": ts,
                        "input_length": r.input_length,
                        "output_length": r.output_length,
                        "hash_ids": list(r.hash_ids),
                    }
                )
                + "\n"
            )


def chain_keys(ids: Iterable[int]) -> list[int]:
    """One key per prefix: key k identifies ids[:k+1] (hash of tuples of ints is stable across runs)."""
    keys: list[int] = []
    prev = 0
    for h in ids:
        prev = hash((prev, h))
        keys.append(prev)
    return keys


def unique_prefix_tokens(requests: Sequence[TraceRequest], trace_block_size: int) -> int:
    """Prefill tokens an ideal shared cache computes: each request minus its longest prefix seen before.

    Counted in whole trace blocks (a partial last block is never shared).
    """
    seen: set[int] = set()
    total = 0
    for r in requests:
        keys = chain_keys(r.hash_ids[: r.input_length // trace_block_size])
        shared = 0
        for key in keys:
            if key not in seen:
                break
            shared += 1
        total += r.input_length - shared * trace_block_size
        seen.update(keys)
    return total
