"""The two orders the pool keeps over its committed objects: use (for eviction) and commit
(for snapshots).

`EvictionOrder` holds exactly the committed objects that nobody pins, least recently used
first, so eviction is O(1) per victim and a pinned or in-flight object can never be chosen.
`CommitOrder` lists committed objects in the order they were committed (their `cseq`), the
cursor snapshots are served by in pages; entries of objects no longer visible stay until they
outnumber the visible ones, then one pass drops them.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Iterator

from maru_vllm.pool.records import Obj


class EvictionOrder:
    """Unpinned committed objects by last use. Not thread-safe: the index's loop owns it."""

    def __init__(self) -> None:
        self._lru: OrderedDict[int, Obj] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, oid: int) -> bool:
        return oid in self._lru

    def used(self, obj: Obj) -> None:
        """`obj` was used: most recently used, if it is in the order at all."""
        if obj.oid in self._lru:
            self._lru.move_to_end(obj.oid)

    def add(self, obj: Obj) -> None:
        """`obj` became evictable (committed, or its last pin went): most recently used."""
        self._lru[obj.oid] = obj

    def discard(self, oid: int) -> None:
        """`oid` is pinned or gone: not evictable."""
        self._lru.pop(oid, None)

    def pop_victim(self) -> Obj | None:
        """Take the least recently used object out of the order; None when it is empty."""
        if not self._lru:
            return None
        return self._lru.popitem(last=False)[1]

    def most_recent_first(self) -> Iterator[Obj]:
        return iter(reversed(self._lru.values()))


class CommitOrder:
    """Committed objects by commit sequence, stale entries included until `compact`."""

    def __init__(self) -> None:
        self._order: list[Obj] = []

    def append(self, obj: Obj) -> None:
        """`obj` was committed after every object already listed (its cseq is the largest)."""
        self._order.append(obj)

    def compact(self, visible: int, is_visible: Callable[[Obj], bool]) -> None:
        """Drop entries no longer visible once they outnumber the `visible` objects."""
        if len(self._order) > 2 * visible + 1024:
            self._order = [o for o in self._order if is_visible(o)]

    def page(
        self,
        after: int,
        limit: int,
        max_bytes: int,
        max_scan: int,
        keep: Callable[[Obj], bool],
    ) -> tuple[list[Obj], int | None]:
        """Objects committed after cursor `after` that `keep` accepts, in commit order: at most
        `limit`, stopping once their metadata passes `max_bytes` or `max_scan` entries were
        looked at. Returns (objects, the next page's cursor or None when this is the last)."""
        order = self._order
        i = bisect.bisect_right(order, after, key=lambda o: o.cseq)
        out: list[Obj] = []
        nbytes = 0
        end = min(len(order), i + max_scan)
        while i < end and len(out) < limit and nbytes < max_bytes:
            o = order[i]
            i += 1
            if keep(o):
                out.append(o)
                # its JSON size, roughly: key as hex, (binary) metadata as base64
                nbytes += o.meta_len * 4 // 3 + 4 + 2 * len(o.key) + len(o.ns) + 64
        return out, (order[i - 1].cseq if i < len(order) else None)
