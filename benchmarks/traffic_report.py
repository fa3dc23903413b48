"""What `real_traffic.py` reports: per (configuration, rate) medians over repeats, goodput, plots.

* `Summary`: one configuration at one rate, its runs and their medians (`as_json` is the row of
  ``--json``, `detail` adds every run's own figures).
* `goodput`: per configuration the highest swept rate that meets the TTFT SLO (TTFT p90 <=
  ``--slo-ttft-ms``, median over repeats) with no failed request, every lower swept rate meeting
  it too; None when the lowest rate already misses it.
* `format_table`, `plot_cdf` (one rate: TTFT CDFs and prefill tokens), `plot_sweep` (several:
  TTFT p90 and prefill tokens against the rate, the SLO drawn).

Runs are duck-typed (`real_traffic.Run`): ``config``, ``rate``, ``workers``, ``load``
(`traffic_load.LoadResult`) and the engines' counters.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from traffic_load import median

CORES = len(os.sched_getaffinity(0))  # what a run's CPU shares are of


@dataclasses.dataclass
class Summary:
    config: str
    rate: float
    workers: int
    runs: list[Any]

    def _med(self, f: Callable[[Any], float]) -> float:
        return median([f(r) for r in self.runs])

    def as_json(self) -> dict[str, object]:
        return {
            "config": self.config,
            "rate": self.rate,
            "workers": self.workers,
            "completed": int(self._med(lambda r: r.load.completed)),
            "failed": max(r.load.failed for r in self.runs),
            "ttft_p50_ms": round(self._med(lambda r: r.load.ttft(50)), 2),
            "ttft_p90_ms": round(self._med(lambda r: r.load.ttft(90)), 2),
            "ttft_p99_ms": round(self._med(lambda r: r.load.ttft(99)), 2),
            "itl_p50_ms": round(self._med(lambda r: median(r.load.itl_ms)), 3),
            "output_tokens_per_s": round(self._med(lambda r: r.load.output_tokens_per_s), 2),
            "prefill_tokens": int(self._med(lambda r: r.prefill_tokens)),
            "pool_loaded_tokens": int(self._med(lambda r: r.pool_loaded_tokens)),
        }

    def meets(self, slo_ms: float) -> bool:
        j = self.as_json()
        return j["failed"] == 0 and float(j["ttft_p90_ms"]) <= slo_ms  # type: ignore[arg-type]

    def load_path(self) -> dict[str, float]:
        """How pool loads went in the engines during the replays (summed over the runs): GB/s of
        the whole load and the mean per-chunk time of each part."""
        chunks = sum(r.load_chunks for r in self.runs)
        seconds = sum(r.load_seconds for r in self.runs)
        out = {"load_gbps": sum(r.load_bytes for r in self.runs) / seconds / 1e9 if seconds > 0 else 0.0}
        for part in ("acquire", "copy", "release"):
            s = sum(r.load_parts.get(part, 0.0) for r in self.runs)
            out[f"load_{part}_us_per_chunk"] = s / chunks * 1e6 if chunks else 0.0
        out["load_us_per_chunk"] = seconds / chunks * 1e6 if chunks else 0.0
        out["load_chunk_bytes"] = sum(r.load_bytes for r in self.runs) / chunks if chunks else 0.0
        return out

    def detail(self) -> dict[str, object]:
        """The summary's extras and every run's own figures (for the record beside --json)."""
        runs = [
            {
                "repeat": r.repeat,
                "completed": r.load.completed,
                "failed": r.load.failed,
                "ttft_p50_ms": round(r.load.ttft(50), 2),
                "ttft_p90_ms": round(r.load.ttft(90), 2),
                "ttft_p99_ms": round(r.load.ttft(99), 2),
                "itl_p50_ms": round(median(r.load.itl_ms), 3),
                "prefill_tokens": r.prefill_tokens,
                "pool_loaded_tokens": r.pool_loaded_tokens,
                "requests_per_worker": r.requests_per_worker,
                "frontend_cpu_s": round(r.frontend_cpu_s, 3),
                "nats_msgs": r.nats_msgs,
                "nats_bytes": r.nats_bytes,
                "replay_s": round(r.replay_s, 2),
                "prefill_probe_tokens_per_s": round(r.prefill_probe_tokens_per_s, 1),
                "ratio_probe": r.ratio_probe.as_json() if r.ratio_probe is not None else None,
                "kv_cache_tokens": r.kv_cache_tokens,
                "loadavg_1m_before_after": [round(v, 2) for v in r.loadavg],
                "cpu_share_of_the_cores": {
                    k: round(v / r.replay_s / CORES, 3) for k, v in r.cpu_s.items() if r.replay_s
                },
                "schedule_lag_p99_ms": r.load.schedule_lag_p99_ms,
            }
            for r in self.runs
        ]
        return {"config": self.config, **self.as_json(), **self.extras(), "runs": runs}

    def extras(self) -> dict[str, object]:
        n = max(1, int(self._med(lambda r: r.load.completed + r.load.failed)))
        return {
            "goodput_rps": self._med(lambda r: r.load.goodput_rps),
            "schedule_lag_p50_ms": self._med(lambda r: r.load.schedule_lag_p50_ms),
            "schedule_lag_p99_ms": self._med(lambda r: r.load.schedule_lag_p99_ms),
            "requests_per_worker": [sorted(r.requests_per_worker, reverse=True) for r in self.runs],
            "frontend_cpu_ms_per_request": self._med(lambda r: r.frontend_cpu_s) * 1000 / n,
            "nats_msgs_per_s": self._med(lambda r: r.nats_msgs / r.replay_s if r.replay_s else 0.0),
            "nats_kib_per_s": self._med(lambda r: r.nats_bytes / 1024 / r.replay_s if r.replay_s else 0.0),
            "nats_bytes_per_request": self._med(lambda r: r.nats_bytes) / n,
            **self.load_path(),
        }


def summarise(runs: Sequence[Any], config_order: Sequence[str]) -> list[Summary]:
    """One `Summary` per (config, rate), configs in `config_order`, rates ascending."""
    keys = sorted({(r.config, r.rate) for r in runs}, key=lambda k: (config_order.index(k[0]), k[1]))
    return [Summary(c, rate, runs[0].workers, [r for r in runs if (r.config, r.rate) == (c, rate)]) for c, rate in keys]


def goodput(summaries: Sequence[Summary], slo_ms: float) -> list[dict[str, object]]:
    """Per configuration, the highest swept rate meeting the SLO with every lower rate meeting it."""
    out: list[dict[str, object]] = []
    for config in dict.fromkeys(s.config for s in summaries):
        best: float | None = None
        for s in sorted((s for s in summaries if s.config == config), key=lambda s: s.rate):
            if not s.meets(slo_ms):
                break
            best = s.rate
        out.append({"config": config, "max_rate": best, "slo_ttft_ms": slo_ms})
    return out


def format_table(summaries: Sequence[Summary], rate_unit: str) -> str:
    head = (
        f"{'config':<12} {rate_unit:>7} {'done':>5} {'fail':>4} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} "
        f"{'out tok/s':>9} {'lag p99':>7} {'prefill':>8} {'pool-ld':>8} {'ld GB/s':>7} {'us/chunk':>8} "
        f"{'fe ms/req':>9} {'nats msg/s':>10}  req/worker"
    )
    rows = [head, "-" * len(head)]
    for s in summaries:
        j, x = s.as_json(), s.extras()
        rows.append(
            f"{s.config:<12} {s.rate:>7g} {j['completed']:>5} {j['failed']:>4} {j['ttft_p50_ms']:>9.1f} "
            f"{j['ttft_p90_ms']:>8.1f} {j['ttft_p99_ms']:>8.1f} {j['itl_p50_ms']:>8.2f} "
            f"{j['output_tokens_per_s']:>9.1f} "
            f"{x['schedule_lag_p99_ms']:>7.1f} {j['prefill_tokens']:>8} {j['pool_loaded_tokens']:>8} "
            f"{x['load_gbps']:>7.2f} {x['load_us_per_chunk']:>8.0f} {x['frontend_cpu_ms_per_request']:>9.2f} "
            f"{x['nats_msgs_per_s']:>10.1f}  " + " ".join("/".join(map(str, r)) for r in x["requests_per_worker"])  # type: ignore[attr-defined]
        )
    return "\n".join(rows)


def format_goodput(rows: Sequence[dict[str, object]], rate_unit: str, baseline: str = "plain-kv") -> str:
    base = next((r["max_rate"] for r in rows if r["config"] == baseline), None)
    out = [
        f"goodput: the highest {rate_unit} with TTFT p90 <= {rows[0]['slo_ttft_ms']:g} ms and 0 failed" if rows else ""
    ]
    for r in rows:
        rate = r["max_rate"]
        vs = (
            f" ({float(rate) / float(base):.2f}x {baseline})"
            if isinstance(rate, (int, float)) and isinstance(base, (int, float)) and base > 0
            else ""
        )
        out.append(f"  {r['config']:<12} {'none swept' if rate is None else f'{rate:g}'}{vs}")
    return "\n".join(out)


def plot_cdf(summaries: Sequence[Summary], path: Path, title: str) -> None:
    """One rate: TTFT CDFs (every repeat) and prefill tokens computed / loaded per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in summaries:
        ttft = sorted(t for r in s.runs for t in r.load.ttft_ms)
        ax1.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=s.config)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (ms)")
    ax1.set_ylabel("share of requests")
    ax1.set_title("TTFT CDF (all repeats)")
    ax1.legend()
    names = [s.config for s in summaries]
    computed = [int(s.as_json()["prefill_tokens"]) for s in summaries]  # type: ignore[call-overload]
    loaded = [int(s.as_json()["pool_loaded_tokens"]) for s in summaries]  # type: ignore[call-overload]
    ax2.bar(names, computed, color="tab:blue", label="computed")
    ax2.bar(names, loaded, bottom=computed, color="tab:orange", label="loaded from the pool")
    ax2.set_ylabel("prompt tokens (median over repeats)")
    ax2.set_title("prefill tokens computed")
    ax2.legend(loc="lower right")
    ax2.tick_params(axis="x", rotation=20)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_sweep(
    summaries: Sequence[Summary],
    path: Path,
    title: str,
    *,
    slo_ms: float,
    rate_label: str,
    predicted: dict[tuple[str, float], dict[str, float]] | None = None,
) -> None:
    """Several rates: TTFT p90 (median, the repeats' range as error bars) and prefill tokens computed
    against the rate, one line per configuration, the SLO as a dashed line; the what-if's
    predictions (`predicted`, keyed by (config, rate)) dotted in the same colour where given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, config in enumerate(dict.fromkeys(s.config for s in summaries)):
        color = f"C{i}"
        rows = sorted((s for s in summaries if s.config == config), key=lambda s: s.rate)
        rates = [s.rate for s in rows]
        p90 = [float(s.as_json()["ttft_p90_ms"]) for s in rows]  # type: ignore[arg-type]
        lo = [max(0.0, p - min(r.load.ttft(90) for r in s.runs)) for p, s in zip(p90, rows)]
        hi = [max(0.0, max(r.load.ttft(90) for r in s.runs) - p) for p, s in zip(p90, rows)]
        ax1.errorbar(rates, p90, yerr=[lo, hi], marker="o", capsize=3, color=color, label=config)
        ax2.plot(rates, [int(s.as_json()["prefill_tokens"]) for s in rows], marker="o", color=color, label=config)  # type: ignore[call-overload]
        if predicted:
            pred = [(r, predicted[(config, r)]) for r in rates if (config, r) in predicted]
            if pred:
                xs = [r for r, _ in pred]
                ax1.plot(
                    xs, [p["ttft_p90_ms"] for _, p in pred], ":", marker="x", color=color, label=f"{config}, what-if"
                )
                ax2.plot(xs, [p["prefill_tokens"] for _, p in pred], ":", marker="x", color=color)
    ax1.axhline(slo_ms, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_ms:g} ms")
    ax1.set_yscale("log")
    ax1.set_xlabel(rate_label)
    ax1.set_ylabel("TTFT p90 (ms)")
    ax1.set_title("TTFT p90 against load")
    ax1.legend(fontsize=8)
    ax2.set_xlabel(rate_label)
    ax2.set_ylabel("prompt tokens computed")
    ax2.set_title("prefill tokens computed")
    ax2.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def finite(v: float) -> float | None:
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None
