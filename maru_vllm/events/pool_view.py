"""The per-worker view of the pool: which pool objects (and so which vLLM blocks) this worker
has announced to Dynamo at the pool's tier, and the per-block changes that keep Dynamo in step.

* Only objects whose namespace passes the worker's `NamespaceFilter` and whose metadata is
  MaruKVConnector chunk metadata with the worker's block size count.
* Blocks are reference-counted over objects: the TP ranks of one chunk are separate objects
  carrying the same blocks, so a block is announced when its first object appears and
  withdrawn when its last one goes.
* `resync(snapshot)` replaces the view with a snapshot and announces only the difference
  (stores for what is new, parents before children, and removals for what is gone). A snapshot
  may arrive in parts (`PoolSnapshot.part` / `.last`, one per pool page): each part is
  announced as it comes, the removals once the last part is in. A part 0 starts a new resync
  (one left unfinished is dropped; what it announced is withdrawn by the next one unless the
  pool still has it). A `full` snapshot announces every block it holds again, once; a block
  announced before is withdrawn right before its store again. Dynamo 1.6.1's publisher counts
  the stores of each block and passes a removal on only when the count drops to zero, so a
  repeated store alone would make the pool's later removal of that block never reach the router.

A cap (`max_objects` N): the view counts at most N objects. A resync counts the first N objects
its snapshot lists (the relay asks the pool for the N most recently used ones); a live store
past N withdraws the least recently used counted object (`announced_order`: a store also
counts as use of the chain of objects it is chained on; its blocks that no other counted
object holds are announced as removed), and a later pool removal of a withdrawn object
announces nothing. So the router is credited with at most N objects' blocks, and what the
relay and the router hold grows with N, not with the pool. For the withdrawals the view keeps
each counted object's block keys (8 B per block, ~200 B per object in all).

Memory: the view keeps what a removal needs and nothing else - a counted set of block keys (the
64-bit values Dynamo sees) and a set of object-id digests, ~30 B per block in `CountedKeys`
tables. Token ids and metadata are never kept: a store is announced from the event or page
that carries it, a removal from the pool's `removed` event (which carries the object's
metadata), and a re-announcement fetches the blocks again from the pool (a `full` resync).
Object ids are kept as 64-bit digests: two objects whose ids collide (odds ~10^-8 at 10^6
objects) would share one entry, which can cost a routing credit, never a wrong token (the
connector checks every load).

Not thread-safe: the relay drives it from one event loop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.announced_order import AnnouncedOrder
from maru_vllm.events.block_table import CountedKeys, key_of
from maru_vllm.events.packed_chunks import ChunkColumns, ChunkStores
from maru_vllm.events.types import (
    Announcement,
    BlocksRemoved,
    BlocksStored,
    ExternalHash,
    ObjectId,
    PoolChunk,
    PoolEvent,
    PoolObject,
    PoolSnapshot,
)
from maru_vllm.pool.chunk_codec import model_namespace_prefix
from maru_vllm.pool.messages import BINARY_META_PREFIX

logger = logging.getLogger(__name__)

#: Stores held back within one resync until their parent block is announced (beyond: sent at once).
MAX_DEFERRED = 65536


@dataclasses.dataclass(frozen=True)
class NamespaceFilter:
    """Which pool namespaces belong to this worker: exact names and/or name prefixes.

    With neither, every namespace is accepted.
    """

    exact: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()

    @classmethod
    def for_model(cls, model: str) -> NamespaceFilter:
        return cls(prefixes=(model_namespace_prefix(model),))

    @classmethod
    def exactly(cls, *namespaces: str) -> NamespaceFilter:
        return cls(exact=frozenset(namespaces))

    def accepts(self, namespace: str) -> bool:
        if not self.exact and not self.prefixes:
            return True
        return namespace in self.exact or any(namespace.startswith(p) for p in self.prefixes)

    @property
    def snapshot_prefixes(self) -> tuple[str, ...] | None:
        """Namespace prefixes a snapshot for this filter may be limited to (None: every
        namespace); exact names count as prefixes (a superset: the view filters the rest)."""
        if not self.exact and not self.prefixes:
            return None
        return (*sorted(self.exact), *self.prefixes)

    @property
    def single_namespace(self) -> str | None:
        """The one namespace to request snapshots for, when the filter names exactly one."""
        if len(self.exact) == 1 and not self.prefixes:
            return next(iter(self.exact))
        return None


def object_key(oid: ObjectId) -> int:
    """The 64-bit digest a view keeps for object `oid`."""
    return key_of(xxhash.xxh3_64_intdigest(f"{oid[0]}\0{oid[1]}".encode()))


def _block_key(h: ExternalHash) -> int:
    """The table key of an external block hash (an int already, or vLLM's bytes: the low 64 bits)."""
    return key_of(h if isinstance(h, int) else int.from_bytes(h[-8:], "big"))


@dataclasses.dataclass
class _Resync:
    """One resync in progress: the tables being built from its parts."""

    full: bool
    blocks: CountedKeys
    objects: CountedKeys
    deferred: list[tuple[int, BlocksStored]] = dataclasses.field(default_factory=list)
    order: AnnouncedOrder = dataclasses.field(default_factory=AnnouncedOrder)  # with a cap


class PoolView:
    """Announced pool objects of one worker (see module docstring)."""

    def __init__(
        self,
        namespaces: NamespaceFilter,
        block_size: int | None = None,
        int_hashes: bool | None = None,
        max_objects: int | None = None,
    ) -> None:
        """`int_hashes`: block hashes are announced as ints (default: as vLLM's environment says);
        `max_objects`: the cap (see module docstring; None: every object of this worker)."""
        if max_objects is not None and max_objects < 1:
            raise ValueError(f"max_objects={max_objects}: must be >= 1 (or None: no cap)")
        self.max_objects = max_objects
        self.cap_withdrawals = 0  # objects withdrawn to stay within the cap since the last resync
        self._order = AnnouncedOrder()  # with a cap: counted objects in use order
        self.namespaces = namespaces
        self.block_size = block_size
        self.int_hashes = vf.int_block_hashes() if int_hashes is None else int_hashes
        self._blocks = CountedKeys()  # announced block keys, counted over objects
        self._objects = CountedKeys()  # object-id digests of the objects counted
        self._raw: dict[int, bytes] = {}  # key -> vLLM's bytes hash, only when vLLM announces bytes
        self._resync: _Resync | None = None
        self._warned: set[str] = set()
        self._accepts: dict[str, bool] = {}  # namespace -> accepted (cached: a resync asks per object)

    # -- queries ---------------------------------------------------------------------------
    @property
    def blocks(self) -> frozenset[ExternalHash]:
        """External block hashes currently announced (a copy; for tests and logs)."""
        return frozenset(self._external(k) for k in self._blocks.keys().tolist())

    @property
    def block_count(self) -> int:
        return len(self._blocks)

    @property
    def resyncing(self) -> bool:
        """A snapshot's parts are coming in (what they announce is not counted in `block_count` yet)."""
        return self._resync is not None

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, oid: ObjectId) -> bool:
        return object_key(oid) in self._objects

    @property
    def nbytes(self) -> int:
        """Bytes of the view's tables (what a relay's memory grows by per pool object)."""
        return self._blocks.nbytes + self._objects.nbytes

    def chunk_of(self, obj: PoolObject) -> PoolChunk | None:
        """The blocks of `obj` when it belongs to this worker, else None."""
        return self.chunks_of([obj])[0]

    def chunks_of(self, objects: Sequence[PoolObject]) -> list[PoolChunk | None]:
        """`chunk_of` each of `objects` (parsed together: a snapshot page)."""
        mine = [o for o in objects if self.namespaces.accepts(o.namespace)]
        parsed = iter(PoolChunk.many_from_meta([o.meta for o in mine], self.int_hashes))
        return [self._checked(o, next(parsed)) if self.namespaces.accepts(o.namespace) else None for o in objects]

    def _checked(self, obj: PoolObject, chunk: PoolChunk | None) -> PoolChunk | None:
        if chunk is None:
            self._warn_once(obj.namespace, "objects without MaruKVConnector chunk metadata are not announced")
            return None
        if self.block_size is not None and chunk.block_size != self.block_size:
            self._warn_once(
                obj.namespace,
                f"chunks of block size {chunk.block_size} do not match this "
                f"engine's block size {self.block_size}; not announced",
            )
            return None
        return chunk

    # -- live changes ----------------------------------------------------------------------
    def apply(self, event: PoolEvent) -> list[Announcement]:
        if event.type == "stored":
            return self.stored(event.obj)
        return self.removed(event.obj)

    def stored(self, obj: PoolObject) -> list[Announcement]:
        chunk = self.chunk_of(obj)
        if chunk is None:
            return []
        okey = object_key(obj.oid)
        if okey in self._objects:
            return []  # a repeated stored event
        self._objects.add(okey)
        self._remember_raw(chunk)
        keys = [_block_key(h) for h in chunk.block_hashes]
        fresh = [self._blocks.add(k) == 0 for k in keys]
        out: list[Announcement] = list(stored_runs(chunk, fresh))
        if self.max_objects is not None:
            parent = 0 if chunk.parent_block_hash is None else _block_key(chunk.parent_block_hash)
            self._order.touch_chain(parent)  # the prefix this store is chained on was just used
            self._order.add(okey, parent, np.asarray(keys, dtype=np.uint64))
            while len(self._order) > self.max_objects:
                out.extend(self._withdraw_oldest())
        return out

    def _withdraw_oldest(self) -> list[Announcement]:
        """Uncount the least recently used object (the cap); the removal of its last-held blocks."""
        okey, blocks = self._order.pop_oldest()
        self._objects.remove(okey)
        self.cap_withdrawals += 1
        gone = [k for k in blocks.tolist() if self._blocks.remove(k) == 0]
        removed = tuple(self._external(k) for k in gone)
        for k in gone:
            self._raw.pop(k, None)
        return [BlocksRemoved(removed)] if removed else []

    def removed(self, obj: PoolObject) -> list[Announcement]:
        """Withdraw `obj` (as a `removed` event carries it: with its metadata)."""
        okey = object_key(obj.oid)
        if self._objects.remove(okey) < 0:
            return []  # never counted, or withdrawn for the cap already
        self._order.discard(okey)
        chunk = self.chunk_of(obj)
        if chunk is None:  # cannot happen for an object we counted (its metadata does not change)
            return []
        gone = [h for h in chunk.block_hashes if self._blocks.remove(_block_key(h)) == 0]
        return [BlocksRemoved(tuple(gone))] if gone else []

    # -- snapshots -------------------------------------------------------------------------
    def resync(self, snapshot: PoolSnapshot | Iterable[PoolObject]) -> list[Announcement | ChunkStores]:
        """Apply one snapshot part (a whole snapshot when it is not a `PoolSnapshot` or has one part)."""
        if not isinstance(snapshot, PoolSnapshot):
            snapshot = PoolSnapshot("", "", 0, tuple(snapshot))
        if snapshot.part == 0 or self._resync is None:
            self._begin(snapshot)
        out = self._resync_part(snapshot.objects)
        if snapshot.last:
            removed, deferred = self._end()
            out = [*removed, *out, *deferred]
        return out

    def clear(self) -> list[Announcement | ChunkStores]:
        """Forget everything; announce the removal of every block."""
        return self.resync(())

    def _begin(self, first: PoolSnapshot) -> None:
        if self._resync is not None:
            # an unfinished resync: what it announced counts as announced, so the next one's
            # removals withdraw it when the pool no longer has it
            keys = self._resync.blocks.keys()
            self._blocks.add_many(keys[self._blocks.counts_of(keys) == 0])
        expected = first.total or 0
        if self.max_objects is not None:
            expected = min(expected, self.max_objects)
        sample = (self.chunk_of(o) for o in first.objects[:64])
        blocks_per_object = max((len(c.block_hashes) for c in sample if c is not None), default=1)
        self._resync = _Resync(first.full, CountedKeys(expected * blocks_per_object), CountedKeys(expected))

    def _resync_part(self, objects: Sequence[PoolObject]) -> list[Announcement | ChunkStores]:
        """Count a part's objects in the resync; the stores of what is new (parents first)."""
        out: list[Announcement | ChunkStores] = []
        if self.int_hashes:
            accepts = self._accepts
            binary = [
                i
                for i, o in enumerate(objects)
                if type(o.meta) is bytes
                and o.meta[:3] == BINARY_META_PREFIX
                and (accepts[o.namespace] if o.namespace in accepts else self._accept(o.namespace))
            ]
            cols = ChunkColumns.of([objects[i].meta for i in binary], self.block_size) if binary else None
            if cols is not None:
                taken = np.zeros(len(objects), dtype=bool)
                taken[np.asarray(binary, dtype=np.int64)[cols.rows]] = True
                okeys = np.fromiter(
                    (object_key(objects[binary[r]].oid) for r in cols.rows.tolist()), dtype=np.uint64, count=len(cols)
                )
                out.extend(self._resync_columns(cols, okeys))
                objects = [o for o, t in zip(objects, taken.tolist()) if not t]
        out.extend(self._resync_objects(objects))
        return out

    def _resync_columns(self, cols: ChunkColumns, okeys: np.ndarray) -> list[Announcement | ChunkStores]:
        """`_resync_objects` for chunks read as columns: whole-chunk stores stay columns."""
        rs = self._resync
        assert rs is not None
        if self.max_objects is not None:  # the cap: only as many new objects as there is room for
            unseen = np.flatnonzero(rs.objects.counts_of(okeys) == 0)[: max(0, self.max_objects - len(rs.order))]
            cols, okeys = cols.take(unseen), okeys[unseen]
        new = np.flatnonzero(rs.objects.add_many(okeys) == 0)
        new = new[np.argsort(cols.chunk_index[new], kind="stable")]
        cols, okeys = cols.take(new), okeys[new]
        n, nb = cols.hashes.shape
        if n == 0:
            return []
        keys = cols.hashes.reshape(-1).copy()
        keys[keys == 0] = 1  # block_table.key_of
        if self.max_objects is not None:
            rows = keys.reshape(n, nb)
            parents = np.where(cols.has_parent, np.where(cols.parent == 0, 1, cols.parent), 0).tolist()
            for i, k in enumerate(okeys.tolist()):
                rs.order.add(k, parents[i], rows[i])
        fresh = rs.blocks.add_many(keys) == 0  # first time this resync sees the block
        again = self._withdrawn_before_store(keys, fresh) if rs.full else []
        if not rs.full:
            fresh &= self._blocks.counts_of(keys) == 0  # ... and not announced before it
        fresh = fresh.reshape(n, nb)
        pkeys = cols.parent.copy()
        pkeys[pkeys == 0] = 1
        orphan = cols.has_parent & fresh[:, 0]
        orphan &= (rs.blocks.counts_of(pkeys) == 0) & (self._blocks.counts_of(pkeys) == 0)
        # kinds, in chunk order: 0 whole & no parent, 1 whole & parent, 2 partly new or held back, 3 nothing new
        kind = np.where(fresh.all(axis=1), cols.has_parent.astype(np.int8), np.int8(2))
        kind[~fresh.any(axis=1)] = 3
        kind[orphan] = 2
        out: list[Announcement | ChunkStores] = list(again)
        bounds = np.flatnonzero(np.diff(kind)) + 1
        for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), n]):
            k = int(kind[lo])
            if k in (0, 1):
                out.append(ChunkStores(cols.take(slice(lo, hi))))
            elif k == 2:
                for i in range(lo, hi):
                    chunk = PoolChunk(
                        tuple(cols.hashes[i].tolist()),
                        int(cols.parent[i]) if cols.has_parent[i] else None,
                        cols.tokens[i],
                        cols.block_size,
                        None,
                        int(cols.chunk_index[i]),
                    )
                    out.extend(self._held_back(rs, chunk, stored_runs(chunk, fresh[i].tolist())))
        return out

    def _withdrawn_before_store(self, keys: np.ndarray, fresh: np.ndarray) -> list[Announcement]:
        """A full resync's removal of the `fresh` blocks of `keys` announced before it, sent just
        before their stores again: each block is then stored once more than it was removed, as
        Dynamo's publisher counts them (see module docstring)."""
        before = keys[fresh & (self._blocks.counts_of(keys) > 0)]
        return [BlocksRemoved(tuple(self._external(k) for k in before.tolist()))] if len(before) else []

    def _held_back(self, rs: _Resync, c: PoolChunk, runs: list[BlocksStored]) -> list[Announcement]:
        """`runs` of chunk `c`, unless its parent is in no page seen so far: then they are held
        until the parent comes (at most MAX_DEFERRED; beyond, sent at once)."""
        if runs and runs[0].parent_block_hash is not None and len(rs.deferred) < MAX_DEFERRED:
            parent = _block_key(runs[0].parent_block_hash)
            if rs.blocks.count(parent) == 0 and self._blocks.count(parent) == 0:
                rs.deferred.extend((c.chunk_index, r) for r in runs)
                return []
        return list(runs)

    def _resync_objects(self, objects: Sequence[PoolObject]) -> list[Announcement]:
        rs = self._resync
        assert rs is not None
        accepted = [(o, c) for o, c in zip(objects, self.chunks_of(objects)) if c is not None]
        if not accepted:
            return []
        okeys = np.fromiter((object_key(o.oid) for o, _ in accepted), dtype=np.uint64, count=len(accepted))
        if self.max_objects is not None:  # the cap: only as many new objects as there is room for
            unseen = np.flatnonzero(rs.objects.counts_of(okeys) == 0)[: max(0, self.max_objects - len(rs.order))]
            accepted, okeys = [accepted[i] for i in unseen.tolist()], okeys[unseen]
        new_object = rs.objects.add_many(okeys) == 0
        kept = sorted(
            ((k, c) for (_, c), k, new in zip(accepted, okeys.tolist(), new_object) if new),
            key=lambda kc: kc[1].chunk_index,
        )
        chunks = [c for _, c in kept]
        for c in chunks:
            self._remember_raw(c)
        sizes = [len(c.block_hashes) for c in chunks]
        keys = np.fromiter((_block_key(h) for c in chunks for h in c.block_hashes), dtype=np.uint64, count=sum(sizes))
        if self.max_objects is not None:
            bounds = np.cumsum([0, *sizes])
            for i, (k, c) in enumerate(kept):
                parent = 0 if c.parent_block_hash is None else _block_key(c.parent_block_hash)
                rs.order.add(k, parent, keys[bounds[i] : bounds[i + 1]])
        fresh = rs.blocks.add_many(keys) == 0  # first time this resync sees the block
        out: list[Announcement] = self._withdrawn_before_store(keys, fresh) if rs.full else []
        if not rs.full:
            fresh &= self._blocks.counts_of(keys) == 0  # ... and not announced before it
        fresh_list = fresh.tolist()
        i = 0
        for c, n in zip(chunks, sizes):
            out.extend(self._held_back(rs, c, stored_runs(c, fresh_list[i : i + n])))
            i += n
        return out

    def _end(self) -> tuple[list[Announcement], list[Announcement]]:
        """(removals of what the snapshot no longer has, the stores held back for their parents)."""
        rs = self._resync
        assert rs is not None
        self._resync = None
        deferred: list[Announcement] = [r for _, r in sorted(rs.deferred, key=lambda d: d[0])]
        old = self._blocks.keys()
        gone = old[rs.blocks.counts_of(old) == 0].tolist()
        removed: list[Announcement] = [BlocksRemoved(tuple(self._external(k) for k in gone))] if gone else []
        for k in gone:
            self._raw.pop(k, None)
        self._blocks, self._objects, self._order = rs.blocks, rs.objects, rs.order
        self.cap_withdrawals = 0
        return removed, deferred

    # -- internals -------------------------------------------------------------------------
    def _remember_raw(self, chunk: PoolChunk) -> None:
        for h in chunk.block_hashes:
            if not isinstance(h, int):
                self._raw[_block_key(h)] = h

    def _external(self, key: int) -> ExternalHash:
        return self._raw.get(key, key)

    def _accept(self, namespace: str) -> bool:
        if len(self._accepts) >= 4096:
            self._accepts.clear()
        ok = self._accepts[namespace] = self.namespaces.accepts(namespace)
        return ok

    def _warn_once(self, namespace: str, why: str) -> None:
        if namespace not in self._warned:
            self._warned.add(namespace)
            logger.warning("pool namespace %r: %s", namespace, why)


def stored_runs(chunk: PoolChunk, fresh: list[bool]) -> list[BlocksStored]:
    """BlocksStored for each run of consecutive `fresh` blocks of `chunk`, each chained on its parent."""
    out: list[BlocksStored] = []
    n = len(chunk.block_hashes)
    i = 0
    while i < n:
        if not fresh[i]:
            i += 1
            continue
        j = i
        while j < n and fresh[j]:
            j += 1
        out.append(
            BlocksStored(
                block_hashes=chunk.block_hashes[i:j],
                parent_block_hash=chunk.parent_of(i),
                token_ids=chunk.tokens_of(i, j),
                block_size=chunk.block_size,
                lora_name=chunk.lora_name,
                cache_salt=chunk.cache_salt,
            )
        )
        i = j
    return out
