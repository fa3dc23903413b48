"""The second tier under a pool: write-through to a cluster-wide store, fetches into the region.

A pool service with a tier (`pool serve --mooncake-master ...`) runs one `Tier2` on its event
loop. It never slows the pool's clients: every call to the store runs on the tier's own threads
under a deadline, and the service's ops only queue work for it.

* **Write-through.** Every object a client commits is queued (at most `queue_max`; past that, or
  while the tier is down, it is skipped and counted) and put in the store by one writer, within
  a bandwidth budget (`put_budget`, bytes per second), under the same key and with the same
  payload checksum (`tier2.codec`); objects another pool already put are not put again. After a
  put the pool announces the key to the other pools (`tier2.announce`), so another domain can
  hit a hot prefix about a second after it was computed. There is no spill on eviction: every
  object already went through on commit (docs/pool.md says why, with the measurement).
* **Hints.** Keys in the tier that this pool does not hold are marked in the region's presence
  table (`presence.LOWER_TIER`), so a scheduler lookup that misses the pool sees, without asking
  anyone, that the tier could supply the next chunks.
* **Fetches.** A client that sees such hints sends `promote` (without waiting). The tier reserves
  space in the pool, reads the object from the store on a fetch thread, verifies it (header
  digest, namespace and key, payload checksum), copies it into the region and commits it as an
  ordinary pool object, which it then keeps pinned for `hold_s` so the load that asked for it
  finds it. A missing, corrupt or late object (`fetch_deadline_s`) is aborted and its hint
  withdrawn: the scheduler's next look finds no hint and computes those tokens.
* **Failures.** Any store call that fails or misses its deadline opens the tier's breaker (the
  pool's `breaker.PoolBreaker`): hints are withdrawn, nothing is queued or fetched, and a probe
  asks the store until it answers within the deadline. Then every directory key is checked
  against the store (a restarted master is an empty tier: its keys are dropped, never read
  stale), hints are restored and write-through resumes.

Region safety: a thread touches the region only while it holds its job's lock and the job is
not cancelled; `stop` cancels every job under its lock before the service unmaps the region.

Size: the write-through queue, fetches and outage handling share the jobs' locks and the
region-safety rule above; split apart, that rule would span files.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from maru_vllm.pool.breaker import PoolBreaker
from maru_vllm.pool.errors import PoolError
from maru_vllm.pool.objects import payload_checksum
from maru_vllm.pool.tier2 import codec
from maru_vllm.pool.tier2.announce import Tier2Announcer, Tier2Entry, chunk_meta_of
from maru_vllm.pool.tier2.directory import Tier2Directory
from maru_vllm.pool.tier2.interface import LocalObject, Tier2Error, Tier2Host, Tier2Store

logger = logging.getLogger(__name__)

STATE_UP, STATE_DOWN, STATE_CONNECTING = "up", "down", "connecting"
CONNECTING = "not joined yet"


@dataclass(frozen=True)
class Tier2Config:
    tier: str  # the tier's name in announcements: the master's HOST:PORT
    queue_max: int = 1024  # objects waiting for write-through
    put_budget: int = 512 << 20  # write-through bytes per second
    deadline_s: float = 2.0  # one store call (put, probe, exists)
    fetch_deadline_s: float = 1.0  # one fetch, from promote to commit
    hold_s: float = 5.0  # how long a fetched object stays pinned for its load
    max_fetches: int = 256  # fetches in flight
    directory_max: int = 262_144
    fetch_threads: int = 4
    nats: str | None = None  # announcements (None: this pool knows only its own puts)


@dataclass(eq=False)
class _Job:
    """A unit of thread work that may touch the region: under `lock`, and only while not cancelled."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True


class _Budget:
    """A token bucket of bytes per second (burst: a tenth of a second, or one object)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.tokens = 0.0
        self.at = time.monotonic()

    def delay_for(self, nbytes: int) -> float:
        now = time.monotonic()
        self.tokens = min(max(self.rate * 0.1, nbytes), self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= nbytes
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


COUNTERS = (
    "puts",  # objects put in the tier
    "put_bytes",
    "put_failures",  # puts the store refused or could not take
    "put_skipped",  # objects not written through: queue full, tier down, or gone before their turn
    "put_known",  # objects not written through because the tier already had them
    "gets",  # fetches tried
    "get_bytes",  # bytes fetched and committed
    "hits",  # fetches committed into the pool
    "misses",  # fetches of objects the tier no longer had
    "corrupt",  # fetched objects that failed verification (and payloads that did not match before a put)
    "late",  # fetches past their deadline
    "get_failures",  # fetches the store could not serve (down, refused)
    "refused",  # promotes answered without a fetch (tier down, no room, too many in flight)
    "trips",  # times the breaker opened
    "dropped_keys",  # directory keys found gone from the tier after an outage
)


class Tier2:
    def __init__(self, cfg: Tier2Config, store: Tier2Store, host: Tier2Host, pool: str, incarnation: str) -> None:
        self.cfg = cfg
        self.store = store
        self.host = host
        self.pool = pool
        self.directory = Tier2Directory(cfg.directory_max)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._queue: collections.deque[tuple[str, bytes]] = collections.deque()
        self._wake = asyncio.Event()
        self._budget = _Budget(cfg.put_budget)
        self._put_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="maru-tier2-put")
        self._get_pool = concurrent.futures.ThreadPoolExecutor(cfg.fetch_threads, thread_name_prefix="maru-tier2-get")
        self._check_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="maru-tier2-check")
        self._jobs: set[_Job] = set()
        self._fetching: dict[tuple[str, bytes], asyncio.Task[None]] = {}
        self._holds: collections.deque[tuple[float, object]] = collections.deque()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = STATE_CONNECTING
        self._stopping = False
        self._recovering = False
        self._probing: concurrent.futures.Future[None] | None = None
        self.breaker = PoolBreaker(cfg.tier, cfg.deadline_s, self._probe, what="tier 2")
        self.announcer: Tier2Announcer | None = None
        if cfg.nats:
            self.announcer = Tier2Announcer(cfg.nats, cfg.tier, pool, incarnation, self._learned, self._recent)

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn(self._writer())
        self._spawn(self._housekeeping())
        if self.announcer is not None:
            self.announcer.start()
        # the first connection is made by the breaker's probe, off the loop, however long it takes
        self._trip(CONNECTING)

    async def stop(self) -> None:
        """Cancel every job (no thread touches the region after this returns), drop the session."""
        self._stopping = True
        self.breaker.close()
        for t in list(self._tasks) + list(self._fetching.values()):
            t.cancel()
        for job in list(self._jobs):
            job.cancel()  # waits for a copy in progress
        if self.announcer is not None:
            await self.announcer.stop()
        for pool in (self._put_pool, self._get_pool, self._check_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self.host.close()
        # a thread still waiting on the store holds only its own staging buffer; closing the
        # client under it is left to process exit
        self._holds.clear()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    @property
    def state(self) -> str:
        return self._state

    @property
    def up(self) -> bool:
        return self._state == STATE_UP and not self.breaker.is_open

    # -- the service's hooks --------------------------------------------------------------------
    def on_event(self, kind: str, ns: str, key: bytes, session: int) -> None:
        """The pool's `stored` / `removed` event of an object (committed by `session`)."""
        if kind == "stored":
            self.on_stored(ns, key, session)
        else:
            self.on_removed(ns, key)

    def on_stored(self, ns: str, key: bytes, session: int) -> None:
        """A client committed an object: queue it for write-through."""
        if self.host.is_own(session):
            return  # fetched from the tier
        if not self.up or len(self._queue) >= self.cfg.queue_max:
            self.counters["put_skipped"] += 1
            return
        self._queue.append((ns, key))
        self._wake.set()

    def on_removed(self, ns: str, key: bytes) -> None:
        """An object left the pool: hint it again where the tier holds it."""
        if self.up and (ns, key) in self.directory:
            self.host.hint(ns, key)

    def promote(self, ns: str, keys: Sequence[bytes]) -> int:
        """Fetch the hinted `keys` into the pool; returns how many fetches are under way."""
        started = 0
        for key in keys:
            item = (ns, key)
            if item in self._fetching:
                started += 1
                continue
            if self.host.holds(ns, key):
                continue
            if item not in self.directory:
                self.host.unhint(ns, key)
                continue
            if not self.up or len(self._fetching) >= self.cfg.max_fetches or self._stopping:
                self.counters["refused"] += 1
                self.host.unhint(ns, key)
                continue
            task = self._spawn(self._fetch(ns, key))
            self._fetching[item] = task
            task.add_done_callback(self._fetch_done(item))
            started += 1
        return started

    def _fetch_done(self, item: tuple[str, bytes]) -> Callable[[asyncio.Task[Any]], None]:
        def done(_task: asyncio.Task[Any]) -> None:
            self._fetching.pop(item, None)

        return done

    def stats(self) -> dict[str, Any]:
        st: dict[str, Any] = {f"tier2_{k}": v for k, v in self.counters.items()}
        ann = self.announcer
        st.update(
            tier2=self.cfg.tier,
            tier2_state=self._state if not self.breaker.is_open or self._state == STATE_CONNECTING else STATE_DOWN,
            tier2_up=int(self.up),
            tier2_queue=len(self._queue),
            tier2_fetching=len(self._fetching),
            tier2_held=len(self._holds),
            tier2_keys=len(self.directory),
            tier2_keys_forgotten=self.directory.forgotten,
            tier2_hints=self.host.hints(),
            tier2_announced=ann.published if ann else 0,
            tier2_learned=ann.received if ann else 0,
            tier2_nats_connected=bool(ann and ann.connected),
        )
        return st

    # -- write-through ------------------------------------------------------------------------
    async def _writer(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            ns, key = self._queue.popleft()
            if not self.up:
                self.counters["put_skipped"] += 1
                continue
            if (ns, key) in self.directory:
                self.counters["put_known"] += 1
                continue
            obj = self.host.pin(ns, key)
            if obj is None:
                self.counters["put_skipped"] += 1
                continue
            try:
                await self._put(obj)
            finally:
                self.host.unpin(obj)

    async def _put(self, obj: LocalObject) -> None:
        size = codec.encoded_size(obj.ns, obj.key, obj.meta, obj.parts, len(obj.payload))
        delay = self._budget.delay_for(size)
        if delay > 0:
            await asyncio.sleep(delay)
        job = _Job()
        name = codec.object_name(obj.ns, obj.key)

        def run() -> bool | None:
            with job.lock:
                if job.cancelled:
                    return None
                checksum = payload_checksum(obj.payload)
                if obj.checksum is not None and checksum != obj.checksum:
                    return None  # the pool's own readers find and drop it
                blob = codec.encode(obj.ns, obj.key, checksum, obj.meta, obj.parts, obj.payload)
            return self.store.put(name, memoryview(blob))

        try:
            ok = await self._call(self._put_pool, run, job, self.cfg.deadline_s)
        except Tier2Error as exc:
            self.counters["put_failures"] += 1
            self._trip(f"put: {exc}")
            return
        if ok is None:
            self.counters["corrupt"] += 1
            return
        if not ok:
            self.counters["put_failures"] += 1
            return
        self.counters["puts"] += 1
        self.counters["put_bytes"] += size
        self.directory.add(obj.ns, obj.key, len(obj.payload), size)
        if self.announcer is not None:
            self.announcer.stored(Tier2Entry(obj.ns, obj.key, len(obj.payload), size, chunk_meta_of(obj.meta)))

    # -- fetches --------------------------------------------------------------------------------
    async def _fetch(self, ns: str, key: bytes) -> None:
        self.counters["gets"] += 1
        entry = self.directory.entry(ns, key)
        slot = self.host.reserve(ns, key, entry[0]) if entry is not None and entry[0] > 0 else None
        if entry is None or slot is None:
            self.counters["refused"] += 1
            self.host.unhint(ns, key)
            return
        size, tier_size = entry
        job = _Job()
        name = codec.object_name(ns, key)

        def read() -> tuple[str, tuple[int, bytes | None, tuple[bytes, ...]] | None]:
            data = self.store.get(name, tier_size or None)
            if data is None:
                return "miss", None
            try:
                obj = codec.decode(data, ns, key)
                if len(obj.payload) != size:
                    raise codec.Tier2Corrupt(f"{len(obj.payload)} payload bytes, {size} announced")
            except codec.Tier2Corrupt as exc:
                logger.warning("tier-2 object %s/%s failed verification (%s); treated as a miss", ns, key.hex(), exc)
                return "corrupt", None
            with job.lock:
                if job.cancelled:
                    return "late", None
                slot.payload[:] = obj.payload
            return "ok", (obj.checksum, obj.meta, obj.parts)

        try:
            outcome, found = await self._call(self._get_pool, read, job, self.cfg.fetch_deadline_s)
        except Tier2Error as exc:
            outcome, found = ("late" if "no answer" in str(exc) else "failed"), None
            if outcome == "failed":
                self._trip(f"get: {exc}")
        finally:
            job.cancel()  # from here on no thread writes into the slot
            self._jobs.discard(job)
        if outcome == "ok" and found is not None:
            checksum, meta, parts = found
            if self.host.commit(slot, checksum, meta, parts):
                self.counters["hits"] += 1
                self.counters["get_bytes"] += size
                self.directory.touch(ns, key)
                handle = self.host.hold(ns, key)
                if handle is not None:
                    self._holds.append((time.monotonic() + self.cfg.hold_s, handle))
                return
            outcome = "refused"
        else:
            self.host.abort(slot)
        self.host.unhint(ns, key)
        if outcome in ("miss", "corrupt"):
            self.counters["misses" if outcome == "miss" else "corrupt"] += 1
            self.directory.discard(ns, key)
            if self.announcer is not None:
                self.announcer.gone(Tier2Entry(ns, key))
        elif outcome == "late":
            self.counters["late"] += 1
            self._trip("a fetch missed its deadline")
        elif outcome == "failed":
            self.counters["get_failures"] += 1
        else:
            self.counters["refused"] += 1

    async def _call(
        self, pool: concurrent.futures.ThreadPoolExecutor, fn: Callable[[], Any], job: _Job, deadline: float
    ) -> Any:
        """`fn()` on `pool` within `deadline` seconds; Tier2Error when it fails or is late (the job is
        then cancelled: a thread still running it will not touch the region)."""
        self._jobs.add(job)
        try:
            fut = asyncio.get_running_loop().run_in_executor(pool, fn)
            return await asyncio.wait_for(fut, deadline)
        except (TimeoutError, asyncio.TimeoutError):
            job.cancel()
            raise Tier2Error(f"no answer within {deadline:.2f} s") from None
        except Tier2Error:
            raise
        except (PoolError, OSError, RuntimeError, ValueError) as exc:
            raise Tier2Error(f"{type(exc).__name__}: {exc}") from exc

    # -- what the other pools announce ------------------------------------------------------------
    def _learned(self, stored: list[Tier2Entry], gone: list[Tier2Entry]) -> None:
        for e in stored:
            for old_ns, old_key in self.directory.add(e.ns, e.key, e.size, e.tier_size):
                self.host.unhint(old_ns, old_key)
            if self.up and not self.host.holds(e.ns, e.key):
                self.host.hint(e.ns, e.key)
        for e in gone:
            if self.directory.discard(e.ns, e.key):
                self.host.unhint(e.ns, e.key)

    def _recent(self, n: int) -> list[Tier2Entry]:
        return [Tier2Entry(ns, key, size, tier_size) for (ns, key), (size, tier_size) in self.directory.recent(n)]

    # -- outages --------------------------------------------------------------------------------
    def _trip(self, why: str) -> None:
        if self._stopping:
            return
        if why != CONNECTING:
            self.counters["trips"] += 1
        was_up = self._state == STATE_UP
        self._state = STATE_CONNECTING if why == CONNECTING else STATE_DOWN
        self.breaker.trip(why)
        if was_up:
            self._spawn(self._withdraw_hints())
        if not self._recovering:
            self._recovering = True
            self._spawn(self._await_recovery())

    def _probe(self, deadline_s: float, stop: threading.Event) -> None:
        """The breaker's probe (its own thread): the store must answer within the deadline."""
        # a probe still running (joining a master that is not there takes Mooncake's client about
        # 90 s of retries) is waited on again rather than queued behind
        fut = self._probing
        if fut is None or fut.done():
            fut = self._probing = self._check_pool.submit(self.store.probe)
        try:
            fut.result(timeout=max(deadline_s, 0.1))
        except concurrent.futures.TimeoutError:
            raise Tier2Error("the store did not answer the probe in time") from None
        except Tier2Error:
            raise
        except Exception as exc:  # anything the store's binding raises is an unanswered probe
            raise Tier2Error(f"{type(exc).__name__}: {exc}") from exc

    async def _await_recovery(self) -> None:
        """Once the probe sees the store answer: check the known keys, then serve again."""
        try:
            loop = asyncio.get_running_loop()
            while not self._stopping:
                while self.breaker.is_open and not self._stopping:
                    await loop.run_in_executor(None, self.breaker.wait_closed, 0.5)
                if not self._stopping and await self._revalidate():
                    break
            else:
                return
        finally:
            self._recovering = False
        self._state = STATE_UP
        logger.info("tier 2 at %s is up (%d keys known)", self.cfg.tier, len(self.directory))
        await self._restore_hints()

    async def _withdraw_hints(self) -> None:
        for i, ((ns, key), _) in enumerate(self.directory.items()):
            self.host.unhint(ns, key)
            if i % 1024 == 1023:
                await asyncio.sleep(0)

    async def _restore_hints(self) -> None:
        for i, ((ns, key), _) in enumerate(self.directory.items()):
            if not self.up:
                return
            if not self.host.holds(ns, key):
                self.host.hint(ns, key)
            if i % 1024 == 1023:
                await asyncio.sleep(0)

    async def _revalidate(self) -> bool:
        """Drop directory keys the store no longer has (a restarted master has none); False
        (and the breaker open again) when the store stopped answering meanwhile."""
        items = [item for item, _ in self.directory.items()]
        loop = asyncio.get_running_loop()
        for i in range(0, len(items), 512):
            batch = items[i : i + 512]
            names = [codec.object_name(ns, key) for ns, key in batch]
            try:
                fut = loop.run_in_executor(self._check_pool, self.store.exists, names)
                there = await asyncio.wait_for(fut, self.cfg.deadline_s)
            except (Tier2Error, TimeoutError, asyncio.TimeoutError) as exc:
                logger.warning("tier 2: checking known keys failed (%s)", exc)
                self.breaker.trip("checking known keys")
                return False
            for (ns, key), ok in zip(batch, there):
                if not ok and self.directory.discard(ns, key):
                    self.counters["dropped_keys"] += 1
                    if self.announcer is not None:  # pools that did not notice the outage learn it here
                        self.announcer.gone(Tier2Entry(ns, key))
        return True

    # -- housekeeping ---------------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            while self._holds and self._holds[0][0] <= now:
                _, handle = self._holds.popleft()
                self.host.unhold(handle)
            self.host.keep_alive()
