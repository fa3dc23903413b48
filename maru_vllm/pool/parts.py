"""The part index: which committed objects name a key as one of their leading parts.

A commit may name an object's leading parts (`parts[i]` is a key for its first i + 1 units,
e.g. KV blocks of a chunk), so a reader can find and use the start of an object whose whole key
it does not share. Several objects may name the same part key; the most recently committed one
answers. With a presence table (`presence.py`) each part key's entry there is kept equal to the
units its newest holder names, or absent when none is left.

Contract: `add` is called once per object when it becomes visible, `drop` once when it stops
being visible (evicted, removed, found corrupt); objects hold at most `protocol.MAX_PARTS` part
keys, so both are O(MAX_PARTS).
"""

from __future__ import annotations

from maru_vllm.pool.presence import PresenceTable, write_units
from maru_vllm.pool.records import Obj

#: (namespace, part key) -> the visible objects naming it, oldest first: {oid: (object, units)}
Holders = dict[int, tuple[Obj, int]]


class PartIndex:
    """Part keys of the visible objects. Not thread-safe: the pool index's loop owns it."""

    def __init__(self, presence: PresenceTable | None = None) -> None:
        self.presence = presence
        self.holders: dict[tuple[str, bytes], Holders] = {}

    def __len__(self) -> int:
        return len(self.holders)

    def newest(self, ns: str, key: bytes) -> tuple[Obj, int] | None:
        """The most recently committed object naming `key` as a part, and the units it names."""
        holders = self.holders.get((ns, key))
        if not holders:
            return None
        return holders[next(reversed(holders))]

    def add(self, obj: Obj, *, announce: bool = True) -> None:
        """`obj` became visible: it is now the newest holder of each of its part keys.
        `announce=False` leaves the presence table alone (a bulk `refill_presence` follows)."""
        for units, pkey in enumerate(obj.parts, 1):
            self.holders.setdefault((obj.ns, pkey), {})[obj.oid] = (obj, units)
        if announce and self.presence is not None:
            table = self.presence
            for units, tag in enumerate(table.fingerprints.of_parts(obj.ns, obj.parts), 1):
                table.put(tag, write_units(units))

    def drop(self, obj: Obj) -> None:
        """`obj` is no longer visible: forget it as a holder; the presence table follows."""
        for pkey in obj.parts:
            holders = self.holders.get((obj.ns, pkey))
            if holders is not None:
                holders.pop(obj.oid, None)
                if not holders:
                    del self.holders[(obj.ns, pkey)]
                if self.presence is not None:
                    tag = self.presence.fingerprints.of_part(obj.ns, pkey)
                    found = self.newest(obj.ns, pkey)
                    if found is None:
                        self.presence.discard(tag)
                    else:
                        self.presence.put(tag, write_units(found[1]))

    def presence_entries(self) -> tuple[list[int], list[int]]:
        """(tags, encoded units) of every part key's newest holder, for a bulk presence refill."""
        assert self.presence is not None
        fps = self.presence.fingerprints
        tags: list[int] = []
        named: list[int] = []
        for (ns, pkey), holders in self.holders.items():
            tags.append(fps.of_part(ns, pkey))
            named.append(write_units(holders[next(reversed(holders))][1]))
        return tags, named
