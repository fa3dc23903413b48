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
from maru_vllm.pool.protocol import MAX_PARTS
from maru_vllm.pool.records import Obj

#: (namespace, part key) -> the visible objects naming it, oldest first: {oid: (object, units)}
Holders = dict[int, tuple[Obj, int]]

_UNITS = [write_units(units) for units in range(MAX_PARTS + 1)]  # write_units of 0..MAX_PARTS


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
        `announce=False` leaves the presence table alone (a bulk fill from `presence_of` follows)."""
        holders, ns, oid = self.holders, obj.ns, obj.oid
        for units, pkey in enumerate(obj.parts, 1):
            found = holders.get((ns, pkey))
            if found is None:
                holders[(ns, pkey)] = {oid: (obj, units)}
            else:
                found[oid] = (obj, units)
        if announce and self.presence is not None:
            table = self.presence
            for tag, units in zip(*self.presence_of(obj)):
                table.put(tag, units)

    def presence_of(self, obj: Obj) -> tuple[list[int], list[int]]:
        """(tags, encoded units) of `obj`'s part keys as the newest holder records them. Filling an
        empty table with these of every object in commit order (`PresenceTable.put_many`: the last
        of a tag counts) leaves each part key's entry equal to its newest holder's."""
        assert self.presence is not None
        return self.presence.fingerprints.of_parts(obj.ns, obj.parts), _UNITS[1 : len(obj.parts) + 1]

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
