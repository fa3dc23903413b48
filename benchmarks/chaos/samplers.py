"""Background sampling of a running graph: every process's memory, the /dev/shm files the graph's
processes use, and the pool's counters, every `interval_s` seconds.

RSS is sampled per process (a graph process and everything below it, each labelled
``NAME/COMM[PID]``); a restarted process is a new series. The slope of a series is a least-squares
fit in MiB per minute. /dev/shm files are attributed to the graph when one of its processes maps
or holds them open at a sample, so a leftover of another program on the same machine is never
counted as ours (and a file ours created and removed between two samples never was a leftover).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from chaos import procs
from chaos.graph import GraphView

MIB_KIB = 1024.0
SHM_PREFIXES = ("maru-", "psm_", "vllm_dist_")
SHM_SCAN_S = 0.5
POOL_COUNTERS = ("hits", "misses", "stores", "evictions", "corrupt_reads", "quota_refusals")


@dataclasses.dataclass
class Series:
    name: str  # the graph process it belongs to
    pid: int
    comm: str = "?"  # the latest command name (vLLM's engine core renames itself once started)
    times: list[float] = dataclasses.field(default_factory=list)  # seconds since the sampler started
    rss_kib: list[int] = dataclasses.field(default_factory=list)
    anon_kib: list[int] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name}/{self.comm}[{self.pid}]"


def slope_mib_per_min(times: list[float], values_kib: list[int]) -> float | None:
    """Least-squares slope of `values_kib` over `times` (seconds), in MiB/min; None for < 3 points."""
    n = len(times)
    if n < 3 or times[-1] - times[0] <= 0:
        return None
    mean_t = sum(times) / n
    mean_v = sum(values_kib) / n
    var = sum((t - mean_t) ** 2 for t in times)
    cov = sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values_kib, strict=True))
    return (cov / var) * 60.0 / MIB_KIB


class Sampler:
    def __init__(self, view: GraphView, interval_s: float = 2.0) -> None:
        self.view, self.interval_s = view, interval_s
        self.series: dict[str, Series] = {}
        self.shm_seen: set[str] = set()
        self.pids_seen: set[int] = set()  # every process of the graph seen at any scan
        self.pool_timeline: list[dict[str, Any]] = []  # {"t", stats...} per answered sample
        self._incarnations: dict[str, dict[str, int]] = {}  # incarnation -> last counters
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.t0 = time.monotonic()

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._threads = [
            threading.Thread(
                target=self._every, args=(self.sample, self.interval_s), name="chaos-sampler", daemon=True
            ),
            threading.Thread(target=self._every, args=(self.scan_shm, SHM_SCAN_S), name="chaos-shm", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _every(self, what: Callable[[], None], interval_s: float) -> None:
        while not self._stop.is_set():
            what()
            self._stop.wait(interval_s)

    def _trees(self) -> list[tuple[str, int]]:
        """(graph process name, pid) of every process of the graph now."""
        family = procs.parents()
        out = []
        for name in self.view.names():
            pid = self.view.pid(name)
            if pid is not None:
                out += [(name, p) for p in procs.tree(pid, family)]
        return out

    def scan_shm(self) -> None:
        """Note the /dev/shm files the graph's processes map or hold open now (more often than the
        RSS samples: an engine that dies while it starts holds its segments only briefly)."""
        for _name, p in self._trees():
            found = procs.shm_mappings(p) | procs.shm_fds(p)
            with self._lock:
                self.shm_seen |= found
                self.pids_seen.add(p)

    def sample(self) -> None:
        now = time.monotonic() - self.t0
        for name, p in self._trees():
            use = procs.usage(p)
            if use is None:
                continue
            with self._lock:
                s = self.series.setdefault(f"{name}[{p}]", Series(name, p))
                s.comm = use.comm
                s.times.append(round(now, 2))
                s.rss_kib.append(use.rss_kib)
                s.anon_kib.append(use.anon_kib)
        self.scan_shm()
        stats = self.view.pool_stats(timeout=1.0)
        if stats:
            with self._lock:
                self.pool_timeline.append({"t": round(now, 2), **{k: stats.get(k) for k in _TIMELINE_KEYS}})
                self._incarnations[str(stats.get("incarnation"))] = {k: int(stats.get(k) or 0) for k in POOL_COUNTERS}

    # -- results ---------------------------------------------------------------------------------
    def pool_totals(self) -> dict[str, int]:
        """Counters summed over every pool incarnation seen (a restarted pool counts from 0)."""
        return {k: sum(c[k] for c in self._incarnations.values()) for k in POOL_COUNTERS} | {
            "incarnations": len(self._incarnations)
        }

    def rss_report(self, warmup_s: float = 30.0, min_span_s: float = 30.0) -> list[dict[str, Any]]:
        """Per process: first/last/peak RSS (MiB) and the RSS and anonymous-memory slopes (MiB/min)
        fitted after its first `warmup_s` (an engine grows while it starts and warms up), for
        series that still span `min_span_s` after that (slope None otherwise)."""
        rows = []
        for s in sorted(self.series.values(), key=lambda s: s.label):
            keep = [i for i, t in enumerate(s.times) if t - s.times[0] >= warmup_s]
            times = [s.times[i] for i in keep]
            fitted = bool(times) and times[-1] - times[0] >= min_span_s
            rows.append(
                {
                    "process": s.label,
                    "samples": len(s.times),
                    "span_s": round(s.times[-1] - s.times[0], 1),
                    "first_mib": round(s.rss_kib[0] / MIB_KIB, 1),
                    "last_mib": round(s.rss_kib[-1] / MIB_KIB, 1),
                    "peak_mib": round(max(s.rss_kib) / MIB_KIB, 1),
                    # started after the load did (a restart): its start-up may still be in the fit
                    "started_during_run": s.times[0] > 2 * self.interval_s,
                    "rss_slope_mib_min": _round(slope_mib_per_min(times, [s.rss_kib[i] for i in keep]))
                    if fitted
                    else None,
                    "anon_slope_mib_min": _round(slope_mib_per_min(times, [s.anon_kib[i] for i in keep]))
                    if fitted
                    else None,
                }
            )
        return rows

    def rss_series(self) -> dict[str, list[list[float]]]:
        """Every series as [seconds, RSS MiB] pairs (the JSON report's timeline)."""
        return {
            s.label: [[t, round(v / MIB_KIB, 1)] for t, v in zip(s.times, s.rss_kib, strict=True)]
            for s in self.series.values()
        }


_TIMELINE_KEYS = (
    "incarnation",
    *POOL_COUNTERS,
    "objects",
    "allocated_bytes",
    "pinned",
    "reserved",
    "sessions",
    "nats_connected",
)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def shm_listing() -> set[str]:
    """Every file in /dev/shm now."""
    try:
        return {p.name for p in procs.Path(procs.SHM).iterdir()}
    except OSError:
        return set()


def shm_left(before: set[str], seen: set[str]) -> tuple[list[str], list[str]]:
    """Files created since `before` that the graph's processes used and that are still there:
    (ours of the kinds a leak is - SHM_PREFIXES -, any other kind)."""
    left = (shm_listing() - before) & seen
    return sorted(f for f in left if f.startswith(SHM_PREFIXES)), sorted(
        f for f in left if not f.startswith(SHM_PREFIXES)
    )
