"""The what-if on the traffic `real_traffic.py` replayed: calibrated on that run, side by side.

`calibration_from_runs` turns what the engines counted during the real runs into a
`maru_vllm.fixtures.calibration.Calibration` (prefill tokens computed per second of prefill, pool bytes
loaded per second of loading, the model's KV bytes per token); `whatif_rows` replays the very
scaled trace AIPerf sent through ``maru-dynamo whatif --calibration`` with the engines' block size
and KV-cache blocks (``vllm:cache_config_info``); `side_by_side` prints both, and the TTFT p90 and
prefill-token orderings of the configurations each one has; `predict_rates` does it for each
rate of a sweep.
`real_traffic_predict.py` predicts again from a recorded run.

Real configurations and their what-if counterparts: plain-rr = round-robin, plain-kv = kv-gpu,
maru-pool = kv-pool (maru-rr and maru-kv-gpu have none: the what-if's round-robin and kv-gpu have no pool).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from harness import min_time
from maru_dynamo.components.whatif.spec import kv_bytes_per_token_of_model
from maru_vllm.fixtures.calibration import Calibration, write_calibration
from maru_vllm.launch.engine_metrics import scrape

COUNTERPART = {"plain-rr": "round-robin", "plain-kv": "kv-gpu", "maru-pool": "kv-pool"}
DEFAULT_LOAD_GBPS = 1.0  # only when no run loaded anything from the pool


def cache_config(metrics_url: str) -> tuple[int, int]:
    """(block size in tokens, KV-cache blocks) of one engine, from ``vllm:cache_config_info``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = scrape(metrics_url)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                blocks = s.labels.get("num_gpu_blocks") or s.labels.get("num_cpu_blocks") or "0"
                return int(s.labels.get("block_size", "0")), int(blocks)
    raise RuntimeError(f"{metrics_url}: no vllm:cache_config_info")


def _memcpy_gbps(nbytes: int = 64 << 20, rounds: int = 5) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return nbytes / min_time(lambda: np.copyto(dst, src), rounds) / 1e9


def calibration_from_runs(runs: Sequence[object], model: str, step_tokens: int | None = None) -> Calibration:
    """Prefill speed and pool load bandwidth as the engines measured them during `runs`: the median
    prefill probe (`traffic_probes.engine_timing_probe`) where the runs have one, else prefill tokens
    over the engines' summed prefill seconds (which understates the speed when prefills overlap);
    and the engines' own prefill and decode times where the runs probed them."""
    prefill_tokens = sum(getattr(r, "prefill_tokens") for r in runs)  # noqa: B009
    prefill_s = sum(getattr(r, "prefill_seconds") for r in runs)  # noqa: B009
    load_bytes = sum(getattr(r, "load_bytes") for r in runs)  # noqa: B009
    load_s = sum(getattr(r, "load_seconds") for r in runs)  # noqa: B009
    probes = sorted(float(getattr(r, "prefill_probe_tokens_per_s", 0.0)) for r in runs)
    probes = [p for p in probes if p > 0]
    if probes:  # a cold prompt alone, as the mocker's prefill speed is defined
        prefill_rate = probes[len(probes) // 2]
    elif prefill_tokens > 0 and prefill_s > 0:
        prefill_rate = prefill_tokens / prefill_s
    else:
        raise RuntimeError("no prefill was measured: cannot calibrate the what-if")
    load_gbps = load_bytes / load_s / 1e9 if load_s > 0 and load_bytes > 0 else DEFAULT_LOAD_GBPS
    timings = [t for r in runs if (t := getattr(r, "timing", None))]
    return Calibration(
        model=model,
        kv_bytes_per_token=kv_bytes_per_token_of_model(model),
        load_gbps=load_gbps,
        store_gbps=load_gbps,
        prefill_tokens_per_s=prefill_rate,
        memcpy_gbps=_memcpy_gbps(),
        prefill_points=median_points([t["prefill_points"] for t in timings]),
        decode_points=median_points([t["decode_points"] for t in timings]),
        step_tokens=step_tokens,
    )


def median_points(series: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float]] | None:
    """Per x, the median y over the runs' (x, y) points (the x every run measured); None for none."""
    if not series:
        return None
    xs = sorted(set.intersection(*({x for x, _ in points} for points in series)))
    out = [(x, float(np.median([y for points in series for px, y in points if px == x]))) for x in xs]
    return out if len(out) >= 2 else None


def whatif_rows(
    trace_file: Path,
    cal_file: Path,
    *,
    workers: int,
    trace_block_size: int,
    block_size: int,
    gpu_blocks: int,
    pool_size: str,
    configs: Sequence[str],
    extra_args: Sequence[str] = (),
    timeout_s: float = 1800,
) -> list[dict[str, object]]:
    """``maru-dynamo whatif`` on `trace_file` (its rows as JSON dicts); `extra_args` go to it."""
    cmd = [
        sys.executable,
        "-m",
        "maru_dynamo.components.main",
        "whatif",
        str(trace_file),
        "--workers",
        str(workers),
        "--configs",
        ",".join(configs),
        "--trace-block-size",
        str(trace_block_size),
        "--block-size",
        str(block_size),
        "--gpu-blocks",
        str(gpu_blocks),
        "--pool-size",
        pool_size,
        "--calibration",
        str(cal_file),
        *extra_args,
        "--json",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"maru-dynamo whatif exited {res.returncode}: {res.stderr.strip()[-2000:]}")
    rows = json.loads(res.stdout)["results"]
    return [r for r in rows if isinstance(r, dict)]


def order_of(values: dict[str, float]) -> str:
    """`a < b = c`: names by value, '=' where two are within 2% of each other."""
    out = ""
    prev: float | None = None
    for name, v in sorted(values.items(), key=lambda kv: kv[1]):
        if prev is not None:
            out += " = " if abs(v - prev) <= 0.02 * max(abs(v), abs(prev)) else " < "
        out += name
        prev = v
    return out


def side_by_side(real: Sequence[dict[str, object]], whatif: Sequence[dict[str, object]], cal: Calibration) -> str:
    """Prefill tokens and TTFT p50/p90, real vs what-if, and the orderings each one gives."""
    by_whatif = {str(r["config"]): r for r in whatif}
    lines = [
        f"what-if calibrated here: prefill {cal.prefill_tokens_per_s:.0f} tokens/s, pool loads "
        f"{cal.load_gbps:.3g} GB/s, {cal.kv_bytes_per_token} KV bytes/token",
        f"{'config':<10} {'what-if':<12} {'prefill real':>12} {'what-if':>9} {'TTFT p50 real':>13} "
        f"{'what-if':>9} {'TTFT p90 real':>13} {'what-if':>9}",
    ]
    real_p90: dict[str, float] = {}
    sim_p90: dict[str, float] = {}
    real_pf: dict[str, float] = {}
    sim_pf: dict[str, float] = {}
    for r in real:
        name = str(r["config"])
        twin = COUNTERPART.get(name)
        w = by_whatif.get(twin) if twin else None
        if w is None:
            continue
        lines.append(
            f"{name:<10} {twin:<12} {r['prefill_tokens']:>12} {w['prefill_tokens']!s:>9} "
            f"{r['ttft_p50_ms']:>13.1f} {_f(w['ttft_p50_ms']):>9} {r['ttft_p90_ms']:>13.1f} {_f(w['ttft_p90_ms']):>9}"
        )
        real_p90[name], real_pf[name] = float(r["ttft_p90_ms"]), float(r["prefill_tokens"])  # type: ignore[arg-type]
        if isinstance(w["ttft_p90_ms"], (int, float)) and isinstance(w["prefill_tokens"], (int, float)):
            sim_p90[name], sim_pf[name] = float(w["ttft_p90_ms"]), float(w["prefill_tokens"])
    lines.append(f"TTFT p90 order   real: {order_of(real_p90)}   what-if: {order_of(sim_p90)}")
    lines.append(f"prefill order    real: {order_of(real_pf)}   what-if: {order_of(sim_pf)}")
    return "\n".join(lines)


def _f(v: object) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"


def predict_rates(
    real: Sequence[dict[str, object]],
    traffic_files: dict[float, Path],
    cal: Calibration,
    *,
    work: Path,
    workers: int,
    trace_block_tokens: int,
    engine_block_tokens: int,
    kv_cache_tokens: int,
    pool_size: str,
) -> tuple[str, dict[tuple[str, float], dict[str, float]]]:
    """The what-if at each rate's traffic (`traffic_files`), calibrated by `cal`, beside the real
    rows (``real_traffic --json`` rows, each with its ``rate``); and its predictions keyed by
    (real config, rate)."""
    cal_file = work / "calibration.json"
    write_calibration(cal_file, cal)
    # The what-if needs whole engine blocks per hash id: where the engines' blocks are larger than
    # the trace's, it simulates blocks of the trace's size (the same KV-cache tokens in all).
    block = math.gcd(engine_block_tokens, trace_block_tokens)
    texts: list[str] = []
    predicted: dict[tuple[str, float], dict[str, float]] = {}
    for rate, trace_file in sorted(traffic_files.items()):
        at_rate = [r for r in real if r["rate"] == rate]
        rows = whatif_rows(
            trace_file,
            cal_file,
            workers=workers,
            trace_block_size=trace_block_tokens,
            block_size=block,
            gpu_blocks=kv_cache_tokens // block,
            pool_size=pool_size,
            configs=sorted({COUNTERPART[str(r["config"])] for r in at_rate if r["config"] in COUNTERPART}),
        )
        by_twin = {str(w["config"]): w for w in rows}
        for r in at_rate:
            w = by_twin.get(COUNTERPART.get(str(r["config"]), ""))
            if w is not None and isinstance(w.get("ttft_p90_ms"), (int, float)):
                predicted[(str(r["config"]), rate)] = {
                    "prefill_tokens": float(w["prefill_tokens"]),  # type: ignore[arg-type]
                    "ttft_p90_ms": float(w["ttft_p90_ms"]),  # type: ignore[arg-type]
                    "ttft_p50_ms": float(w["ttft_p50_ms"]),  # type: ignore[arg-type]
                }
        texts.append(f"-- rate {rate:g} --\n" + side_by_side(at_rate, rows, cal))
    return "\n".join(texts), predicted
