"""The two-level topology: D CXL domains of W/D workers, a pool per domain, one tier-2 below all.

Built on the pool model (`pool_model.PoolModel`): one Dynamo router over every worker; each
worker's host-tier credit is its own domain's pool (what its event relay announces); engines
load from their domain's pool at the pool link's speed. Configurations:

* `kv-domains`: per-domain pools alone (no reuse across domains);
* `kv-tier2`: the same pools, each written through to one cluster-wide tier-2 (Mooncake Store)
  when a prefill ends; an object becomes visible to the other domains `tier2_visible_ms` later
  (write-through plus the NATS announcement). A prompt's blocks beyond what the worker's device
  cache and its domain's pool hold are fetched from the tier-2 when it has them (a fixed
  `tier2_fetch_ms` - the scheduler's "ask again" and the fetch's round trips - plus their bytes
  at `tier2_gbps`) into the domain's pool, then loaded like a pool hit;
* `kv-tier2-spill`: the tier-2 receives blocks only when a domain pool evicts them (spill on
  eviction instead of write-through), to compare the two policies;
* `kv-tier2-both`: write-through, and a block a domain pool evicts goes to the tier-2 again
  (as most recently used) where the tier-2 no longer holds it;
* `kv-tier2-credit`: `kv-tier2`, and the router also credits the tier-2's blocks to every worker
  at `tier2_weight` (Dynamo's disk tier) beyond its device and pool overlaps.

`router_changes` counts, for the credit question, the routing decisions of a `kv-tier2` replay
whose set of cheapest workers would differ had the tier-2 been credited (a shadow router that
sees the same state; the replay itself routes without the credit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from maru_dynamo.components.whatif.pool_model import POOL_WORKER_ID, PoolModel, _BlockCache, _Index, _Request, _Worker
from maru_dynamo.components.whatif.spec import KV_POOL, ClusterSpec, RunResult
from maru_dynamo.components.whatif.timing import MockerTiming
from maru_dynamo.components.whatif.trace import TraceRequest
from maru_vllm.routing import DYNAMO_DISK_TIER_WEIGHT

KV_DOMAINS = "kv-domains"
KV_TIER2 = "kv-tier2"
KV_TIER2_SPILL = "kv-tier2-spill"
KV_TIER2_CREDIT = "kv-tier2-credit"
KV_TIER2_BOTH = "kv-tier2-both"
DOMAIN_CONFIGS = (KV_DOMAINS, KV_TIER2, KV_TIER2_SPILL, KV_TIER2_BOTH, KV_TIER2_CREDIT)
TIER2_WORKER_ID = POOL_WORKER_ID + 1


@dataclasses.dataclass(frozen=True)
class Tier2Spec:
    bytes: int = 10**12
    gbps: float = 12.5  # one fetch's share of a 100 Gb/s NIC
    fetch_ms: float = 2.0
    visible_ms: float = 500.0
    weight: float = DYNAMO_DISK_TIER_WEIGHT  # kv-tier2-credit's router weight


@dataclasses.dataclass(frozen=True)
class DomainsResult:
    run: RunResult
    tier2_hit_tokens: int  # prompt tokens fetched from the tier-2
    decisions: int
    router_changes: int  # decisions whose cheapest set a tier-2 credit would change


class DomainsModel(PoolModel):
    def __init__(
        self,
        spec: ClusterSpec,
        config: str,
        workers: int,
        domains: int,
        timing: MockerTiming,
        tier2: Tier2Spec,
        seed: int | None = None,
    ) -> None:
        if config not in DOMAIN_CONFIGS:
            raise ValueError(f"unknown config {config!r}: use {', '.join(DOMAIN_CONFIGS)}")
        if domains < 1 or workers % domains:
            raise ValueError(f"{workers} workers do not split into {domains} domains")
        super().__init__(spec, KV_POOL, workers, timing, seed)
        self.variant = config
        self.domains = domains
        self.per_domain = workers // domains
        self.pools = [_BlockCache(spec.pool_blocks) for _ in range(domains)]
        self.pool_indexes = [_Index() for _ in range(domains)]
        self.pool = None
        self.host_index = self.pool_indexes[0]  # marks that a host tier exists (weights apply)
        self.tier2_spec = tier2
        self.tier2: _BlockCache | None = None
        self.tier2_index: _Index | None = None
        if config != KV_DOMAINS:
            self.tier2 = _BlockCache(max(1, tier2.bytes // (spec.kv_bytes_per_token * spec.block_size)))
        if config in (KV_TIER2, KV_TIER2_CREDIT):  # the router's view of the tier-2 (credit question)
            self.tier2_index = _Index()
        self.visible_at: dict[int, float] = {}
        self.tier2_hit_tokens = 0
        self.decisions = 0
        self.router_changes = 0
        self._now = 0.0

    def domain_of(self, wk: _Worker | int) -> int:
        wid = wk if isinstance(wk, int) else wk.wid
        return wid // self.per_domain

    def result(self, requests: Sequence[TraceRequest]) -> DomainsResult:
        run = self.run(requests)
        return DomainsResult(run, self.tier2_hit_tokens, self.decisions, self.router_changes)

    # -- router ---------------------------------------------------------------------------------
    def _host_overlaps(self, rq: _Request) -> dict[int, int]:
        per_domain = [idx.overlaps(rq.local).get(POOL_WORKER_ID, 0) for idx in self.pool_indexes]
        return {w: per_domain[self.domain_of(w)] for w in range(self.n)}

    def _costs(
        self, rq: _Request, lower: dict[int, int] | None = None, lower_weight: float = 0.0
    ) -> tuple[list[float], list[int]]:
        if lower is not None or self.tier2_index is None:
            return super()._costs(rq, lower, lower_weight)
        t2 = self.tier2_index.overlaps(rq.local).get(TIER2_WORKER_ID, 0)
        everyone = dict.fromkeys(range(self.n), t2)
        plain = super()._costs(rq)
        credited = super()._costs(rq, everyone, self.tier2_spec.weight)
        self.decisions += 1
        if _cheapest(plain[0]) != _cheapest(credited[0]):
            self.router_changes += 1
        return credited if self.variant == KV_TIER2_CREDIT else plain

    def _on_arrive(self, now: float, rq: _Request) -> None:
        self._now = now
        super()._on_arrive(now, rq)

    # -- engine ---------------------------------------------------------------------------------
    def _tier(self, wk: _Worker) -> _BlockCache | None:
        return self.pools[self.domain_of(wk)]

    def _tier2_prefix(self, now: float, seq: list[int], start: int) -> int:
        """Where the run of visible tier-2 blocks that continues `seq` from block `start` ends (the
        pool's lookup counts the present prefix, then the hinted chunks right after it)."""
        n = start
        if self.tier2 is None:
            return n
        while n < len(seq) and seq[n] in self.tier2.pins and self.visible_at.get(seq[n], 0.0) <= now:
            n += 1
        return n

    def _tier_prefix(self, now: float, wk: _Worker, seq: list[int], dev_hit: int) -> int:
        return self._tier2_prefix(now, seq, super()._tier_prefix(now, wk, seq, dev_hit))

    def _load(self, now: float, wk: _Worker, rq: _Request, dev_hit: int, tier_hit: int) -> float:
        pool = self.pools[self.domain_of(wk)]
        local = max(dev_hit, min(tier_hit, pool.prefix_hit(rq.seq[:tier_hit])))
        ms = super()._load(now, wk, rq, dev_hit, local)
        if tier_hit > local:
            assert self.tier2 is not None
            self.tier2.touch(rq.seq[local:tier_hit])
            if local == dev_hit:
                self.loads_in_flight += 1  # one load in flight for the request, as the base counts
            fetched = (tier_hit - local) * self.spec.block_size
            self.tier2_hit_tokens += fetched
            t2 = self.tier2_spec
            ms += t2.fetch_ms + fetched * self.spec.kv_bytes_per_token / (t2.gbps * 1e9) * 1000.0
            # promoted into the domain's pool, then loaded from there (that load is in `ms` above
            # only for the pool's own part; the fetched part is charged at the tier's speed)
            self._insert(pool, self.pool_indexes[self.domain_of(wk)], rq, now, spill=False)
        return ms

    def _write_through(self, wk: _Worker, rq: _Request) -> None:
        d = self.domain_of(wk)
        spill = self.variant in (KV_TIER2_SPILL, KV_TIER2_BOTH)
        self._insert(self.pools[d], self.pool_indexes[d], rq, rq.first_token, spill=spill)
        if self.tier2 is not None and self.variant != KV_TIER2_SPILL:
            self._to_tier2(list(zip(rq.local, rq.seq)), rq.first_token)

    def _insert(self, tier: _BlockCache, index: _Index, rq: _Request, now: float, spill: bool) -> None:
        new = tier.insert_unpinned(rq.local, rq.seq)
        overflow = tier.used() - tier.capacity
        if overflow > 0:
            tier.touch(rq.seq)
            gone = tier.evict(overflow)
            index.removed(POOL_WORKER_ID, gone)
            if spill and self.tier2 is not None:
                self._to_tier2([(0, s) for s in gone], now)  # (no router view of a spilled tier)
        if new:
            first = rq.seq.index(new[0][1])
            chain = [(lh, s) for lh, s in zip(rq.local[first:], rq.seq[first:]) if s in tier.pins]
            index.stored(POOL_WORKER_ID, rq.seq[first - 1] if first else None, chain)

    def _to_tier2(self, blocks: list[tuple[int, int]], now: float) -> None:
        """Add `blocks` to the tier-2, visible `visible_ms` from `now`; with write-through they are
        a prompt's chain in order, and the router's view of the tier-2 gets them as a stored event."""
        assert self.tier2 is not None
        fresh = [i for i, (_, s) in enumerate(blocks) if s not in self.tier2.pins]
        self.tier2.touch([s for _, s in blocks])  # what was there already counts as just written
        for i in fresh:
            s = blocks[i][1]
            self.tier2.pins[s] = 0
            self.tier2.free[s] = None
            self.visible_at[s] = now + self.tier2_spec.visible_ms
        overflow = self.tier2.used() - self.tier2.capacity
        gone = self.tier2.evict(overflow) if overflow > 0 else []
        for s in gone:
            self.visible_at.pop(s, None)
        if self.tier2_index is None:
            return
        self.tier2_index.removed(TIER2_WORKER_ID, gone)
        if fresh:
            first = fresh[0]
            chain = [b for b in blocks[first:] if b[1] in self.tier2.pins]
            self.tier2_index.stored(TIER2_WORKER_ID, blocks[first - 1][1] if first else None, chain)


def _cheapest(costs: list[float]) -> frozenset[int]:
    best = min(costs)
    return frozenset(i for i, c in enumerate(costs) if c == best)


def replay_domains(
    requests: Sequence[TraceRequest],
    spec: ClusterSpec,
    config: str,
    workers: int,
    domains: int,
    timing: MockerTiming,
    tier2: Tier2Spec,
    seed: int | None = None,
) -> DomainsResult:
    return DomainsModel(spec, config, workers, domains, timing, tier2, seed).result(requests)


def domain_table(
    requests: Sequence[TraceRequest],
    spec: ClusterSpec,
    timing: MockerTiming,
    workers: Sequence[int],
    domains: Sequence[int],
    configs: Sequence[str],
    tier2: Tier2Spec,
    progress: bool = True,
) -> list[dict[str, object]]:
    """One row per (workers, domains, config) with W divisible by D: prefill tokens, TTFT p50/p90."""
    import sys
    import time

    rows: list[dict[str, object]] = []
    for w in workers:
        for d in domains:
            if w % d or d > w:
                continue
            for config in configs:
                t0 = time.monotonic()
                r = replay_domains(requests, spec, config, w, d, timing, tier2, seed=0)
                row = {
                    "workers": w,
                    "domains": d,
                    "config": config,
                    "prefill_tokens": r.run.prefill_tokens,
                    "input_tokens": r.run.input_tokens,
                    "ttft_p50_ms": r.run.ttft_p50_ms,
                    "ttft_p90_ms": r.run.ttft_p90_ms,
                    "tier2_hit_tokens": r.tier2_hit_tokens,
                    "router_decisions": r.decisions,
                    "router_changes": r.router_changes,
                }
                rows.append(row)
                if progress:
                    print(
                        f"[whatif] {w} workers in {d} domains {config}: prefill {r.run.prefill_tokens:,}, "
                        f"TTFT p90 {r.run.ttft_p90_ms:.0f} ms ({time.monotonic() - t0:.0f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
    return rows


def format_domain_table(rows: list[dict[str, object]]) -> str:
    lines = [
        f"{'workers':>7} {'domains':>7} {'config':<16} {'prefill/input':>13} {'TTFT p50':>9} {'TTFT p90':>9}"
        f" {'tier-2 tokens':>13} {'credit changes':>14}"
    ]
    for r in rows:
        changes = f"{r['router_changes']}/{r['router_decisions']}" if r["router_decisions"] else "-"
        lines.append(
            f"{r['workers']:>7} {r['domains']:>7} {r['config']:<16}"
            f" {int(r['prefill_tokens']) / max(1, int(r['input_tokens'])):>13.3f}"  # type: ignore[call-overload]
            f" {float(r['ttft_p50_ms']):>7.0f}ms {float(r['ttft_p90_ms']):>7.0f}ms"  # type: ignore[arg-type]
            f" {int(r['tier2_hit_tokens']):>13,} {changes:>14}"  # type: ignore[call-overload]
        )
    return "\n".join(lines)
