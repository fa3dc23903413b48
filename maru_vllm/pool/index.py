"""The pool's metadata state machine: objects, LRU, pins, reservations and sessions.

Pure in-memory logic with no I/O, so it is unit-testable and the service stays a thin shell.
Object life cycle::

    reserve -> RESERVED (owned by one session, invisible, never evictable)
        commit  -> COMMITTED (visible; in the LRU while nobody pins it)
        abort / session gone -> freed
    COMMITTED -> evicted (LRU, unpinned only) or doomed (a reader found it corrupt: hidden at
                 once, freed when the last pin goes)

Only unpinned committed objects are in the LRU, so eviction is O(1) per victim and pinned or
in-flight objects can never be chosen.

Quotas (`SessionLimits`) keep one session from starving the others: the bytes it holds in
uncommitted reservations and the bytes of distinct objects it pins are capped, and so is the
number of pins on one object. Past a limit a reservation is None (the writer skips the store)
and an acquire is None (the reader misses and recomputes); both count in `quota_refusals`.

Parts: a commit may name an object's leading parts (`parts[i]` is a key for its first i + 1
units, e.g. KV blocks of a chunk), so a reader can find and use the start of an object whose
whole key it does not share. The part index holds at most MAX_PARTS entries per committed
object and drops them when the object is hidden (evicted, removed, found corrupt).

Memory: the index's own memory is bounded, not only the region. Every live object counts
against `max_objects` and every committed object's metadata (its stored bytes, its key and part
keys) against `metadata_budget` bytes. Like region space, both are reclaimed by evicting LRU
objects; when nothing evictable is left a reserve (object cap) or a commit (metadata budget, or
no region space for the metadata) is refused, which the connector treats as a skipped store.
Metadata is kept as the bytes it arrives as (JSON, or binary chunk metadata), and with a
`MetaIO` (the service's region) not in the index's memory at all: each object's metadata is
written into a region block of its own, beside the payloads (`[u32 length][u32 checksum][bytes]`),
and read back from there for events and snapshots; a block whose checksum no longer matches
reads as no metadata (the object is then not announced), never as other metadata. Snapshots are
served in pages in commit order (`snapshot_page`), so neither a snapshot nor `stats` ever walks
or copies the whole set at once.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from maru_vllm.pool.allocator import Allocation, Allocator
from maru_vllm.pool.catalog import NO_META, Catalog, Identity, encode_record, record_bytes
from maru_vllm.pool.messages import EventType, ObjectInfo
from maru_vllm.pool.objects import OBJ_HEADER_SIZE
from maru_vllm.pool.presence import PresenceTable, write_units
from maru_vllm.pool.protocol import MAX_PARTS
from maru_vllm.pool.records import META_HEADER, MetaIO, Obj, Session, SessionLimits

logger = logging.getLogger(__name__)

DEFAULT_MAX_OBJECTS = 2_000_000
DEFAULT_METADATA_BUDGET = 1 << 30
OID_STEP = 1 << 16  # the oid floor in the region header moves up in steps of this many oids


EventSink = Callable[[EventType, Obj], None]


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
        self.meta_io = meta_io
        self.presence = presence
        self.catalog = catalog if meta_io is not None else None
        self.on_oid_floor = on_oid_floor
        self._oid_floor = 0
        self.limits = limits or SessionLimits()
        self.data_offset = data_offset
        self.on_event = on_event
        self.max_objects = max_objects
        self.metadata_budget = metadata_budget
        self.metadata_bytes = 0  # sum of meta_cost over committed (visible or doomed) objects
        self.object_bytes = 0  # payload bytes of visible objects
        self._order: list[Obj] = []  # committed objects in commit order (with stale entries)
        self._next_cseq = 1
        self.objects: dict[tuple[str, bytes], Obj] = {}
        self.live: dict[int, Obj] = {}  # every allocated object by oid (reserved, committed, doomed)
        self.lru: OrderedDict[int, Obj] = OrderedDict()
        # (ns, part key) -> the committed objects naming it, oldest first: {oid: (obj, units)}
        self.parts: dict[tuple[str, bytes], dict[int, tuple[Obj, int]]] = {}
        self.sessions: dict[int, Session] = {}
        self._next_oid = 1
        self._next_sid = 1
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "hits",
                "misses",
                "stores",
                "duplicate_commits",
                "evictions",
                "corrupt_reads",
                "reserve_failures",
                "reserve_existing",
                "aborts",
                "sessions_expired",
                "quota_refusals",
                "object_cap_refusals",
                "metadata_budget_refusals",
                "metadata_space_refusals",
                "metadata_unreadable",
            ),
            0,
        )

    # -- sessions ---------------------------------------------------------------------------
    def open_session(self, client: str = "") -> int:
        sid = self._next_sid
        self._next_sid += 1
        self.sessions[sid] = Session(sid, client, time.monotonic())
        return sid

    def touch_session(self, sid: int) -> None:
        self.sessions[sid].last_seen = time.monotonic()

    def close_session(self, sid: int) -> tuple[int, int]:
        """Drop a session: free its reservations, drop its pins. Returns (reservations, pins)."""
        s = self.sessions.pop(sid, None)
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
        deadline = time.monotonic() - lease_s
        return [sid for sid, s in self.sessions.items() if s.last_seen < deadline]

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

    def _part(self, ns: str, key: bytes) -> tuple[Obj, int] | None:
        """The most recently committed object naming `key` as a part, and the units it names."""
        holders = self.parts.get((ns, key))
        if not holders:
            return None
        return holders[next(reversed(holders))]

    def lookup_parts(self, ns: str, keys: Sequence[bytes]) -> list[int]:
        """For each key, how many leading units of a committed object it names (0: none)."""
        out = []
        for k in keys:
            found = self._part(ns, k)
            if found is None:
                out.append(0)
                continue
            self._touch(found[0])
            out.append(found[1])
        return out

    def acquire_parts(self, sid: int, ns: str, keys: Sequence[bytes]) -> list[tuple[Obj, int] | None]:
        """Pin, for each part key, an object it names; (object, units) or None."""
        s = self.sessions[sid]
        out: list[tuple[Obj, int] | None] = []
        for k in keys:
            found = self._part(ns, k)
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
        s = self.sessions[sid]
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
        s = self.sessions[sid]
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
            held = s.pins.get(oid, 0)
            if held == 0:
                continue
            obj = self.live.get(oid)
            if held == 1:
                del s.pins[oid]
                if obj is not None:
                    s.pinned_bytes -= obj.size
            else:
                s.pins[oid] = held - 1
            if obj is not None:
                self._unpin(obj, 1)
            released += 1
        return released

    # -- writes -----------------------------------------------------------------------------
    def reserve(self, sid: int, ns: str, items: Sequence[tuple[bytes, int]]) -> list[Obj | None]:
        s = self.sessions[sid]
        quota = self.limits.reserve_bytes
        out: list[Obj | None] = []
        for key, size in items:
            if (ns, key) in self.objects:
                self.counters["reserve_existing"] += 1
                out.append(None)
                continue
            if quota is not None and s.reserved_bytes + size > quota:
                self.counters["quota_refusals"] += 1
                out.append(None)
                continue
            if not self._evict_until(lambda: len(self.live) < self.max_objects):
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
            s.reservations[obj.oid] = obj
            s.reserved_bytes += size
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
        s = self.sessions[sid]
        out = []
        for i, (oid, meta) in enumerate(zip(oids, metas)):
            obj = s.reservations.pop(oid, None)
            if obj is None:
                out.append(False)  # not ours, already committed/aborted, or from an old session
                continue
            s.reserved_bytes -= obj.size
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
            if not self._evict_until(lambda: self.metadata_bytes + cost <= self.metadata_budget):  # noqa: B023
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
            if not self._keep_meta(obj, meta):
                self.counters["metadata_space_refusals"] += 1
                self._free(obj)
                out.append(False)
                continue
            obj.committed = True
            self._next_cseq += 1
            self.metadata_bytes += cost
            self.object_bytes += obj.size
            for units, pkey in enumerate(obj.parts, 1):
                self.parts.setdefault((obj.ns, pkey), {})[oid] = (obj, units)
            self.objects[(obj.ns, obj.key)] = obj
            if self.presence is not None:  # obj is now the newest holder of each of its parts
                table = self.presence
                table.put(table.fingerprints.of_object(obj.ns, obj.key))
                for units, tag in enumerate(table.fingerprints.of_parts(obj.ns, obj.parts), 1):
                    table.put(tag, write_units(units))
            self._order.append(obj)
            self._compact_order()
            self.lru[oid] = obj
            self.counters["stores"] += 1
            self._emit("stored", obj)
            out.append(True)
        return out

    def abort(self, sid: int, oids: Sequence[int]) -> int:
        s = self.sessions[sid]
        n = 0
        for oid in oids:
            obj = s.reservations.pop(oid, None)
            if obj is not None:
                s.reserved_bytes -= obj.size
                self._free(obj)
                n += 1
        self.counters["aborts"] += n
        return n

    def _keep_meta(self, obj: Obj, meta: bytes | None) -> bool:
        """Store `meta` for `obj`: in a region block of its own (with `meta_io`), else as it is.
        With a catalog every object gets that block, its record, and a catalog slot naming it."""
        catalog = self.catalog
        if self.meta_io is None or (meta is None and catalog is None):
            obj.meta = meta
            return True
        if catalog is None:
            assert meta is not None
            block = self._alloc_evicting(META_HEADER + len(meta))
            if block is None:
                return False
            self.meta_io.write(self.data_offset + block.offset, meta)
            obj.meta = block
            return True
        meta_len = NO_META if meta is None else len(meta)
        block = self._alloc_evicting(record_bytes(obj.ns, obj.key, obj.parts, meta_len))
        if block is None:
            return False
        at = self.data_offset + block.offset
        self.meta_io.write(at, meta or b"")
        a = obj.alloc
        data = encode_record(
            obj.oid,
            obj.cseq,
            obj.size,
            obj.ns,
            obj.key,
            obj.parts,
            meta_len,
            (a.offset, a.capacity, a.slab.start_page if a.slab is not None else -1),
            (block.offset, block.capacity, block.slab.start_page if block.slab is not None else -1),
        )
        start = at + META_HEADER + max(meta_len, 0)
        self.meta_io.view[start : start + len(data)] = data
        obj.meta = block
        obj.meta_len = meta_len
        obj.slot = catalog.add(block.offset, obj.oid)  # last: the record is complete
        return True

    def meta_of(self, obj: Obj) -> bytes | None:
        """The metadata `obj` was committed with (None: none, or its region block was damaged)."""
        meta = obj.meta
        if not isinstance(meta, Allocation):
            return meta
        if obj.meta_len == NO_META:
            return None
        assert self.meta_io is not None
        got = self.meta_io.read(self.data_offset + meta.offset, obj.meta_len)
        if got is None:
            self.counters["metadata_unreadable"] += 1
            logger.warning("metadata of %s/%s in the region is damaged; served without it", obj.ns, obj.key.hex())
        return got

    # -- recovery ---------------------------------------------------------------------------
    def restore(self, found: Sequence[tuple[Identity, Allocation, Allocation, int]], oid_floor: int = 0) -> None:
        """Make visible again the objects a previous service left in the region (a warm restart;
        `recovery.py` verified them and claimed their blocks): (identity, payload block, record
        block, catalog slot) each, of distinct keys, on a fresh index before any session opens.
        They keep their oids and commit order; LRU order is commit order. New oids start above
        every recovered one and `oid_floor`."""
        top_oid, top_cseq = oid_floor, 0
        parts, live, objects, lru, order = self.parts, self.live, self.objects, self.lru, self._order
        data_offset = self.data_offset
        meta_bytes = object_bytes = 0
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
            lru[oid] = obj
            order.append(obj)
            for units, pkey in enumerate(obj.parts, 1):
                parts.setdefault((ns, pkey), {})[oid] = (obj, units)
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
            fps = self.presence.fingerprints
            tags = [fps.of_object(o.ns, o.key) for o in self.objects.values()]
            named = [0] * len(tags)
            for (ns, pkey), holders in parts.items():
                tags.append(fps.of_part(ns, pkey))
                named.append(write_units(holders[next(reversed(holders))][1]))
            self.presence.put_many(tags, named)
        # a smaller budget than the last service had: the least recently used go, as at a commit
        self._evict_until(lambda: self.metadata_bytes <= self.metadata_budget)

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
        order = self._order
        i = bisect.bisect_right(order, after, key=lambda o: o.cseq)
        out: list[Obj] = []
        nbytes = 0
        end = min(len(order), i + max_scan)
        wanted = self.recently_used(recent, ns, prefixes) if recent > 0 else None
        scope = _scope(ns, prefixes)
        while i < end and len(out) < limit and nbytes < max_bytes:
            o = order[i]
            i += 1
            if wanted is not None and o.oid not in wanted:
                continue
            if scope(o.ns) and self.objects.get((o.ns, o.key)) is o:
                out.append(o)
                # its JSON size, roughly: key as hex, (binary) metadata as base64
                nbytes += o.meta_len * 4 // 3 + 4 + 2 * len(o.key) + len(o.ns) + 64
        return out, (order[i - 1].cseq if i < len(order) else None)

    def recently_used(self, n: int, ns: str | None = None, prefixes: Sequence[str] | None = None) -> set[int]:
        """Oids of the `n` most recently used committed objects (of `ns`, and of namespaces
        starting with one of `prefixes`): those pinned now, then from the most recently used end
        of the LRU order. O(n) plus the pins, plus the objects of other namespaces passed over."""
        out: set[int] = set()
        scope = _scope(ns, prefixes)
        for s in self.sessions.values():
            for oid in s.pins:
                o = self.live.get(oid)
                if len(out) < n and o is not None and o.committed and not o.doomed and scope(o.ns):
                    out.add(oid)
        for oid, o in reversed(self.lru.items()):
            if len(out) >= n:
                break
            if scope(o.ns):
                out.add(oid)
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
        if obj.oid in self.lru:
            self.lru.move_to_end(obj.oid)

    def _evict_until(self, ok: Callable[[], bool]) -> bool:
        """Evict LRU objects until `ok()`; False when it still fails with nothing left to evict."""
        while not ok():
            if not self.lru:
                return False
            _, victim = self.lru.popitem(last=False)
            self.counters["evictions"] += 1
            self._hide(victim, "removed")
        return True

    def _compact_order(self) -> None:
        """Drop stale entries of the commit-order list once they outnumber the visible objects."""
        if len(self._order) > 2 * len(self.objects) + 1024:
            self._order = [o for o in self._order if self.objects.get((o.ns, o.key)) is o]

    def _alloc_evicting(self, nbytes: int) -> Allocation | None:
        if nbytes > self.alloc.capacity:
            return None
        a = self.alloc.alloc(nbytes)
        while a is None and self.lru:
            _, victim = self.lru.popitem(last=False)
            self.counters["evictions"] += 1
            self._hide(victim, "removed")
            a = self.alloc.alloc(nbytes)
        return a

    def _hide(self, obj: Obj, event: EventType) -> None:
        """Make a committed object invisible; free it now if nobody pins it."""
        if obj.slot >= 0:  # first: a restarted service must not bring it back
            assert self.catalog is not None
            self.catalog.drop(obj.slot)
            obj.slot = -1
        self.lru.pop(obj.oid, None)
        if self.objects.get((obj.ns, obj.key)) is obj:
            del self.objects[(obj.ns, obj.key)]
            self.object_bytes -= obj.size
            if self.presence is not None:
                self.presence.discard(self.presence.fingerprints.of_object(obj.ns, obj.key))
        self._drop_parts(obj)
        self._emit(event, obj)
        if obj.pins == 0:
            self._free(obj)
        else:
            obj.doomed = True

    def _pin(self, s: Session, obj: Obj) -> bool:
        """Pin `obj` for session `s`; False (and a quota refusal counted) past the session's limits."""
        lim = self.limits
        first = obj.oid not in s.pins
        if (lim.pins_per_object is not None and obj.pins >= lim.pins_per_object) or (
            first and lim.pin_bytes is not None and s.pinned_bytes + obj.size > lim.pin_bytes
        ):
            self.counters["quota_refusals"] += 1
            return False
        if obj.pins == 0:
            self.lru.pop(obj.oid, None)
        obj.pins += 1
        s.pins[obj.oid] = s.pins.get(obj.oid, 0) + 1
        if first:
            s.pinned_bytes += obj.size
        return True

    def _unpin(self, obj: Obj, count: int) -> None:
        obj.pins -= count
        if obj.pins > 0:
            return
        obj.pins = 0
        if obj.doomed:
            self._free(obj)
        elif obj.committed:
            self.lru[obj.oid] = obj  # a read counts as use: most recently used end

    def _free(self, obj: Obj) -> None:
        if obj.slot >= 0:
            assert self.catalog is not None
            self.catalog.drop(obj.slot)
            obj.slot = -1
        if self.live.pop(obj.oid, None) is not None:
            self.alloc.free(obj.alloc)
            if isinstance(obj.meta, Allocation):
                self.alloc.free(obj.meta)
                obj.meta = None
            if obj.committed:
                self.metadata_bytes -= obj.meta_cost

    def _drop_parts(self, obj: Obj) -> None:
        for pkey in obj.parts:
            holders = self.parts.get((obj.ns, pkey))
            if holders is not None:
                holders.pop(obj.oid, None)
                if not holders:
                    del self.parts[(obj.ns, pkey)]
                if self.presence is not None:
                    self._sync_presence_part(obj.ns, pkey)

    def _sync_presence_part(self, ns: str, pkey: bytes) -> None:
        """The presence table's entry for a part key: the units its newest holder names, or none."""
        assert self.presence is not None
        tag = self.presence.fingerprints.of_part(ns, pkey)
        found = self._part(ns, pkey)
        if found is None:
            self.presence.discard(tag)
        else:
            self.presence.put(tag, write_units(found[1]))

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
