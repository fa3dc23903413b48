"""The pool's object table and the life cycle of its objects.

Pure in-memory logic with no I/O, so it is unit-testable and the service stays a thin shell.
Object life cycle::

    reserve -> RESERVED (owned by one session, invisible, never evictable)
        commit  -> COMMITTED (visible; evictable while nobody pins it)
        abort / session gone -> freed
    COMMITTED -> evicted (least recently used, unpinned only) or doomed (a reader found it
                 corrupt: hidden at once, freed when the last pin goes)

`PoolIndex` owns the object table (keys to objects, every live object by oid) and moves objects
through that cycle; it delegates, one module each, to

* `sessions.SessionTable`: sessions, their reservations and pins, and their quotas. Past a
  limit a reservation is None (the writer skips the store) and an acquire is None (the reader
  misses and recomputes); both count in `quota_refusals`;
* `order.EvictionOrder` (only unpinned committed objects, least recently used first, so
  eviction is O(1) per victim and never chooses a pinned or in-flight object) and
  `order.CommitOrder` (the cursor of paged snapshots: neither a snapshot nor `stats` ever walks
  or copies the whole set at once);
* `parts.PartIndex`: objects found by a key naming their leading parts (at most MAX_PARTS per
  object, dropped when the object is hidden), and their presence-table entries;
* `metastore.MetadataStore`: each committed object's metadata, in this process or in a region
  block of its own beside the payloads (with the catalog record a warm restart recovers).

Memory: the index's own memory is bounded, not only the region. Every live object counts
against `max_objects` and every committed object's metadata (its stored bytes, its key and part
keys) against `metadata_budget` bytes. Like region space, both are reclaimed by evicting the
least recently used objects; when nothing evictable is left a reserve (object cap) or a commit
(metadata budget, or no region space for the metadata) is refused, which the connector treats as
a skipped store.

Size: the life cycle above is one state machine over the object table; its parts that stand
alone are in the modules named above.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from maru_vllm.pool.allocator import Allocation, Allocator
from maru_vllm.pool.catalog import Catalog, Identity
from maru_vllm.pool.messages import EventType, ObjectInfo
from maru_vllm.pool.metastore import MetadataStore
from maru_vllm.pool.objects import OBJ_HEADER_SIZE
from maru_vllm.pool.order import CommitOrder, EvictionOrder
from maru_vllm.pool.parts import Holders, PartIndex
from maru_vllm.pool.presence import PresenceTable
from maru_vllm.pool.protocol import MAX_PARTS
from maru_vllm.pool.records import MetaIO, Obj, Session, SessionLimits
from maru_vllm.pool.sessions import SessionTable

logger = logging.getLogger(__name__)

DEFAULT_MAX_OBJECTS = 2_000_000
DEFAULT_METADATA_BUDGET = 1 << 30
OID_STEP = 1 << 16  # the oid floor in the region header moves up in steps of this many oids


EventSink = Callable[[EventType, Obj], None]

#: what `stats` counts from the start (``removals`` appears with the first removal)
COUNTERS = (
    *("hits", "misses", "stores", "duplicate_commits", "evictions", "corrupt_reads"),
    *("reserve_failures", "reserve_existing", "aborts", "sessions_expired", "quota_refusals"),
    *("object_cap_refusals", "metadata_budget_refusals", "metadata_space_refusals", "metadata_unreadable"),
    *(f"evictions_{reason}" for reason in ("space", "object_cap", "metadata_budget")),
)


class PoolIndex:
    """All metadata of one pool incarnation. Not thread-safe: the service runs it on one loop."""

    def __init__(
        self,
        allocator: Allocator,
        data_offset: int,
        on_event: EventSink | None = None,
        limits: SessionLimits | None = None,
        *,
        max_objects: int = DEFAULT_MAX_OBJECTS,
        metadata_budget: int = DEFAULT_METADATA_BUDGET,
        meta_io: MetaIO | None = None,
        presence: PresenceTable | None = None,
        catalog: Catalog | None = None,
        on_oid_floor: Callable[[int], None] | None = None,
    ) -> None:
        """`meta_io`: keep metadata in region blocks through it (None: in this process's memory).
        `presence`: keep that table equal to the visible keys and parts (`pool.presence`).
        `catalog` (with `meta_io`): keep a record of every visible object in the region, so a
        service started again on it can recover them (`catalog.py`). `on_oid_floor(n)`: called
        before any oid >= the last floor it was given is handed out, with a new floor."""
        self.alloc = allocator
        self.presence = presence
        self.on_oid_floor = on_oid_floor
        self._oid_floor = 0
        self.limits = limits or SessionLimits()
        self.data_offset = data_offset
        self.on_event = on_event
        self.max_objects = max_objects
        self.metadata_budget = metadata_budget
        self.metadata_bytes = 0  # sum of meta_cost over committed (visible or doomed) objects
        self.object_bytes = 0  # payload bytes of visible objects
        self._next_cseq = 1
        self.objects: dict[tuple[str, bytes], Obj] = {}
        self.live: dict[int, Obj] = {}  # every allocated object by oid (reserved, committed, doomed)
        self._next_oid = 1
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._sessions = SessionTable(self.limits, self.counters)
        self._lru = EvictionOrder()
        self._order = CommitOrder()
        self._parts = PartIndex(presence)
        self._meta = MetadataStore(meta_io, catalog, data_offset, self._alloc_evicting, self.counters)

    @property
    def sessions(self) -> dict[int, Session]:
        """The open sessions by id (read-only use: open and close them through the index)."""
        return self._sessions.by_sid

    @property
    def parts(self) -> dict[tuple[str, bytes], Holders]:
        """(namespace, part key) -> the visible objects naming it (read-only use)."""
        return self._parts.holders

    # -- sessions ---------------------------------------------------------------------------
    def open_session(self, client: str = "") -> int:
        return self._sessions.open(client)

    def touch_session(self, sid: int) -> None:
        self._sessions.touch(sid)

    def close_session(self, sid: int) -> tuple[int, int]:
        """Drop a session: free its reservations, drop its pins. Returns (reservations, pins)."""
        s = self._sessions.pop(sid)
        if s is None:
            return (0, 0)
        for obj in s.reservations.values():
            self._free(obj)
        npins = 0
        for oid, count in s.pins.items():
            npins += count
            pinned = self.live.get(oid)
            if pinned is not None:
                self._unpin(pinned, count)
        return (len(s.reservations), npins)

    def expired_sessions(self, lease_s: float) -> list[int]:
        return self._sessions.expired(lease_s)

    # -- reads ------------------------------------------------------------------------------
    def lookup(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        out = []
        for k in keys:
            obj = self.objects.get((ns, k))
            out.append(obj is not None)
            if obj is not None:
                self._touch(obj)
        self._count(out)
        return out

    def lookup_prefix(self, ns: str, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            obj = self.objects.get((ns, k))
            if obj is None:
                break
            self._touch(obj)
            n += 1
        self.counters["hits"] += n
        self.counters["misses"] += 1 if n < len(keys) else 0
        return n

    def lookup_parts(self, ns: str, keys: Sequence[bytes]) -> list[int]:
        """For each key, how many leading units of a committed object it names (0: none)."""
        out = []
        for k in keys:
            found = self._parts.newest(ns, k)
            if found is None:
                out.append(0)
                continue
            self._touch(found[0])
            out.append(found[1])
        return out

    def acquire_parts(self, sid: int, ns: str, keys: Sequence[bytes]) -> list[tuple[Obj, int] | None]:
        """Pin, for each part key, an object it names; (object, units) or None."""
        s = self._sessions[sid]
        out: list[tuple[Obj, int] | None] = []
        for k in keys:
            found = self._parts.newest(ns, k)
            if found is not None and not self._pin(s, found[0]):
                found = None
            out.append(found)
        self._count([o is not None for o in out])
        return out

    def remove(self, ns: str, keys: Sequence[bytes] | None) -> int:
        """Hide committed objects of `ns` (all of them when `keys` is None); returns how many.

        Pinned objects disappear from lookups at once and are freed when their last reader
        releases them, exactly as an eviction would treat them.
        """
        if keys is None:
            victims = [o for (o_ns, _), o in self.objects.items() if o_ns == ns]
        else:
            victims = [o for o in (self.objects.get((ns, k)) for k in keys) if o is not None]
        for obj in victims:
            self.counters["removals"] = self.counters.get("removals", 0) + 1
            self._hide(obj, "removed")
        return len(victims)

    def acquire(self, sid: int, ns: str, keys: Sequence[bytes]) -> list[Obj | None]:
        s = self._sessions[sid]
        out: list[Obj | None] = []
        for k in keys:
            obj = self.objects.get((ns, k))
            if obj is not None and not self._pin(s, obj):
                obj = None
            out.append(obj)
        self._count([o is not None for o in out])
        return out

    def release(self, sid: int, oids: Sequence[int], bad: Sequence[int] = ()) -> int:
        """Drop one pin per oid; oids in `bad` failed validation and are removed. Returns count."""
        s = self._sessions[sid]
        for oid in bad:
            obj = self.live.get(oid)
            if obj is not None and obj.committed and not obj.doomed and oid in s.pins:
                logger.warning("object %s/%s reported corrupt by session %d; removing it", obj.ns, obj.key.hex(), sid)
                self.counters["corrupt_reads"] += 1
                self.counters["hits"] -= 1
                self.counters["misses"] += 1
                self._hide(obj, "removed")
        released = 0
        for oid in oids:
            obj = self.live.get(oid)
            if not self._sessions.unpin(s, oid, obj):
                continue
            if obj is not None:
                self._unpin(obj, 1)
            released += 1
        return released

    # -- writes -----------------------------------------------------------------------------
    def reserve(self, sid: int, ns: str, items: Sequence[tuple[bytes, int]]) -> list[Obj | None]:
        s = self._sessions[sid]
        out: list[Obj | None] = []
        for key, size in items:
            if (ns, key) in self.objects:
                self.counters["reserve_existing"] += 1
                out.append(None)
                continue
            if not self._sessions.may_reserve(s, size):
                out.append(None)
                continue
            if not self._evict_until(lambda: len(self.live) < self.max_objects, "object_cap"):
                self.counters["object_cap_refusals"] += 1
                self.counters["reserve_failures"] += 1
                out.append(None)
                continue
            a = self._alloc_evicting(OBJ_HEADER_SIZE + size)
            if a is None:
                self.counters["reserve_failures"] += 1
                out.append(None)
                continue
            if self._next_oid >= self._oid_floor and self.on_oid_floor is not None:
                self._oid_floor = self._next_oid + OID_STEP
                self.on_oid_floor(self._oid_floor)
            obj = Obj(self._next_oid, ns, key, size, a, self.data_offset, sid)
            self._next_oid += 1
            self.live[obj.oid] = obj
            self._sessions.reserved(s, obj)
            out.append(obj)
        return out

    def commit(
        self,
        sid: int,
        oids: Sequence[int],
        metas: Sequence[bytes | None],
        verify: Callable[[Obj], str | None],
        parts: Sequence[Sequence[bytes] | None] | None = None,
    ) -> list[bool]:
        s = self._sessions[sid]
        out = []
        for i, (oid, meta) in enumerate(zip(oids, metas)):
            obj = self._sessions.unreserve(s, oid)
            if obj is None:
                out.append(False)  # not ours, already committed/aborted, or from an old session
                continue
            if (obj.ns, obj.key) in self.objects:
                self.counters["duplicate_commits"] += 1
                self._free(obj)
                out.append(False)
                continue
            problem = verify(obj)
            if problem is not None:
                logger.warning("commit of %s/%s rejected: %s", obj.ns, obj.key.hex(), problem)
                self._free(obj)
                out.append(False)
                continue
            obj.meta_len = len(meta) if meta is not None else 0
            part_keys = parts[i] if parts is not None else None
            obj.parts = tuple(part_keys[:MAX_PARTS]) if part_keys else ()
            cost = obj.meta_cost
            # _evict_until calls the predicate before it returns, so it sees this iteration's `cost`.
            if not self._evict_until(lambda: self.metadata_bytes + cost <= self.metadata_budget, "metadata_budget"):  # noqa: B023
                logger.debug(
                    "commit of %s/%s refused: metadata budget of %d bytes is full of pinned objects",
                    obj.ns,
                    obj.key.hex(),
                    self.metadata_budget,
                )
                self.counters["metadata_budget_refusals"] += 1
                self._free(obj)
                out.append(False)
                continue
            obj.cseq = self._next_cseq
            if not self._meta.keep(obj, meta):
                self.counters["metadata_space_refusals"] += 1
                self._free(obj)
                out.append(False)
                continue
            obj.committed = True
            self._next_cseq += 1
            self.metadata_bytes += cost
            self.object_bytes += obj.size
            self.objects[(obj.ns, obj.key)] = obj
            if self.presence is not None:
                self.presence.put(self.presence.fingerprints.of_object(obj.ns, obj.key))
            self._parts.add(obj)  # obj is now the newest holder of each of its parts
            self._order.append(obj)
            self._compact_order()
            self._lru.add(obj)
            self.counters["stores"] += 1
            self._emit("stored", obj)
            out.append(True)
        return out

    def abort(self, sid: int, oids: Sequence[int]) -> int:
        s = self._sessions[sid]
        n = 0
        for oid in oids:
            obj = self._sessions.unreserve(s, oid)
            if obj is not None:
                self._free(obj)
                n += 1
        self.counters["aborts"] += n
        return n

    def meta_of(self, obj: Obj) -> bytes | None:
        """The metadata `obj` was committed with (None: none, or its region block was damaged)."""
        return self._meta.read(obj)

    # -- recovery ---------------------------------------------------------------------------
    def restore(self, found: Sequence[tuple[Identity, Allocation, Allocation, int]], oid_floor: int = 0) -> None:
        """Make visible again the objects a previous service left in the region (a warm restart;
        `recovery.py` verified them and claimed their blocks): (identity, payload block, record
        block, catalog slot) each, of distinct keys, on a fresh index before any session opens.
        They keep their oids and commit order; LRU order is commit order. New oids start above
        every recovered one and `oid_floor`."""
        top_oid, top_cseq = oid_floor, 0
        live, objects = self.live, self.objects
        data_offset = self.data_offset
        meta_bytes = object_bytes = 0
        tags: list[int] = []  # presence entries: the objects', then their parts' in commit order
        part_tags: list[int] = []
        part_units: list[int] = []
        fps = self.presence.fingerprints if self.presence is not None else None
        for ident, payload, record, slot in sorted(found, key=lambda f: f[0].cseq):
            oid, ns = ident.oid, ident.ns
            obj = Obj(
                oid,
                ns,
                ident.key,
                ident.size,
                payload,
                data_offset,
                0,
                meta=record,
                meta_len=ident.meta_len,
                parts=ident.parts,
                committed=True,
                cseq=ident.cseq,
                slot=slot,
            )
            live[oid] = obj
            objects[(ns, obj.key)] = obj
            self._lru.add(obj)
            self._order.append(obj)
            self._parts.add(obj, announce=False)
            if fps is not None:
                tags.append(fps.of_object(ns, obj.key))
                if obj.parts:
                    more_tags, more_units = self._parts.presence_of(obj)
                    part_tags += more_tags
                    part_units += more_units
            meta_bytes += obj.meta_cost
            object_bytes += obj.size
            if oid >= top_oid:
                top_oid = oid + 1
            top_cseq = obj.cseq
        self.metadata_bytes += meta_bytes
        self.object_bytes += object_bytes
        self._next_oid = max(self._next_oid, top_oid)
        self._next_cseq = max(self._next_cseq, top_cseq + 1)
        if self.presence is not None:
            self.presence.put_many(tags + part_tags, [0] * len(tags) + part_units)
        # a smaller budget than the last service had: the least recently used go, as at a commit
        self._evict_until(lambda: self.metadata_bytes <= self.metadata_budget, "metadata_budget")

    # -- views ------------------------------------------------------------------------------
    def snapshot(self, ns: str | None = None) -> list[ObjectInfo]:
        """Every visible object (tests and small pools; the service serves `snapshot_page`)."""
        return [o.info(self.meta_of(o)) for o in self.objects.values() if ns is None or o.ns == ns]

    def snapshot_page(
        self,
        ns: str | None,
        after: int,
        limit: int,
        max_bytes: int,
        max_scan: int = 65536,
        recent: int = 0,
        prefixes: Sequence[str] | None = None,
    ) -> tuple[list[Obj], int | None]:
        """Visible objects committed after cursor `after`, in commit order: at most `limit` of
        them, stopping once their metadata passes `max_bytes` or `max_scan` entries were looked
        at; of namespace `ns` and of namespaces starting with one of `prefixes` (None: any);
        with `recent` > 0 only those among the `recent` most recently used of them
        (`recently_used`, taken anew for each page). Returns (objects, cursor of the next page
        or None when this is the last)."""
        self._compact_order()
        wanted = self.recently_used(recent, ns, prefixes) if recent > 0 else None
        scope = _scope(ns, prefixes)
        objects = self.objects

        def keep(o: Obj) -> bool:
            if wanted is not None and o.oid not in wanted:
                return False
            return scope(o.ns) and objects.get((o.ns, o.key)) is o

        return self._order.page(after, limit, max_bytes, max_scan, keep)

    def recently_used(self, n: int, ns: str | None = None, prefixes: Sequence[str] | None = None) -> set[int]:
        """Oids of the `n` most recently used committed objects (of `ns`, and of namespaces
        starting with one of `prefixes`): those pinned now, then from the most recently used end
        of the LRU order. O(n) plus the pins, plus the objects of other namespaces passed over."""
        out: set[int] = set()
        scope = _scope(ns, prefixes)
        for oid in self._sessions.pinned_oids():
            o = self.live.get(oid)
            if len(out) < n and o is not None and o.committed and not o.doomed and scope(o.ns):
                out.add(oid)
        for o in self._lru.most_recent_first():
            if len(out) >= n:
                break
            if scope(o.ns):
                out.add(o.oid)
        return out

    def stats(self) -> dict[str, Any]:
        reserved = [o for s in self.sessions.values() for o in s.reservations.values()]
        st: dict[str, Any] = dict(self.counters)
        st.update(self.alloc.stats())
        pinned = pins = doomed = live_alloc = 0
        for o in self.live.values():  # every sum below in one pass
            pinned += o.pins > 0
            pins += o.pins
            doomed += o.doomed
            live_alloc += o.alloc.capacity + (o.meta.capacity if isinstance(o.meta, Allocation) else 0)
        st.update(
            objects=len(self.objects),
            object_bytes=self.object_bytes,
            live_objects=len(self.live),
            max_objects=self.max_objects,
            metadata_bytes=self.metadata_bytes,
            metadata_budget_bytes=self.metadata_budget,
            reserved=len(reserved),
            reserved_bytes=sum(o.alloc.capacity for o in reserved),
            part_keys=len(self.parts),
            pinned=pinned,
            pins=pins,
            doomed=doomed,
            # allocator bytes accounted to live objects; equals allocated_bytes unless space leaked
            live_object_alloc_bytes=live_alloc,
            sessions=len(self.sessions),
        )
        try:
            self.alloc.check()
            st["allocator_consistent"] = True
        except AssertionError as exc:
            logger.error("allocator inconsistency: %s", exc)
            st["allocator_consistent"] = False
        return st

    # -- internals --------------------------------------------------------------------------
    def _count(self, hits: list[bool]) -> None:
        n = sum(hits)
        self.counters["hits"] += n
        self.counters["misses"] += len(hits) - n

    def _touch(self, obj: Obj) -> None:
        self._lru.used(obj)

    def _evict_until(self, ok: Callable[[], bool], reason: str) -> bool:
        """Evict LRU objects until `ok()`, counted as evictions for `reason` (`object_cap`,
        `metadata_budget`); False when it still fails with nothing left to evict."""
        while not ok():
            victim = self._lru.pop_victim()
            if victim is None:
                return False
            self._evict(victim, reason)
        return True

    def _evict(self, victim: Obj, reason: str) -> None:
        self.counters["evictions"] += 1
        self.counters[f"evictions_{reason}"] += 1
        self._hide(victim, "removed")

    def _compact_order(self) -> None:
        """Drop stale entries of the commit-order list once they outnumber the visible objects."""
        objects = self.objects
        self._order.compact(len(objects), lambda o: objects.get((o.ns, o.key)) is o)

    def _alloc_evicting(self, nbytes: int) -> Allocation | None:
        if nbytes > self.alloc.capacity:
            return None
        a = self.alloc.alloc(nbytes)
        while a is None:
            victim = self._lru.pop_victim()
            if victim is None:
                return None
            self._evict(victim, "space")  # region space, for an object or its metadata
            a = self.alloc.alloc(nbytes)
        return a

    def _hide(self, obj: Obj, event: EventType) -> None:
        """Make a committed object invisible; free it now if nobody pins it."""
        self._meta.forget(obj)  # first: a restarted service must not bring it back
        self._lru.discard(obj.oid)
        if self.objects.get((obj.ns, obj.key)) is obj:
            del self.objects[(obj.ns, obj.key)]
            self.object_bytes -= obj.size
            if self.presence is not None:
                self.presence.discard(self.presence.fingerprints.of_object(obj.ns, obj.key))
        self._parts.drop(obj)
        self._emit(event, obj)
        if obj.pins == 0:
            self._free(obj)
        else:
            obj.doomed = True

    def _pin(self, s: Session, obj: Obj) -> bool:
        """Pin `obj` for session `s`; False (and a quota refusal counted) past the session's limits."""
        if not self._sessions.pin(s, obj):
            return False
        if obj.pins == 1:  # its first pin: no longer evictable
            self._lru.discard(obj.oid)
        return True

    def _unpin(self, obj: Obj, count: int) -> None:
        obj.pins -= count
        if obj.pins > 0:
            return
        obj.pins = 0
        if obj.doomed:
            self._free(obj)
        elif obj.committed:
            self._lru.add(obj)  # a read counts as use: most recently used end

    def _free(self, obj: Obj) -> None:
        self._meta.forget(obj)
        if self.live.pop(obj.oid, None) is not None:
            self.alloc.free(obj.alloc)
            if isinstance(obj.meta, Allocation):
                self.alloc.free(obj.meta)
                obj.meta = None
            if obj.committed:
                self.metadata_bytes -= obj.meta_cost

    def _emit(self, kind: EventType, obj: Obj) -> None:
        if self.on_event is not None:
            self.on_event(kind, obj)


def _scope(ns: str | None, prefixes: Sequence[str] | None) -> Callable[[str], bool]:
    """Whether a namespace is `ns` (None: any) and starts with one of `prefixes` (None: any)."""
    if prefixes is None:
        return (lambda _: True) if ns is None else ns.__eq__
    starts = tuple(prefixes)
    seen: dict[str, bool] = {}

    def scope(name: str) -> bool:
        ok = seen.get(name)
        if ok is None:
            ok = seen[name] = (ns is None or name == ns) and name.startswith(starts)
        return ok

    return scope
