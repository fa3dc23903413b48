"""The per-worker view of the pool: which pool objects (and so which vLLM blocks) this worker
has announced to Dynamo at the pool's tier, and the per-block changes that keep Dynamo in step.

* Only objects whose namespace passes the worker's `NamespaceFilter` and whose metadata is
  MaruKVConnector chunk metadata with the worker's block size count.
* Blocks are reference-counted over objects: the TP ranks of one chunk are separate objects
  carrying the same blocks, so a block is announced when its first object appears and
  withdrawn when its last one goes.
* `resync(snapshot)` replaces the view with a snapshot and returns only the difference
  (removals for what is gone, stores for what is new, parents before children).

Not thread-safe: the relay drives it from one event loop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from maru_vllm.events.types import (
    Announcement,
    BlocksRemoved,
    BlocksStored,
    ObjectId,
    PoolChunk,
    PoolEvent,
    PoolObject,
    PoolSnapshot,
)

logger = logging.getLogger(__name__)


def model_namespace_prefix(model: str) -> str:
    """The namespace prefix MaruKVConnector uses for every engine of `model`.

    The connector's namespace is this prefix, `kv:<model base name, 40 chars>:`, followed by the
    digest of the KV layout (`maru_vllm.connector.namespace.KVIdentity.namespace`).
    """
    return f"kv:{model.rstrip('/').rsplit('/', 1)[-1][:40]}:"


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
    def single_namespace(self) -> str | None:
        """The one namespace to request snapshots for, when the filter names exactly one."""
        if len(self.exact) == 1 and not self.prefixes:
            return next(iter(self.exact))
        return None


class PoolView:
    """Announced pool objects of one worker (see module docstring)."""

    def __init__(self, namespaces: NamespaceFilter, block_size: int | None = None) -> None:
        self.namespaces = namespaces
        self.block_size = block_size
        self.objects: dict[ObjectId, PoolChunk] = {}
        self._refs: dict[bytes, int] = {}
        self._warned: set[str] = set()

    # -- queries ---------------------------------------------------------------------------
    @property
    def blocks(self) -> frozenset[bytes]:
        """Block hashes currently announced."""
        return frozenset(self._refs)

    def __len__(self) -> int:
        return len(self.objects)

    def chunk_of(self, obj: PoolObject) -> PoolChunk | None:
        """The blocks of `obj` when it belongs to this worker, else None."""
        if not self.namespaces.accepts(obj.namespace):
            return None
        chunk = PoolChunk.from_meta(obj.meta)
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

    # -- changes ---------------------------------------------------------------------------
    def apply(self, event: PoolEvent) -> list[Announcement]:
        if event.type == "stored":
            return self.stored(event.obj)
        return self.removed(event.obj.oid)

    def stored(self, obj: PoolObject) -> list[Announcement]:
        if obj.oid in self.objects:
            return []
        chunk = self.chunk_of(obj)
        if chunk is None:
            return []
        return self._add(obj.oid, chunk)

    def removed(self, oid: ObjectId) -> list[Announcement]:
        chunk = self.objects.pop(oid, None)
        if chunk is None:
            return []
        gone = []
        for h in chunk.block_hashes:
            n = self._refs.get(h, 0) - 1
            if n <= 0:
                self._refs.pop(h, None)
                gone.append(h)
            else:
                self._refs[h] = n
        return [BlocksRemoved(tuple(gone))] if gone else []

    def resync(self, snapshot: PoolSnapshot | Iterable[PoolObject]) -> list[Announcement]:
        """Make the view equal to `snapshot`; return only the difference."""
        objects = snapshot.objects if isinstance(snapshot, PoolSnapshot) else tuple(snapshot)
        desired: dict[ObjectId, PoolChunk] = {}
        for obj in objects:
            chunk = self.chunk_of(obj)
            if chunk is not None:
                desired[obj.oid] = chunk
        out: list[Announcement] = []
        stale = [oid for oid, chunk in self.objects.items() if desired.get(oid) != chunk]
        stale.sort(key=lambda oid: -self.objects[oid].chunk_index)  # children before parents
        removed: list[bytes] = []
        for oid in stale:
            for a in self.removed(oid):
                assert isinstance(a, BlocksRemoved)
                removed.extend(a.block_hashes)
        if removed:
            out.append(BlocksRemoved(tuple(removed)))
        new = [(oid, chunk) for oid, chunk in desired.items() if oid not in self.objects]
        new.sort(key=lambda item: item[1].chunk_index)  # parents before children
        for oid, chunk in new:
            out.extend(self._add(oid, chunk))
        return out

    def clear(self) -> list[Announcement]:
        """Forget everything; announce the removal of every block."""
        return self.resync(())

    def announce_all(self) -> list[Announcement]:
        """Stores for every announced block (for a subscriber that joined late)."""
        out: list[Announcement] = []
        seen: set[bytes] = set()
        for chunk in sorted(self.objects.values(), key=lambda c: c.chunk_index):
            fresh = [h not in seen for h in chunk.block_hashes]
            seen.update(chunk.block_hashes)
            out.extend(_runs(chunk, fresh))
        return out

    # -- internals -------------------------------------------------------------------------
    def _add(self, oid: ObjectId, chunk: PoolChunk) -> list[Announcement]:
        self.objects[oid] = chunk
        fresh = []
        for h in chunk.block_hashes:
            n = self._refs.get(h, 0)
            self._refs[h] = n + 1
            fresh.append(n == 0)
        return _runs(chunk, fresh)

    def _warn_once(self, namespace: str, why: str) -> None:
        if namespace not in self._warned:
            self._warned.add(namespace)
            logger.warning("pool namespace %r: %s", namespace, why)


def _runs(chunk: PoolChunk, fresh: list[bool]) -> list[Announcement]:
    """BlocksStored for each run of consecutive `fresh` blocks of `chunk`, each chained on its parent."""
    out: list[Announcement] = []
    i = 0
    n = len(chunk.block_hashes)
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
            )
        )
        i = j
    return out
