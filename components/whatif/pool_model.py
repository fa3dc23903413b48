"""Replay a trace on a cluster whose workers share one KV pool, built on Dynamo's own parts.

Why this exists: Dynamo 1.6.1's offline replay models the shared tier (``native_host_offload``
``scope: "cluster_shared"``) but aborts on the Mooncake traces once GPUs evict (see
`maru_dynamo.components.whatif`). This model replays the same requests with:

* **Dynamo's router index**: ``dynamo._core.RadixTree`` (the Rust radix tree the KV router and the
  offline replay use), fed with stored/removed KV events: one tree for the workers' device
  blocks, one for the host tier (kv-host: one host tier per worker; kv-pool: the pool's blocks,
  matched once and credited to every worker, as the Maru event relay announces them);
* **Dynamo's router cost** (``DefaultWorkerScorer`` in ``lib/kv-router/src/scheduling/selector/
  default.rs``): ``logit = prefill_load_scale * max(0, prefill_blocks - overlap_credit) +
  decode_blocks`` with ``overlap_credit = device_overlap + host_weight * host_overlap_beyond_device``,
  ``prefill_blocks`` = the worker's in-flight prefill tokens plus this prompt, over the block size,
  ``decode_blocks`` = its in-flight requests' blocks plus this prompt's; lowest logit wins, ties at
  random (``router_temperature`` 0, Dynamo's defaults);
* **the mocker's timing**, measured from Dynamo's replay (`timing.mocker_timing`).

Each worker's engine steps as vLLM's scheduler packs them: the admitted prompts' next chunks,
then waiting requests in order of arrival, up to ``step_tokens`` prompt tokens a step (vLLM's
``max_num_batched_tokens``); a step with prefill work takes the prefill time of its tokens (the
mocker's, or a measured engine's) plus, while requests decode, a decode step's time (vLLM's
mixed batch); between such steps running requests decode one token per step, a step taking the
decode-only time for the batch's KV tokens; engine cache: vLLM-style prefix cache of ``gpu_blocks`` blocks,
free blocks evicted least recently used (a request's tail first), hits capped at the prompt's
last full block before its last token; the pool and host tiers are written through when a
prefill ends (every full prompt block; vLLM's offloading connectors and Maru store on prefill) and
evict least recently used; loading a hit costs its bytes over the link's GB/s, shared evenly with
the other loads in flight when their sum would exceed the aggregate GB/s.

Size: the simulated engines, their step loop and the pool they share are one event-driven
model whose callbacks call into each other every step.
"""

from __future__ import annotations

import heapq
import json
import random
from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Any

from maru_dynamo.components.whatif.spec import KV_HOST, KV_POOL, ROUND_ROBIN, ClusterSpec, RunResult
from maru_dynamo.components.whatif.timing import MockerTiming
from maru_dynamo.components.whatif.trace import TraceRequest

POOL_WORKER_ID = 1 << 30  # the pool's own id in the host-tier tree
_MASK = (1 << 63) - 1


def block_hashes(req: TraceRequest, spec: ClusterSpec) -> tuple[list[int], list[int]]:
    """(local hashes, sequence hashes) of the prompt's full engine blocks.

    Each trace block of ``trace_block_size`` tokens is ``trace_block_size / block_size`` engine
    blocks; a local hash names a block's content (trace id, position inside it), a sequence hash
    the whole prefix up to it (what KV events carry as ``block_hash``).
    """
    per = spec.trace_block_size // spec.block_size
    full = req.input_length // spec.block_size
    local: list[int] = []
    seq: list[int] = []
    prev = 0
    for k in range(full):
        lh = hash((req.hash_ids[k // per], k % per)) & _MASK
        prev = hash((prev, lh)) & _MASK
        local.append(lh)
        seq.append(prev)
    return local, seq


class _Index:
    """A Dynamo RadixTree fed with KV events as a worker (or the pool) would publish them."""

    def __init__(self) -> None:
        from maru_dynamo.components.whatif.dynamo_backend import quiet_dynamo_logs

        quiet_dynamo_logs()
        from dynamo._core import RadixTree

        self.tree = RadixTree()
        self._event_id = 0
        self.skipped = 0  # events the tree refused (should stay 0: the model's events are consistent)
        self.removed_blocks = 0

    def _apply(self, worker: int, data: dict) -> None:
        self._event_id += 1
        try:
            self.tree.apply_event(worker, json.dumps({"event_id": self._event_id, "data": data, "dp_rank": 0}).encode())
        except (ValueError, RuntimeError):
            # What Dynamo's live indexer does with an event it cannot apply: skip it, count it.
            self.skipped += 1

    def stored(self, worker: int, parent: int | None, blocks: list[tuple[int, int]]) -> None:
        if blocks:
            self._apply(
                worker,
                {
                    "stored": {
                        "parent_hash": parent,
                        "blocks": [{"block_hash": s, "tokens_hash": lh} for lh, s in blocks],
                    }
                },
            )

    def removed(self, worker: int, seq_hashes: list[int]) -> None:
        if seq_hashes:
            self.removed_blocks += len(seq_hashes)
            self._apply(worker, {"removed": {"block_hashes": seq_hashes}})

    def overlaps(self, local: list[int]) -> dict[int, int]:
        # Dynamo's stub says the keys are worker ids; they are (worker_id, dp_rank) pairs.
        scores: dict[Any, int] = self.tree.find_matches(local).scores
        return {w: n for (w, _dp), n in scores.items()}


def _leading_in(seq: list[int], held: Container[int]) -> int:
    """How many blocks of `seq`, from the first on, `held` has."""
    n = 0
    for s in seq:
        if s not in held:
            break
        n += 1
    return n


class _BlockCache:
    """Prefix cache of one tier: block -> pin count; unpinned blocks evicted least recently used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pins: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict()  # unpinned, oldest first

    def prefix_hit(self, seq: list[int]) -> int:
        return _leading_in(seq, self.pins)

    def evictable(self) -> int:
        return len(self.free)

    def used(self) -> int:
        return len(self.pins)

    def touch(self, seq: list[int]) -> None:
        """Mark a prefix used now; its head becomes the most recent (a child never outlives its parent)."""
        for s in reversed(seq):
            if s in self.free:
                self.free.move_to_end(s)

    def evict(self, count: int) -> list[int]:
        out = []
        while count > 0 and self.free:
            s, _ = self.free.popitem(last=False)
            del self.pins[s]
            out.append(s)
            count -= 1
        return out

    def pin(self, seq: list[int]) -> None:
        for s in seq:
            n = self.pins.get(s, 0)
            if n == 0:
                self.free.pop(s, None)
            self.pins[s] = n + 1

    def unpin(self, seq: list[int]) -> None:
        for s in reversed(seq):  # freed tail first, as vLLM does: the tail is evicted before the head
            n = self.pins[s] - 1
            self.pins[s] = n
            if n == 0:
                self.free[s] = None

    def insert_unpinned(self, local: list[int], seq: list[int]) -> list[tuple[int, int]]:
        """Write-through tier: add missing blocks as most recent; returns the new (local, seq) pairs."""
        new = []
        for lh, s in reversed(list(zip(local, seq))):
            if s in self.pins:
                if self.pins[s] == 0:
                    self.free.move_to_end(s)
                continue
            self.pins[s] = 0
            self.free[s] = None
            new.append((lh, s))
        new.reverse()
        return new


class _Request:
    __slots__ = (
        "idx",
        "req",
        "local",
        "seq",
        "arrival",
        "worker",
        "routed_prefill_tokens",
        "blocks_needed",
        "pinned",
        "first_token",
        "remaining",
        "dev_hit",
        "load_ms",
        "reserved",
    )

    def __init__(self, idx: int, req: TraceRequest, local: list[int], seq: list[int], arrival: float) -> None:
        self.idx = idx
        self.req = req
        self.local = local
        self.seq = seq
        self.arrival = arrival
        self.worker = -1
        self.routed_prefill_tokens = 0
        self.blocks_needed = 0
        self.pinned: list[int] = []
        self.first_token = 0.0
        self.remaining = 0  # prompt tokens still to compute once admitted
        self.dev_hit = 0  # prompt blocks found in the worker's prefix cache at admission
        self.load_ms = 0.0  # loading its tier hit, in the step that admitted it
        self.reserved = 0  # prompt blocks it will add to the prefix cache, reserved while it prefills


class _Worker:
    def __init__(self, wid: int, spec: ClusterSpec, host_blocks: int) -> None:
        self.wid = wid
        self.gpu = _BlockCache(spec.gpu_blocks)
        self.host = _BlockCache(host_blocks) if host_blocks else None
        self.private_blocks = 0  # blocks of running requests that are not shared prefix blocks
        self.queue: list[_Request] = []  # waiting to be admitted
        self.prefilling: list[_Request] = []  # admitted, prompt chunks left to compute
        self.reserved_blocks = 0  # prompt blocks of prefilling requests, not yet in the prefix cache
        self.busy = False  # an engine step with prefill work runs
        self.active_prefill_tokens = 0
        # Decode as the mocker steps it: every running request advances one token per engine step;
        # a step decodes only (its time grows with the batch's KV tokens) or also runs a prefill
        # chunk (then it takes the chunk's time). decode_v counts the steps taken (a virtual clock).
        self.decode_v = 0.0
        self.decode_at = 0.0  # when decode_v was brought up to date
        self.decode_rate = 0.0  # steps per ms now
        self.prefill_rate: float | None = None  # steps per ms while a prefill runs
        self.decode_due: list[tuple[float, int, _Request]] = []  # (decode_v at which it ends, tie, request)
        self.context_tokens = 0  # KV tokens of the requests decoding
        self.version = 0  # invalidates a scheduled decode_due event when the rate changes
        self.active: dict[int, int] = {}  # prompt blocks of requests in flight -> how many share each

    def potential_blocks(self, seq: list[int]) -> int:
        """In-flight unique blocks if a request with prompt blocks `seq` joins (shared prefixes once)."""
        return len(self.active) + len(seq) - _leading_in(seq, self.active)

    def add_active(self, seq: list[int]) -> None:
        for s in seq:
            self.active[s] = self.active.get(s, 0) + 1

    def remove_active(self, seq: list[int]) -> None:
        for s in seq:
            n = self.active[s] - 1
            if n:
                self.active[s] = n
            else:
                del self.active[s]


class PoolModel:
    """One replay of one configuration (see the module docstring for what is modelled)."""

    def __init__(
        self, spec: ClusterSpec, config: str, workers: int, timing: MockerTiming, seed: int | None = None
    ) -> None:
        self.spec = spec
        self.config = config
        self.n = workers
        self.timing = timing
        self.rng = random.Random(seed)
        host_blocks = spec.host_blocks_per_worker(workers) if config == KV_HOST else 0
        self.workers = [_Worker(w, spec, host_blocks) for w in range(workers)]
        self.pool = _BlockCache(spec.pool_blocks) if config == KV_POOL else None
        self.device_index = _Index()
        self.host_index = _Index() if config in (KV_HOST, KV_POOL) else None
        self.events: list[tuple[float, int, str, object]] = []
        self._seq = 0
        self._rr = 0
        self.loads_in_flight = 0
        self.prefill_tokens = 0
        self.served_input_tokens = 0  # of the requests that fit a worker (the others are dropped, as in Dynamo)
        self.served_output_tokens = 0
        self.ttfts: list[float] = []
        self.end_time = 0.0

    # -- event queue --------------------------------------------------------------------------
    def _at(self, t: float, kind: str, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload))

    def run(self, requests: Sequence[TraceRequest]) -> RunResult:
        t0 = requests[0].timestamp_ms
        for i, r in enumerate(requests):
            local, seq = block_hashes(r, self.spec)
            self._at((r.timestamp_ms - t0) / self.spec.arrival_speedup, "arrive", _Request(i, r, local, seq, 0.0))
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            getattr(self, "_on_" + kind)(now, payload)
        self.ttfts.sort()
        duration_s = max(self.end_time, 1e-9) / 1000.0
        return RunResult(
            ttft_p50_ms=_percentile(self.ttfts, 50),
            ttft_p90_ms=_percentile(self.ttfts, 90),
            prefill_tokens=self.prefill_tokens,
            input_tokens=self.served_input_tokens,
            output_tokens_per_s=self.served_output_tokens / duration_s,
        )

    # -- router -------------------------------------------------------------------------------
    def _route(self, rq: _Request) -> int:
        if self.config == ROUND_ROBIN:
            w = self._rr % self.n
            self._rr += 1
            rq.routed_prefill_tokens = rq.req.input_length
            return w
        costs, devs = self._costs(rq)
        best_cost = min(costs)
        best = [w for w, c in enumerate(costs) if c == best_cost]
        i = best[0] if len(best) == 1 else best[self.rng.randrange(len(best))]
        rq.routed_prefill_tokens = max(0, rq.req.input_length - devs[i] * self.spec.block_size)
        return i

    def _host_overlaps(self, rq: _Request) -> dict[int, int]:
        """Per worker, the leading prompt blocks the router credits at the host tier."""
        if self.host_index is None:
            return {}
        host = self.host_index.overlaps(rq.local)
        if self.config == KV_POOL:
            return dict.fromkeys(range(self.n), host.get(POOL_WORKER_ID, 0))
        return host

    def _costs(
        self, rq: _Request, lower: dict[int, int] | None = None, lower_weight: float = 0.0
    ) -> tuple[list[float], list[int]]:
        """Dynamo's cost of sending `rq` to each worker, and each worker's device overlap; `lower`
        (per worker, leading blocks a lower tier holds) is credited at `lower_weight` beyond the
        device and host overlaps."""
        bs = self.spec.block_size
        isl = rq.req.input_length
        device = self.device_index.overlaps(rq.local)
        host = self._host_overlaps(rq)
        weight = self.spec.host_weight if self.host_index is not None else 0.0
        costs: list[float] = []
        devs: list[int] = []
        for wk in self.workers:
            dev = device.get(wk.wid, 0)
            got = host.get(wk.wid, 0)
            credit = dev + weight * max(0, got - dev)
            if lower:
                credit += lower_weight * max(0, lower.get(wk.wid, 0) - max(dev, got))
            prefill_blocks = (wk.active_prefill_tokens + isl) / bs
            costs.append(max(0.0, prefill_blocks - credit) + wk.potential_blocks(rq.seq))
            devs.append(dev)
        return costs, devs

    def _on_arrive(self, now: float, rq: _Request) -> None:
        if -(-(rq.req.input_length + 1) // self.spec.block_size) > self.spec.gpu_blocks:
            return  # never fits one worker's KV cache: Dynamo's mocker never completes it either
        self.served_input_tokens += rq.req.input_length
        self.served_output_tokens += rq.req.output_length
        rq.arrival = now
        w = self._route(rq)
        rq.worker = w
        wk = self.workers[w]
        wk.active_prefill_tokens += rq.routed_prefill_tokens
        wk.add_active(rq.seq)
        wk.queue.append(rq)
        self._try_start(now, wk)

    # -- engine -------------------------------------------------------------------------------
    def _admit(self, now: float, wk: _Worker, rq: _Request) -> bool:
        """Admit `rq` to prefill if its blocks fit (evicting free blocks as vLLM does): its hits
        pinned, its tier hit loaded in the step it joins, its new blocks reserved. False: it waits."""
        bs = self.spec.block_size
        isl = rq.req.input_length
        max_hit = (isl - 1) // bs  # the last token is always computed
        seq = rq.seq[:max_hit]
        dev_hit = wk.gpu.prefix_hit(seq)
        tier_hit = self._tier_prefix(now, wk, seq, dev_hit)
        # vLLM allocates a prompt's blocks on admission and decode blocks as tokens come; the
        # model reserves the prompt plus half the output up front (the average a decode holds).
        total_blocks = -(-(isl + rq.req.output_length // 2) // bs)
        new_shared = len(rq.seq) - dev_hit  # prompt blocks this request adds to the prefix cache
        private = max(0, total_blocks - len(rq.seq))
        need = new_shared + private
        free_now = wk.gpu.capacity - wk.gpu.used() - wk.private_blocks - wk.reserved_blocks
        if need > free_now:
            short = need - free_now
            hits_free = sum(1 for s in rq.seq[:dev_hit] if s in wk.gpu.free)
            if wk.gpu.evictable() - hits_free < short and (wk.decode_due or wk.prefilling):
                return False  # wait for running requests to free blocks
            wk.gpu.pin(rq.seq[:dev_hit])  # hits are in use from now on, not evictable
            self.device_index.removed(wk.wid, wk.gpu.evict(short))
        else:
            wk.gpu.pin(rq.seq[:dev_hit])
        wk.gpu.touch(rq.seq[:dev_hit])
        computed = isl - tier_hit * bs
        rq.load_ms = self._load(now, wk, rq, dev_hit, tier_hit)
        self.prefill_tokens += computed
        rq.remaining = computed
        rq.dev_hit = dev_hit
        rq.pinned = rq.seq[:dev_hit]
        rq.blocks_needed = private
        rq.reserved = new_shared
        wk.private_blocks += private
        wk.reserved_blocks += new_shared
        return True

    def _try_start(self, now: float, wk: _Worker) -> None:
        """Start the worker's next engine step if it has prefill work, as vLLM's scheduler packs
        one: the admitted prompts' next chunks first, then waiting requests in order of arrival,
        while the step has prompt tokens left (`step_tokens`) and their blocks fit. The step takes
        the prefill time of its tokens, the loads of the requests it admitted, and - when requests
        are decoding - a decode step's time (vLLM's mixed batch)."""
        if wk.busy:
            return
        budget = self.spec.step_tokens
        chunks: list[tuple[_Request, int]] = []
        for rq in wk.prefilling:
            if budget <= 0:
                break
            take = min(rq.remaining, budget)
            chunks.append((rq, take))
            budget -= take
        load_ms = 0.0
        while budget > 0 and wk.queue and self._admit(now, wk, wk.queue[0]):
            rq = wk.queue.pop(0)
            wk.prefilling.append(rq)
            load_ms += rq.load_ms
            take = min(rq.remaining, budget)
            chunks.append((rq, take))
            budget -= take
        if not chunks:
            return
        tokens = sum(take for _, take in chunks)
        mixed_ms = self.timing.itl_ms(wk.context_tokens) if wk.decode_due else 0.0
        duration = load_ms + self.timing.prefill_ms(tokens) + mixed_ms
        self._advance(now, wk)
        wk.busy = True
        wk.prefill_rate = 1.0 / duration if duration > 0 else None
        self._reschedule(now, wk)
        self._at(now + duration, "stepped", (wk, chunks))

    def _on_stepped(self, now: float, payload: tuple[_Worker, list[tuple[_Request, int]]]) -> None:
        wk, chunks = payload
        self._advance(now, wk)
        wk.busy = False
        wk.prefill_rate = None
        for rq, take in chunks:
            rq.remaining -= take
            if rq.remaining <= 0:
                wk.prefilling.remove(rq)
                self._prefilled(now, wk, rq)
        self._try_start(now, wk)
        self._reschedule(now, wk)

    def _tier(self, wk: _Worker) -> _BlockCache | None:
        """The tier below `wk`'s device cache (its host tier, or the pool), if any."""
        return wk.host if self.config == KV_HOST else self.pool

    def _tier_prefix(self, now: float, wk: _Worker, seq: list[int], dev_hit: int) -> int:
        """How many leading blocks of `seq` the device cache and the tiers below it supply."""
        tier = self._tier(wk)
        return dev_hit if tier is None else max(dev_hit, tier.prefix_hit(seq))

    def _load(self, now: float, wk: _Worker, rq: _Request, dev_hit: int, tier_hit: int) -> float:
        """Milliseconds to load blocks `dev_hit:tier_hit` of `rq` from the tier (which counts as use)."""
        tier = self._tier(wk)
        if tier is None or tier_hit <= dev_hit:
            return 0.0
        tier.touch(rq.seq[dev_hit:tier_hit])
        self.loads_in_flight += 1
        gbps = self.spec.pool_gbps
        if self.config == KV_POOL:
            gbps = min(gbps, self.spec.pool_aggregate_gbps / self.loads_in_flight)
        return (tier_hit - dev_hit) * self.spec.block_size * self.spec.kv_bytes_per_token / (gbps * 1e9) * 1000.0

    # -- decode clock -------------------------------------------------------------------------
    def _advance(self, now: float, wk: _Worker) -> None:
        wk.decode_v += (now - wk.decode_at) * wk.decode_rate
        wk.decode_at = now

    def _reschedule(self, now: float, wk: _Worker) -> None:
        if wk.prefill_rate is not None:
            rate = wk.prefill_rate
        elif wk.decode_due:
            rate = 1.0 / self.timing.itl_ms(wk.context_tokens)
        else:
            rate = 0.0
        wk.decode_rate = rate
        wk.version += 1
        if wk.decode_due and rate > 0:
            self._at(now + max(0.0, wk.decode_due[0][0] - wk.decode_v) / rate, "decode_due", (wk, wk.version))

    def _on_decode_due(self, now: float, payload: tuple[_Worker, int]) -> None:
        wk, version = payload
        if version != wk.version:
            return  # the rate changed since this was scheduled
        self._advance(now, wk)
        while wk.decode_due and wk.decode_due[0][0] <= wk.decode_v + 1e-6:
            _, _, rq = heapq.heappop(wk.decode_due)
            self._finish(now, wk, rq)
        self._try_start(now, wk)
        self._reschedule(now, wk)

    def _prefilled(self, now: float, wk: _Worker, rq: _Request) -> None:
        """`rq`'s last prompt chunk ran: its first token, its blocks in the prefix cache, its decode."""
        dev_hit = rq.dev_hit
        if rq.load_ms:
            self.loads_in_flight -= 1
        wk.reserved_blocks -= rq.reserved
        rq.first_token = now
        self.ttfts.append(now - rq.arrival)
        # The prompt's blocks are now in the device prefix cache (computed or loaded): stored events.
        new = list(zip(rq.local[dev_hit:], rq.seq[dev_hit:]))
        wk.gpu.pin(rq.seq[dev_hit:])
        rq.pinned = list(rq.seq)
        parent = rq.seq[dev_hit - 1] if dev_hit else None
        self.device_index.stored(wk.wid, parent, new)
        wk.active_prefill_tokens -= rq.routed_prefill_tokens
        self._write_through(wk, rq)
        heapq.heappush(wk.decode_due, (wk.decode_v + rq.req.output_length - 1, rq.idx, rq))
        wk.context_tokens += rq.req.input_length + rq.req.output_length // 2  # its KV, on average over its decode

    def _write_through(self, wk: _Worker, rq: _Request) -> None:
        if self.config == KV_POOL:
            tier, owner = self.pool, POOL_WORKER_ID
        elif self.config == KV_HOST:
            tier, owner = wk.host, wk.wid
        else:
            return
        assert tier is not None and self.host_index is not None
        new = tier.insert_unpinned(rq.local, rq.seq)
        overflow = tier.used() - tier.capacity
        if overflow > 0:
            # Protect this request's own blocks from its own eviction where possible.
            tier.touch(rq.seq)
            self.host_index.removed(owner, tier.evict(overflow))
        if new:
            # A stored event chains on its parent; store from the first new block onward.
            first = rq.seq.index(new[0][1])
            chain = [(lh, s) for lh, s in zip(rq.local[first:], rq.seq[first:]) if s in tier.pins]
            self.host_index.stored(owner, rq.seq[first - 1] if first else None, chain)

    def _finish(self, now: float, wk: _Worker, rq: _Request) -> None:
        wk.context_tokens -= rq.req.input_length + rq.req.output_length // 2
        wk.gpu.unpin(rq.pinned)
        wk.private_blocks -= rq.blocks_needed
        wk.remove_active(rq.seq)
        self.end_time = max(self.end_time, now)


def _percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return 0.0
    k = (len(sorted_values) - 1) * pct / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def replay(
    requests: Sequence[TraceRequest],
    spec: ClusterSpec,
    config: str,
    workers: int,
    timing: MockerTiming,
    seed: int | None = None,
) -> RunResult:
    return PoolModel(spec, config, workers, timing, seed).run(requests)
