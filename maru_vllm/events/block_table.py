"""A compact counted set of 64-bit keys: what a relay keeps per pool block and per pool object.

A relay following a pool of 10^6 chunks holds ~4x10^6 block keys. As a Python `dict[int, int]`
that costs ~85 B per key (the int objects, the dict's slots); here a key costs ~20 B: one
open-addressing table (linear probing) of uint64 keys beside uint16 counts, in two `array`s that
numpy views without copying. Single keys (live pool events) are counted with plain Python
indexing; whole pages (a resync) in a few vectorised passes.

Contract:

* Keys are uniformly distributed 64-bit values (block hashes, object-id digests); the table
  uses their low bits as the home slot. Key 0 marks an empty slot, so 0 is stored as 1 (callers
  hash their keys already; `key_of` does the mapping).
* A count saturates at `MAX_COUNT` and is then never decremented (a key held by more than 65,535
  objects stays announced until the next rebuild from a snapshot).
* A key whose count drops to 0 keeps its slot ("dead") until the table is rebuilt, which happens
  when live + dead slots pass `MAX_LOAD` of the capacity; re-adding a dead key reuses its slot.

Not thread-safe.
"""

from __future__ import annotations

import array

import numpy as np

MAX_COUNT = 0xFFFF
MAX_LOAD = 0.7
_MIN_CAPACITY = 1 << 10


def key_of(value: int) -> int:
    """`value` (a 64-bit hash) as a table key: never 0 (the empty-slot marker)."""
    return value or 1


def _capacity_for(n: int) -> int:
    """The smallest power-of-two capacity that holds `n` keys at a load of at most 0.55."""
    cap = _MIN_CAPACITY
    while cap * 0.55 < n:
        cap <<= 1
    return cap


class CountedKeys:
    """A multiset of 64-bit keys with counts (see module docstring)."""

    def __init__(self, expected: int = 0) -> None:
        self._alloc(_capacity_for(expected))
        self.live = 0  # keys with a count > 0

    def _alloc(self, cap: int) -> None:
        self._keys = array.array("Q", bytes(8 * cap))
        self._counts = array.array("H", bytes(2 * cap))
        self._nk = np.frombuffer(self._keys, dtype=np.uint64)
        self._nc = np.frombuffer(self._counts, dtype=np.uint16)
        self._mask = cap - 1
        self._used = 0  # occupied slots, live or dead

    @property
    def capacity(self) -> int:
        return self._mask + 1

    @property
    def nbytes(self) -> int:
        """Bytes the table's arrays take."""
        return 10 * self.capacity

    def __len__(self) -> int:
        return self.live

    def __contains__(self, key: int) -> bool:
        return self.count(key) > 0

    def count(self, key: int) -> int:
        keys, mask = self._keys, self._mask
        i = key & mask
        while True:
            k = keys[i]
            if k == key:
                return self._counts[i]
            if k == 0:
                return 0
            i = (i + 1) & mask

    def add(self, key: int) -> int:
        """Count `key` once more; returns its count before."""
        keys, mask = self._keys, self._mask
        i = key & mask
        while True:
            k = keys[i]
            if k == key:
                c = self._counts[i]
                if c < MAX_COUNT:
                    self._counts[i] = c + 1
                if c == 0:
                    self.live += 1
                return c
            if k == 0:
                keys[i] = key
                self._counts[i] = 1
                self._used += 1
                self.live += 1
                if self._used > MAX_LOAD * self.capacity:
                    self._rebuild(self.live)
                return 0
            i = (i + 1) & mask

    def remove(self, key: int) -> int:
        """Count `key` once less; returns its count after (-1: it was not there)."""
        keys, mask = self._keys, self._mask
        i = key & mask
        while True:
            k = keys[i]
            if k == key:
                c = self._counts[i]
                if c == 0:
                    return -1
                if c == MAX_COUNT:
                    return c  # saturated: sticky
                self._counts[i] = c - 1
                if c == 1:
                    self.live -= 1
                return c - 1
            if k == 0:
                return -1
            i = (i + 1) & mask

    def keys(self) -> np.ndarray:
        """Every key with a count > 0 (a copy, in table order)."""
        return self._nk[self._nc > 0].copy()

    # -- vectorised ------------------------------------------------------------------------
    def add_many(self, keys: np.ndarray) -> np.ndarray:
        """Count each of `keys` (uint64, in order) once more; returns, per element, the key's
        count before that element (so 0 marks the first occurrence of a key the table lacked)."""
        n = len(keys)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        uniq, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        if (self._used + len(uniq)) > MAX_LOAD * self.capacity:
            self._rebuild(self.live + len(uniq))
        before = self._bump(uniq, counts)
        if len(uniq) == n:
            return before[inverse]
        # earlier occurrences of the same key within `keys`
        order = np.argsort(inverse, kind="stable")
        starts = np.cumsum(counts) - counts
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n, dtype=np.int64) - np.repeat(starts, counts)
        return before[inverse] + rank

    def counts_of(self, keys: np.ndarray) -> np.ndarray:
        """The count of each of `keys` (uint64), 0 where absent."""
        out = np.zeros(len(keys), dtype=np.int64)
        if self.live == 0:  # e.g. a fresh relay's announced set during its first resync
            return out
        slots = self._find(keys)
        found = slots >= 0
        out[found] = self._nc[slots[found]]
        return out

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key, -1 where it has none."""
        nk, mask = self._nk, np.uint64(self._mask)
        slots = (keys & mask).astype(np.int64)
        out = np.full(len(keys), -1, dtype=np.int64)
        pending = np.arange(len(keys))
        while pending.size:
            s = slots[pending]
            cur = nk[s]
            hit = cur == keys[pending]
            out[pending[hit]] = s[hit]
            go_on = ~hit & (cur != 0)
            pending = pending[go_on]
            slots[pending] = (s[go_on] + 1) & self._mask
        return out

    def _bump(self, uniq: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Add `counts` to the distinct keys `uniq`; their counts before."""
        nk, nc, mask = self._nk, self._nc, self._mask
        slots = (uniq & np.uint64(mask)).astype(np.int64)
        before = np.zeros(len(uniq), dtype=np.int64)
        pending = np.arange(len(uniq))
        placed = 0
        while pending.size:
            s = slots[pending]
            cur = nk[s]
            hit = cur == uniq[pending]
            if hit.any():  # distinct keys: their slots are distinct too
                idx, hs = pending[hit], s[hit]
                before[idx] = nc[hs]
                nc[hs] = np.minimum(nc[hs].astype(np.int64) + counts[idx], MAX_COUNT)
            empty = cur == 0
            done = hit.copy()
            if empty.any():
                e_pos = np.flatnonzero(empty)
                es, ew = s[e_pos], uniq[pending[e_pos]]
                nk[es] = ew  # several new keys may want one empty slot: one write wins, the rest retry
                won = nk[es] == ew
                win = e_pos[won]
                w_idx, ws = pending[win], es[won]
                nc[ws] = np.minimum(counts[w_idx], MAX_COUNT)
                placed += len(win)
                done[win] = True
            advance = ~hit & ~empty  # slot taken by another key: probe on (losers retry the slot)
            slots[pending[advance]] = (s[advance] + 1) & mask
            pending = pending[~done]
        self._used += placed
        self.live += int(np.count_nonzero(before == 0))
        return before

    def _rebuild(self, expected_live: int) -> None:
        """Re-insert the live keys into a table sized for `expected_live` (dead slots go)."""
        live = self._nc > 0
        keys, counts = self._nk[live].copy(), self._nc[live].astype(np.int64)
        self._alloc(_capacity_for(max(expected_live, len(keys))))
        self.live = 0
        self._bump(keys, counts)
