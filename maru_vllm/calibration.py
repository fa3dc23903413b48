"""Hardware calibration: what `benchmarks/bench_connector.py` measured, in one typed file.

The connector benchmark writes it (`--calibration-out FILE.json`) and the what-if replay reads it
(`maru-dynamo whatif --calibration FILE.json`), so a user can replay traces with the pool's load
speed and the engine's recompute speed measured on their own hardware. This struct is the one
definition of that file; both sides encode and decode through it.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

CALIBRATION_VERSION = 1


class Calibration(msgspec.Struct, forbid_unknown_fields=True):
    """Measured on one machine with one model (min over alternating samples)."""

    model: str
    # KV bytes one token occupies across all layers (K and V) on one rank.
    kv_bytes_per_token: int
    # Pool -> paged-cache load bandwidth inside the engine, GB/s (10**9 bytes per second).
    load_gbps: float
    # Paged-cache -> pool store bandwidth, GB/s.
    store_gbps: float
    # Prefill (recompute) throughput of a cold prompt, tokens per second.
    prefill_tokens_per_s: float
    # memcpy of the same bytes in the same run, GB/s: the hardware reference for the two above.
    memcpy_gbps: float
    version: int = CALIBRATION_VERSION
    # The engine's own timing, where it was measured (benchmarks/real_traffic.py): a cold prompt
    # of n tokens alone, (n, ms to its first token), and a decode-only step of a batch holding c KV
    # tokens, (c, ms). With them the what-if's engines take these times instead of the mocker's
    # scaled to `prefill_tokens_per_s` (whose fixed cost per prefill is a GPU's, not this engine's).
    prefill_points: list[tuple[int, float]] | None = None
    decode_points: list[tuple[int, float]] | None = None
    # Prompt tokens one engine step computes at most (vLLM's max_num_batched_tokens), where known.
    step_tokens: int | None = None


def write_calibration(path: str | Path, calibration: Calibration) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(calibration)) + b"\n")


def read_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file; errors are one line naming the file and the problem."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ValueError(f"calibration file {p}: {exc.strerror or exc}") from None
    try:
        cal = msgspec.json.decode(data, type=Calibration)
    except msgspec.ValidationError as exc:
        raise ValueError(f"calibration file {p}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"calibration file {p}: not JSON ({exc})") from None
    if cal.version != CALIBRATION_VERSION:
        raise ValueError(f"calibration file {p}: version {cal.version}, this maru-dynamo reads {CALIBRATION_VERSION}")
    for name in ("load_gbps", "store_gbps", "prefill_tokens_per_s", "memcpy_gbps"):
        if not getattr(cal, name) > 0:
            raise ValueError(f"calibration file {p}: {name} must be > 0, got {getattr(cal, name)}")
    if cal.kv_bytes_per_token <= 0:
        raise ValueError(f"calibration file {p}: kv_bytes_per_token must be > 0, got {cal.kv_bytes_per_token}")
    if cal.step_tokens is not None and cal.step_tokens < 1:
        raise ValueError(f"calibration file {p}: step_tokens must be >= 1, got {cal.step_tokens}")
    for name in ("prefill_points", "decode_points"):
        points = getattr(cal, name)
        if points is None:
            continue
        xs = [x for x, _ in points]
        if len(points) < 2 or xs != sorted(set(xs)) or any(x <= 0 or not y > 0 for x, y in points):
            raise ValueError(
                f"calibration file {p}: {name} must be at least two (tokens, ms) pairs, tokens rising, all > 0"
            )
    return cal
