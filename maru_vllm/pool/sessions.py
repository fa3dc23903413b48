"""Sessions, their pins and their quotas: who holds what in the pool, and how much they may.

A session is one client connection's claim on the pool: the reservations it has not committed
yet and the pins it holds on committed objects (a pin keeps an object's bytes in place while a
reader copies them). `SessionTable` keeps that ledger and enforces `SessionLimits`, so one
session cannot starve the others: the bytes it holds in uncommitted reservations and the bytes
of distinct objects it pins are capped, and so is the number of pins on one object. A refusal
is counted in `counters["quota_refusals"]` and answered with False; the pool index turns it
into a skipped store or a miss.

The ledger only accounts: what a pin or an unpin means for an object's life (leaving the LRU
order, being freed once doomed) is the pool index's business (`index.py`).
"""

from __future__ import annotations

import time

from maru_vllm.pool.records import Obj, Session, SessionLimits


class SessionTable:
    """The open sessions of one pool incarnation. Not thread-safe: the index's loop owns it."""

    def __init__(self, limits: SessionLimits, counters: dict[str, int]) -> None:
        """`counters`: the index's counters, where refusals are counted."""
        self.limits = limits
        self.counters = counters
        self.by_sid: dict[int, Session] = {}
        self._next_sid = 1

    def open(self, client: str = "") -> int:
        sid = self._next_sid
        self._next_sid += 1
        self.by_sid[sid] = Session(sid, client, time.monotonic())
        return sid

    def __getitem__(self, sid: int) -> Session:
        """The open session `sid`; KeyError when it is not open (closed, expired, never was)."""
        return self.by_sid[sid]

    def touch(self, sid: int) -> None:
        self.by_sid[sid].last_seen = time.monotonic()

    def pop(self, sid: int) -> Session | None:
        """Close `sid`: the caller frees its reservations and drops its pins."""
        return self.by_sid.pop(sid, None)

    def expired(self, lease_s: float) -> list[int]:
        """Sessions not heard from for `lease_s` seconds."""
        deadline = time.monotonic() - lease_s
        return [sid for sid, s in self.by_sid.items() if s.last_seen < deadline]

    # -- reservations ------------------------------------------------------------------------
    def may_reserve(self, s: Session, size: int) -> bool:
        quota = self.limits.reserve_bytes
        if quota is not None and s.reserved_bytes + size > quota:
            self.counters["quota_refusals"] += 1
            return False
        return True

    def reserved(self, s: Session, obj: Obj) -> None:
        s.reservations[obj.oid] = obj
        s.reserved_bytes += obj.size

    def unreserve(self, s: Session, oid: int) -> Obj | None:
        """Take `oid` out of `s`'s reservations (to commit or abort it); None if not there."""
        obj = s.reservations.pop(oid, None)
        if obj is not None:
            s.reserved_bytes -= obj.size
        return obj

    # -- pins --------------------------------------------------------------------------------
    def pin(self, s: Session, obj: Obj) -> bool:
        """One more pin of `obj` by `s` (and on `obj.pins`); False, counted, past the limits."""
        lim = self.limits
        first = obj.oid not in s.pins
        if (lim.pins_per_object is not None and obj.pins >= lim.pins_per_object) or (
            first and lim.pin_bytes is not None and s.pinned_bytes + obj.size > lim.pin_bytes
        ):
            self.counters["quota_refusals"] += 1
            return False
        obj.pins += 1
        s.pins[obj.oid] = s.pins.get(obj.oid, 0) + 1
        if first:
            s.pinned_bytes += obj.size
        return True

    def unpin(self, s: Session, oid: int, obj: Obj | None) -> bool:
        """Drop one of `s`'s pins of `oid` (`obj`: the object, None if already gone); False when
        `s` held none. The caller lowers `obj.pins`."""
        held = s.pins.get(oid, 0)
        if held == 0:
            return False
        if held == 1:
            del s.pins[oid]
            if obj is not None:
                s.pinned_bytes -= obj.size
        else:
            s.pins[oid] = held - 1
        return True

    def pinned_oids(self) -> list[int]:
        """Every oid some session pins now (with repeats across sessions)."""
        return [oid for s in self.by_sid.values() for oid in s.pins]
