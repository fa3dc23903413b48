"""What the second tier holds, as this pool knows it: a bounded map of object keys to their size there.

A pool learns the tier's keys from its own write-through (an object it put) and from the other
pools' announcements over NATS (`tier2.announce`), so a scheduler lookup that misses the local
pool can tell, from the presence table's hints, without asking anyone, that another domain's
chunks are in the tier. The map is a hint like every lookup: the tier evicts on its own (its
high watermark) and forgets everything when its master restarts, without telling anyone, so an
entry may be stale; a fetch that misses drops it (`discard`). It keeps at most `max_entries`
keys, forgetting the least recently announced or fetched first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class Tier2Directory:
    def __init__(self, max_entries: int = 262_144) -> None:
        if max_entries < 1:
            raise ValueError(f"a tier-2 directory needs room for at least one key, got {max_entries}")
        self.max_entries = max_entries
        # (namespace, key) -> (payload bytes, bytes in the tier)
        self._entries: OrderedDict[tuple[str, bytes], tuple[int, int]] = OrderedDict()
        self.forgotten = 0  # entries dropped to stay within max_entries

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item: tuple[str, bytes]) -> bool:
        return item in self._entries

    def entry(self, ns: str, key: bytes) -> tuple[int, int] | None:
        """(payload bytes, bytes in the tier) of a known object, or None."""
        return self._entries.get((ns, key))

    def add(self, ns: str, key: bytes, size: int, tier_size: int) -> list[tuple[str, bytes]]:
        """Record the object (as most recent); returns the entries forgotten to make room."""
        item = (ns, key)
        self._entries[item] = (size, tier_size)
        self._entries.move_to_end(item)
        dropped = []
        while len(self._entries) > self.max_entries:
            old, _ = self._entries.popitem(last=False)
            dropped.append(old)
            self.forgotten += 1
        return dropped

    def touch(self, ns: str, key: bytes) -> None:
        if (ns, key) in self._entries:
            self._entries.move_to_end((ns, key))

    def discard(self, ns: str, key: bytes) -> bool:
        return self._entries.pop((ns, key), None) is not None

    def clear(self) -> list[tuple[str, bytes]]:
        items = list(self._entries)
        self._entries.clear()
        return items

    def items(self) -> Iterator[tuple[tuple[str, bytes], tuple[int, int]]]:
        """Oldest first (a copy: the caller may change the directory while it iterates)."""
        return iter(list(self._entries.items()))

    def recent(self, n: int) -> list[tuple[tuple[str, bytes], tuple[int, int]]]:
        """The `n` most recent entries, newest first."""
        out: list[tuple[tuple[str, bytes], tuple[int, int]]] = []
        for item in reversed(self._entries):
            if len(out) >= n:
                break
            out.append((item, self._entries[item]))
        return out
