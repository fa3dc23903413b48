"""A periodic INFO line in the engine log: what one side of the connector did lately.

Each connector side (scheduler, worker) in an engine process logs, every
`maru_log_stats_interval_s` seconds, one line about the interval that just ended:

  scheduler:  requests looked up in the pool, hits (and the tokens the pool supplied), misses
  worker:     chunks and tokens loaded and stored, bytes, failures, stores skipped
  both:       the pool link's state (up, down, went down, came back) and failed pool operations

plus running totals since start. An interval with no activity and no pool state change logs
nothing, so an idle engine's log stays quiet; the remainder is logged when the connector shuts
down. The counters are fed from hooks vLLM already calls (`update_state_after_alloc`,
`get_kv_connector_stats`) and cost one locked addition each; the line is written by a daemon
thread, never on the engine's step.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from vllm.logger import init_logger

from maru_vllm.connector.stats import TransferCounters

logger = init_logger(__name__)

MIB = 1024 * 1024


def _count(n: int, one: str, many: str | None = None) -> str:
    """`1 request`, `2 requests`: a count with its noun in the right number."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


class PoolLinkState(Protocol):
    """What the summary reads of a pool link (`PoolAccess`)."""

    @property
    def available(self) -> bool: ...

    failures: int


@dataclasses.dataclass
class LookupCounters:
    requests: int = 0
    hits: int = 0
    hit_tokens: int = 0

    def add(self, other: LookupCounters) -> None:
        self.requests += other.requests
        self.hits += other.hits
        self.hit_tokens += other.hit_tokens


class ConnectorLogSummary:
    """Collects one connector side's counters and logs them once per interval while active.

    `who` names the side in the line ("scheduler", "worker"); `pools` are the side's pool links.
    `interval_s` <= 0 disables the line (counters are still accepted, and dropped).
    """

    def __init__(self, who: str, interval_s: float, block_size: int, pools: Sequence[PoolLinkState]) -> None:
        self.who = who
        self.interval_s = interval_s
        self.block_size = block_size
        self.pools = list(pools)
        self._lock = threading.Lock()
        self._lookups = LookupCounters()
        self._transfers = TransferCounters()
        self._total_lookups = LookupCounters()
        self._total_transfers = TransferCounters()
        self._pool_up = [p.available for p in self.pools]
        self._pool_failures = [p.failures for p in self.pools]
        self._window_start = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    # -- feeding (engine threads) ----------------------------------------------------------------
    def record_lookup(self, pool_tokens: int) -> None:
        """The scheduler placed a request: the pool supplies `pool_tokens` of it (0: a miss)."""
        if not self.enabled:
            return
        with self._lock:
            self._lookups.requests += 1
            if pool_tokens > 0:
                self._lookups.hits += 1
                self._lookups.hit_tokens += pool_tokens

    def record_transfers(self, counters: TransferCounters) -> None:
        """The worker's counters of one step (what `get_kv_connector_stats` hands to vLLM)."""
        if not self.enabled:
            return
        with self._lock:
            self._transfers.add(counters)

    # -- the line --------------------------------------------------------------------------------
    def take_line(self) -> str | None:
        """The summary of the interval since the last call, or None when nothing happened."""
        with self._lock:
            lookups, self._lookups = self._lookups, LookupCounters()
            transfers, self._transfers = self._transfers, TransferCounters()
            self._total_lookups.add(lookups)
            self._total_transfers.add(transfers)
            total_lookups = dataclasses.replace(self._total_lookups)
            total_transfers = dataclasses.replace(self._total_transfers)
            now = time.monotonic()
            window_s, self._window_start = now - self._window_start, now
        pool_part, pool_changed = self._pool_state()
        if lookups.requests == 0 and transfers.is_empty() and not pool_changed:
            return None
        parts = []
        if lookups.requests:
            misses = lookups.requests - lookups.hits
            parts.append(
                f"{_count(lookups.requests, 'request')} looked up: {_count(lookups.hits, 'hit')} "
                f"({lookups.hit_tokens} tokens from the pool), {_count(misses, 'miss', 'misses')}"
            )
        if not transfers.is_empty():
            parts.append(self._transfer_part(transfers))
        parts.append(pool_part)
        totals = []
        if total_lookups.requests:
            totals.append(f"{total_lookups.hits}/{total_lookups.requests} hits, {total_lookups.hit_tokens} tokens")
        if not total_transfers.is_empty():
            totals.append(
                f"{total_transfers.blocks_loaded * self.block_size} tokens loaded, "
                f"{total_transfers.chunks_stored} chunks stored"
            )
        line = f"MaruKVConnector ({self.who}) last {window_s:.1f} s: " + "; ".join(parts)
        return line + (f" [since start: {', '.join(totals)}]" if totals else "")

    def _transfer_part(self, t: TransferCounters) -> str:
        loaded = (
            f"loaded {t.chunks_loaded} chunks ({t.blocks_loaded * self.block_size} tokens, "
            f"{t.bytes_loaded / MIB:.1f} MiB, {t.load_failures} failed)"
        )
        stored = (
            f"stored {t.chunks_stored} chunks ({t.bytes_stored / MIB:.1f} MiB, "
            f"{t.store_failures} failed, {t.stores_skipped} skipped)"
        )
        return f"{loaded}, {stored}"

    def _pool_state(self) -> tuple[str, bool]:
        """("pool up" / "pool down" / "pool went down" / "pool came back" [+ failures], changed)."""
        up_now = [p.available for p in self.pools]
        failures_now = [p.failures for p in self.pools]
        failed = sum(now - before for now, before in zip(failures_now, self._pool_failures, strict=True))
        was_up = all(self._pool_up)
        is_up = all(up_now)
        self._pool_up, self._pool_failures = up_now, failures_now
        if is_up == was_up:
            state = "pool up" if is_up else "pool down"
        else:
            state = "pool came back" if is_up else "pool went down"
        if failed:
            state += f" ({failed} failed pool operations)"
        return state, is_up != was_up or failed > 0

    # -- the thread ------------------------------------------------------------------------------
    def start(self) -> None:
        """Log the line every interval from a daemon thread (nothing when disabled)."""
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"maru-log-summary-{self.who}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._emit()

    def _emit(self) -> None:
        line = self.take_line()
        if line is not None:
            logger.info("%s", line)

    def stop(self) -> None:
        """Stop the thread and log what the last interval left (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._thread = None
        self._emit()
