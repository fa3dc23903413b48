"""The soak's faults: a schedule (``KIND@SECONDS[+HOLD]``), their injection, and their recovery.

Kinds (the failures a deployment sees):

* ``worker-kill`` - SIGKILL a Maru worker's whole process tree (API server, engine core and
  its helpers);
* ``worker-term`` - SIGTERM a Maru worker (what Kubernetes sends a pod it stops): it drains,
  migrates what is left, exits 0, and the graph starts it again; successive worker faults
  (kill or term) alternate over the workers;
* ``pool-kill``   - SIGKILL the pool service;
* ``pool-restart-warm`` - SIGKILL the pool service right after a probe prompt was stored in it:
  the service the graph starts again recovers the region, and the prompt is loaded from the pool
  again (a cold restart would have lost it);
* ``pool-stop``   - SIGSTOP the pool for HOLD seconds (default 8), then SIGCONT (a hung pool);
* ``nats-stop``   - stop nats-server (SIGTERM) and let the graph bring it back.

Nothing here restarts anything: healing is the graph's supervision, and what is measured is how
long it takes, from the injection, until

* ``out_of_routing_s`` - the frontend no longer lists the worker's old instance (worker faults),
* ``stopped_s``     - a SIGTERMed worker exited with code 0 (None for another code: see notes),
* ``worker_back_s`` - the frontend lists a new instance of the killed worker,
* ``serves_s``      - a request pinned to that instance completes,
* ``pool_back_s``   - the pool answers again (a new incarnation after a kill),
* ``old_prompt_hit_s`` - the probe prompt stored before a ``pool-restart-warm`` kill is loaded from
  the pool by the other worker, asked once (a miss there is a local hit the next time, so it is
  never asked again: None unless that one answer came from the pool); the recovered share of
  the pool's objects is in the notes,
* ``nats_back_s``   - nats-server accepts connections again,
* ``events_s``      - the pool reports its NATS link connected again,
* ``pool_hit_s``    - the pool is hit again: a fresh prompt computed on one worker is loaded
  from the pool by another (its cached tokens count a whole chunk; in a disaggregated graph: the
  pool counts the decode worker's loads of a fresh prompt's chunks).

In a disaggregated graph (`--graph disagg`) a worker kill also measures

* ``stand_in_s``   - the frontend's view says the killed worker's role is stood in for (its
  workers are gone from discovery while the other role's are listed; the other role's forwarding
  stand-ins, in discovery all along, serve it from the first retry on, `maru_dynamo.components.disagg.standby`),
* ``disagg_back_s`` - the graph is disaggregated again: both roles have a worker of their own,

and ``serves_s`` is a request that completes through the frontend after the new worker is listed
(a prefill instance cannot be pinned to).

A step that does not happen within the recovery timeout is None (not recovered).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from chaos import procs
from chaos.graph import NATS, POOL, GraphView, cached_tokens, wait_for

KINDS = ("worker-kill", "worker-term", "pool-kill", "pool-restart-warm", "pool-stop", "nats-stop")
DEFAULT_HOLD_S = 8.0
RECONNECT_CAP_S = 2.0  # a pool client's longest pause between reconnects (maru_vllm/pool/connection.py)
_ITEM = re.compile(r"^(?P<kind>[a-z-]+)@(?P<at>\d+(?:\.\d+)?)(?:\+(?P<hold>\d+(?:\.\d+)?))?$")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    at_s: float  # seconds after the load started
    hold_s: float = DEFAULT_HOLD_S  # pool-stop only


def parse_schedule(text: str) -> list[Fault]:
    """``worker-kill@20,pool-stop@80+8`` -> faults in time order; ValueError names the bad item."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        m = _ITEM.match(item)
        if not m:
            raise ValueError(f"fault {item!r}: use KIND@SECONDS or pool-stop@SECONDS+HOLD, e.g. pool-stop@80+8")
        kind = m.group("kind")
        if kind not in KINDS:
            raise ValueError(f"fault {item!r}: unknown kind {kind!r}; use one of {', '.join(KINDS)}")
        if m.group("hold") is not None and kind != "pool-stop":
            raise ValueError(f"fault {item!r}: only pool-stop takes +HOLD seconds")
        hold = float(m.group("hold")) if m.group("hold") is not None else DEFAULT_HOLD_S
        if kind == "pool-stop" and hold <= 0:
            raise ValueError(f"fault {item!r}: the hold must be more than 0 seconds")
        faults.append(Fault(kind, float(m.group("at")), hold))
    return sorted(faults, key=lambda f: f.at_s)


@dataclasses.dataclass
class FaultRecord:
    kind: str
    target: str
    planned_at_s: float
    injected_at_s: float  # since the load started
    pids: list[int]
    recovery: dict[str, float | None] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def recovered(self) -> bool:
        return bool(self.recovery) and all(v is not None for v in self.recovery.values())


class FaultRunner:
    """Injects `schedule` against `view` (times relative to `t0`, time.monotonic()) in a thread."""

    def __init__(
        self,
        view: GraphView,
        schedule: list[Fault],
        chunk_tokens: int,
        recovery_timeout_s: float = 240.0,
        log: Callable[[str], None] = print,
    ) -> None:
        self.view, self.schedule, self.chunk_tokens = view, schedule, chunk_tokens
        self.recovery_timeout_s = recovery_timeout_s
        self.records: list[FaultRecord] = []
        self.probes = {"sent": 0, "answered": 0}
        self.log = log
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kills = 0
        self._due_only = False  # set once the load ended: inject nothing more
        self.t0 = 0.0

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._thread = threading.Thread(target=self._run, name="chaos-faults", daemon=True)
        self._thread.start()

    def pending(self) -> bool:
        """Whether a fault is still to be injected or recovering."""
        return self._thread is not None and self._thread.is_alive()

    def finish(self) -> None:
        """Wait for the fault being measured to recover (bounded by the recovery timeout); the
        faults not yet due are not injected."""
        self._due_only = True
        if self._thread is not None:
            self._thread.join(timeout=self.recovery_timeout_s + 30)
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.recovery_timeout_s + 30)

    def _run(self) -> None:
        for fault in self.schedule:
            due = self.t0 + fault.at_s
            while time.monotonic() < due:
                if self._due_only or self._stop.wait(min(0.5, due - time.monotonic())):
                    return
            if self._stop.is_set():
                return
            record = self.inject(fault)
            self.records.append(record)
            self.log(f"[soak] {record.kind} of {record.target} at {record.injected_at_s:.0f}s: {record.recovery}")

    # -- one fault -------------------------------------------------------------------------------
    def inject(self, fault: Fault) -> FaultRecord:
        view = self.view
        if fault.kind in ("worker-kill", "worker-term"):
            target = view.worker_names[self._kills % len(view.worker_names)]
            self._kills += 1
        else:
            target = NATS if fault.kind == "nats-stop" else POOL  # pool-kill, pool-restart-warm, pool-stop
        record = FaultRecord(fault.kind, target, fault.at_s, time.monotonic() - self.t0, [])
        pid = view.pid(target)
        if pid is None:
            record.notes.append(f"{target} was not running when the fault was due")
            record.recovery["injected"] = None
            return record
        getattr(self, "_" + fault.kind.replace("-", "_"))(fault, record, pid)
        return record

    def _since(self, start: float) -> Callable[[], float]:
        return lambda: time.monotonic() - start

    def _worker_kill(self, fault: Fault, record: FaultRecord, pid: int) -> None:
        before = set(self.view.instances())
        old = self.view.instance_of(record.target)
        start = time.monotonic()
        record.pids = procs.signal_tree(pid, signal.SIGKILL)
        record.recovery["out_of_routing_s"] = self._step(
            lambda: old is not None and old not in self.view.instances(), start, poll_s=0.05
        )
        self._worker_back(record, before, start)

    def _worker_term(self, fault: Fault, record: FaultRecord, pid: int) -> None:
        before = set(self.view.instances())
        old = self.view.instance_of(record.target)
        process = self.view.process(record.target)
        popen = process.proc if process is not None else None
        start = time.monotonic()
        record.pids = [pid]
        os.kill(pid, signal.SIGTERM)  # the leader only, as the kubelet and `graph restart` do
        record.recovery["out_of_routing_s"] = self._step(
            lambda: old is not None and old not in self.view.instances(), start, poll_s=0.05
        )
        stopped = self._step(lambda: popen is None or popen.poll() is not None, start, poll_s=0.05)
        code = popen.returncode if popen is not None else None
        record.notes.append(f"exit code {code}")
        record.recovery["stopped_s"] = stopped if code == 0 else None
        self._worker_back(record, before, start)

    def _worker_back(self, record: FaultRecord, before: set[int], start: float) -> None:
        """The steps after a worker fault: a new instance listed, serving, hit from the pool."""
        new: list[int] = []

        def registered() -> bool:
            now = self.view.instances()
            new[:] = [i for i in now if i not in before]
            return bool(new)

        if self.view.disaggregated:
            record.recovery["stand_in_s"] = self._step(self.view.stand_in, start, poll_s=0.1)
            record.recovery["worker_back_s"] = self._step(registered, start)
            record.recovery["disagg_back_s"] = self._step(self.view.disaggregated_again, start)
            record.recovery["serves_s"] = self._step(lambda: self._ask(None, None), start)
            record.recovery["pool_hit_s"] = self._step(lambda: self._pool_hit(None), start)
            return
        record.recovery["worker_back_s"] = self._step(registered, start)
        record.recovery["serves_s"] = self._step(lambda: self._ask(None, new[0]) if new else False, start)
        record.recovery["pool_hit_s"] = self._step(lambda: self._pool_hit(new[0] if new else None), start)
        if new and before & set(self.view.instances()):
            record.notes.append("the frontend still lists the killed worker's instance")

    def _pool_kill(self, fault: Fault, record: FaultRecord, pid: int) -> None:
        stats = self.view.pool_stats() or {}
        incarnation = stats.get("incarnation")
        start = time.monotonic()
        record.pids = procs.signal_tree(pid, signal.SIGKILL)

        def back() -> bool:
            now = self.view.pool_stats(timeout=1.0)
            return now is not None and now.get("incarnation") != incarnation

        record.recovery["pool_back_s"] = self._step(back, start)
        record.recovery["pool_hit_s"] = self._step(lambda: self._pool_hit(None), start)

    def _pool_restart_warm(self, fault: Fault, record: FaultRecord, pid: int) -> None:
        instances = self.view.instances()
        if len(instances) < 2:
            record.notes.append("fewer than two workers serve: no probe prompt to carry over the restart")
            record.recovery["old_prompt_hit_s"] = None
            return
        writer, reader = instances[0], instances[-1]
        prompt = self.view.probe_prompt(2 * self.chunk_tokens + 1)
        self._ask(prompt, writer)
        chunks: list[tuple[str, bytes]] = []
        until = time.monotonic() + 5.0
        while len(chunks) < 2 and time.monotonic() < until:  # stores are write-behind: just after the answer
            time.sleep(0.2)
            chunks = self._probe_chunks(prompt)
        stats = self.view.pool_stats() or {}
        incarnation, objects = stats.get("incarnation"), stats.get("objects")
        start = time.monotonic()
        record.pids = procs.signal_tree(self.view.pid(POOL) or pid, signal.SIGKILL)
        after: dict[str, Any] = {}
        held: list[Any] = []  # (client, pins) on the probe's chunks in the new incarnation

        def back() -> bool:
            now = self.view.pool_stats(timeout=1.0)
            if now is None or now.get("incarnation") == incarnation:
                return False
            after.update(now)
            held.extend(self._pin(chunks))
            return True

        try:
            record.recovery["pool_back_s"] = self._step(back, start)
            pinned = sum(p is not None for p in held[1]) if held else 0
            record.notes.append(
                f"recovered {after.get('recovered_objects')} of {objects} objects in {after.get('recovery_seconds')} s "
                f"({after.get('recovery_dropped')} dropped; last stop {after.get('last_stop')}); the probe's "
                f"{len(chunks)} chunks committed before the kill, {pinned} found again"
            )
            if record.recovery["pool_back_s"] is None or len(chunks) < 2 or pinned < len(chunks):
                record.recovery["old_prompt_hit_s"] = None
                return
            # The probe's chunks stay pinned until the reader asked (the load's stores evict a small
            # pool within seconds). Asked once on the reader: a miss would put the prompt in the
            # reader's own prefix cache, and every later answer would be a local hit. The reader's
            # connections reconnect at most RECONNECT_CAP_S after the pool answers again (their
            # backoff), so ask after that; only an ask that got no answer at all is repeated.
            time.sleep(RECONNECT_CAP_S + 1.0)
            cached: list[int] = []

            def old_prompt_answered() -> bool:
                out = self._ask(prompt, reader)
                if out is not None:
                    cached.append(cached_tokens(out))
                return out is not None

            answered = self._step(old_prompt_answered, start)
            hit = answered is not None and cached[-1] >= 2 * self.chunk_tokens
            record.recovery["old_prompt_hit_s"] = answered if hit else None
            if answered is not None and not hit:
                record.notes.append(
                    f"the prompt stored before the kill was not loaded from the pool: {cached[-1]} of "
                    f"{2 * self.chunk_tokens} prompt tokens cached"
                )
        finally:
            if held:
                client, pins = held
                try:
                    client.release(pins)
                finally:
                    client.close()

    def _probe_chunks(self, prompt: list[int]) -> list[tuple[str, bytes]]:
        """(namespace, key) of the pool's chunks holding the whole chunks of `prompt`."""
        from maru_vllm.pool import PoolClient, PoolError

        try:
            with PoolClient.connect(self.view.pool_address, heartbeat=False, timeout=5.0) as c:
                objs = c.snapshot()
        except (PoolError, OSError):
            return []
        found: dict[int, tuple[str, bytes]] = {}
        for o in objs:
            meta = o.get("meta") or {}
            i = meta.get("chunk") if isinstance(meta, dict) else None
            if i is None or not isinstance(meta.get("token_ids"), list):
                continue
            if [t for block in meta["token_ids"] for t in block] == prompt[
                i * self.chunk_tokens : (i + 1) * self.chunk_tokens
            ]:
                found[i] = (o["namespace"], bytes.fromhex(o["key"]))
        return [found[i] for i in sorted(found)]

    def _pin(self, chunks: list[tuple[str, bytes]]) -> list[Any]:
        """[client, pins]: `chunks` pinned (verified) on the pool, so that nothing evicts them."""
        from maru_vllm.pool import PoolClient, PoolError

        try:
            client = PoolClient.connect(self.view.pool_address, checksum=True, timeout=5.0)
        except (PoolError, OSError):
            return []
        try:
            pins = [pin for ns, key in chunks for pin in client.acquire([key], ns)]
        except (PoolError, OSError):
            client.close()
            return []
        return [client, pins]

    def _pool_stop(self, fault: Fault, record: FaultRecord, pid: int) -> None:
        start = time.monotonic()
        record.pids = procs.signal_tree(pid, signal.SIGSTOP)
        try:
            self._stop.wait(fault.hold_s)
        finally:
            for p in record.pids:
                try:
                    os.kill(p, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        record.notes.append(f"stopped for {time.monotonic() - start:.1f}s")
        resumed = time.monotonic()
        record.recovery["pool_hit_s"] = self._step(lambda: self._pool_hit(None), start)
        hit = record.recovery["pool_hit_s"]
        record.recovery["pool_hit_after_resume_s"] = None if hit is None else max(0.0, start + hit - resumed)

    def _nats_stop(self, fault: Fault, record: FaultRecord, pid: int) -> None:
        start = time.monotonic()
        record.pids = [pid]
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not procs.alive(pid), 10, 0.1)
        record.recovery["nats_back_s"] = self._step(self.view.nats_accepts, start, poll_s=0.2)

        def events() -> bool:
            stats = self.view.pool_stats(timeout=1.0)
            return bool(stats and stats.get("nats_connected"))

        record.recovery["events_s"] = self._step(events, start)
        record.recovery["pool_hit_s"] = self._step(lambda: self._pool_hit(None), start)

    # -- recovery probes -------------------------------------------------------------------------
    def _step(self, check: Callable[[], Any], start: float, poll_s: float = 0.5) -> float | None:
        """Seconds from `start` until `check()` holds, or None once the recovery timeout passed."""
        while time.monotonic() - start < self.recovery_timeout_s and not self._stop.is_set():
            if check():
                return round(time.monotonic() - start, 2)
            time.sleep(poll_s)
        return None

    def _ask(self, prompt: list[int] | None, instance: int | None) -> dict[str, Any] | None:
        self.probes["sent"] += 1
        out = self.view.ask(prompt or self.view.probe_prompt(8), instance)
        self.probes["answered"] += out is not None
        return out

    def _pool_hit(self, reader: int | None) -> bool:
        """A fresh prompt computed on one worker, then asked on another: loaded from the pool?"""
        if self.view.disaggregated:
            return self._pool_hit_disaggregated()
        instances = self.view.instances()
        if len(instances) < 2 or (reader is not None and reader not in instances):
            return False
        reader = reader if reader is not None else instances[-1]
        writer = next(i for i in instances if i != reader)
        prompt = self.view.probe_prompt(2 * self.chunk_tokens + 1)
        if self._ask(prompt, writer) is None:
            return False
        time.sleep(1.0)  # stores are write-behind: committed just after the answer
        out = self._ask(prompt, reader)
        return out is not None and cached_tokens(out) >= self.chunk_tokens

    def _pool_hit_disaggregated(self) -> bool:
        """A fresh prompt of two whole chunks: its decode leg loads both from the pool (the
        response's cached tokens are the prefill leg's, so the pool's own hit count tells)."""
        before = self.view.pool_stats(timeout=1.0)
        if before is None or self._ask(self.view.probe_prompt(2 * self.chunk_tokens + 1), None) is None:
            return False
        after = self.view.pool_stats(timeout=1.0)
        return (
            after is not None
            and after.get("incarnation") == before.get("incarnation")
            and (int(after.get("hits", 0)) - int(before.get("hits", 0)) >= 2)
        )
