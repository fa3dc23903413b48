"""Encoded snapshot pages, shared by every reader that asks for the same page of an unchanged pool.

When the W workers of a host start together (a node restart, a rollout), their W event relays
each read the pool's whole snapshot, page by page, from the same cursors: without sharing, the
pool service scans its index, reads every object's metadata from the region and encodes it W
times, on the one event loop that also serves the engines' loads and stores. `SharedPages`
keeps the last pages encoded, keyed by what determines their bytes (encoding, namespace, cursor,
page size), and answers a repeated request with the same bytes.

A page's bytes depend only on which objects are visible, and every change to that (a commit, a
removal, an eviction) is an event and moves the service's event sequence. So an entry is valid
exactly while the sequence is the one it was encoded at: the first request after a change
empties the cache. Pages listing the N most recently used objects are never shared (their
content also moves with reads, which are no events).

Bounded: at most `max_pages` pages and `max_bytes` bytes, least recently asked for dropped first.
Not thread-safe (the service's event loop owns it).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

#: pages kept: relays that start together stay within a few pages of each other
DEFAULT_MAX_PAGES = 32
#: bytes kept (a page stops growing past 4 MiB of object JSON; packed pages are smaller)
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class SharedPages:
    """Encoded pages by request key, valid while the event sequence stays put (module docstring)."""

    def __init__(self, max_pages: int = DEFAULT_MAX_PAGES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_pages = max_pages
        self.max_bytes = max_bytes
        self._pages: collections.OrderedDict[Hashable, bytes] = collections.OrderedDict()
        self._seq: int | None = None  # the event sequence every kept page was encoded at
        self._bytes = 0
        self.hits = 0  # requests answered with a kept page

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: Hashable, seq: int) -> bytes | None:
        """The page encoded for `key` at event sequence `seq`, or None."""
        if seq != self._seq:
            self.clear()
            self._seq = seq
        page = self._pages.get(key)
        if page is None:
            return None
        self._pages.move_to_end(key)
        self.hits += 1
        return page

    def put(self, key: Hashable, seq: int, page: bytes) -> None:
        """Keep `page` as `key`'s at `seq` (not kept when larger than the whole budget)."""
        if seq != self._seq:
            self.clear()
            self._seq = seq
        if len(page) > self.max_bytes:
            return
        old = self._pages.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        self._pages[key] = page
        self._bytes += len(page)
        while len(self._pages) > self.max_pages or self._bytes > self.max_bytes:
            _, dropped = self._pages.popitem(last=False)
            self._bytes -= len(dropped)

    def clear(self) -> None:
        self._pages.clear()
        self._bytes = 0
