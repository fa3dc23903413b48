"""The presence table: which keys the pool holds, readable in the region without asking the service.

vLLM's scheduler asks the connector, for every new request and inside its scheduling step, how
many leading tokens the pool can supply. Asked over the socket, that question waits for the pool
service to get a core, which on a host whose cores the engines keep busy is milliseconds, and
every running request's next step waits with it. So the service keeps, in a block of the region
that every client maps anyway, a table of fingerprints of the keys it holds visible: whole-object
keys and part keys (with the units that the newest object naming the part holds). A client
answers `lookup_prefix` / `lookup_parts` from it with no round trip (`PresenceReader`).

Layout, little-endian, at `offset` in the region (a block the service allocates once)::

    header, 64 bytes: magic b"MARUPRES", u32 version, u32 slots per bucket, u64 buckets,
                      u64 beat (CLOCK_MONOTONIC ns of the service's last heartbeat; 0: stopped)
    buckets x SLOTS_PER_BUCKET u64 slots: 0 = empty, else (fingerprint & ~0xFF) | units

Contracts:
  * One writer, the service's loop (`PresenceTable`); readers never lock. Every slot is one
    aligned 8-byte word, so a reader sees each slot before or after a write, never a mix.
  * Every key the index holds visible is in its bucket, or its bucket is full. A reader that
    does not find a key in a full bucket does not know, and answers None: ask the service.
    Keys that did not fit are kept by the writer (`spilled`) and move into the bucket as soon
    as a slot frees, so a bucket is never left with room while one of its keys is missing.
  * The service beats every BEAT_S; a table whose beat is older than STALE_S (a service that
    was killed, or hangs) answers None, so a dead pool's table never claims hits for long.
  * Lower-tier hints: the service may also mark keys that this pool does not hold but a lower
    tier (`pool.tier2`) does, with the units value LOWER_TIER. A hint only takes a slot that is
    empty while its bucket keeps HINT_FREE_SLOTS more empty ones, and a key the pool holds
    replaces a hint (its own, or any hint of a full bucket), so hints never push a key the pool
    holds out of its bucket. `lookup_prefix` treats a hint as absent; `lookup_tiers` counts the
    hinted keys after the present prefix (what a fetch from the lower tier could bring in).
  * An answer is a hint, exactly like a lookup's reply: the object can be evicted right after.
    Whoever uses it pins the object (`acquire`) and treats a missing one as a miss. A
    fingerprint collision (about 2^-56 per comparison) is such a hint too: the pin finds the
    real key missing. Lookups answered here do not refresh the objects' LRU position; the pin
    of a load does.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence

import numpy as np
import xxhash

MAGIC = b"MARUPRES"
VERSION = 2  # 2: LOWER_TIER hints (a reader of version 1 would count them as present)
SLOTS_PER_BUCKET = 8
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQQ")
_BEAT_AT = 24  # byte offset of the u64 beat word in the header
BEAT_S = 0.5
STALE_S = 2.0
UNITS_MASK = 0xFF
TAG_MASK = ~UNITS_MASK & 0xFFFF_FFFF_FFFF_FFFF
_PART_SALT = 0x9E37_79B9_7F4A_7C15
MAX_UNITS = UNITS_MASK  # part units above this are not kept here (readers ask the service)
LOWER_TIER = 0xFE  # the units of a hint: a lower tier holds this object key, this pool does not
HINT_FREE_SLOTS = 2  # a hint leaves at least this many empty slots in its bucket


def table_bytes(buckets: int) -> int:
    return HEADER_SIZE + buckets * SLOTS_PER_BUCKET * 8


def default_buckets(region_size: int, max_objects: int) -> int:
    """A table of ~1 slot per 4 KiB of region (0.2% of it), at most 16 slots per object the
    index may hold, at least 64 buckets; a power of two."""
    slots = max(64 * SLOTS_PER_BUCKET, min(region_size // 4096, max_objects * 16))
    buckets = 1
    while buckets * SLOTS_PER_BUCKET < slots:
        buckets *= 2
    return buckets


class Fingerprints:
    """The one definition of a key's fingerprint, shared by the writer and every reader."""

    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}

    def _seed(self, ns: str) -> int:
        seed = self._seeds.get(ns)
        if seed is None:
            if len(self._seeds) > 4096:
                self._seeds.clear()
            seed = self._seeds[ns] = xxhash.xxh3_64_intdigest(ns.encode())
        return seed

    def of_object(self, ns: str, key: bytes) -> int:
        return _tag(xxhash.xxh3_64_intdigest(key, self._seed(ns)))

    def of_part(self, ns: str, key: bytes) -> int:
        return _tag(xxhash.xxh3_64_intdigest(key, self._seed(ns) ^ _PART_SALT))

    def of_parts(self, ns: str, keys: Sequence[bytes]) -> list[int]:
        seed = self._seed(ns) ^ _PART_SALT
        digest = xxhash.xxh3_64_intdigest
        return [_tag(digest(k, seed)) for k in keys]


def bucket_of(tag: int, buckets: int) -> int:
    """A tag's bucket: bits above the units byte (`buckets` is a power of two)."""
    return (tag >> 8) & (buckets - 1)


def _tag(fp: int) -> int:
    tag = fp & TAG_MASK
    return tag if tag else 1 << 8


class PresenceTable:
    """The service's side: creates the table in `view` at `offset` and keeps it equal to the index."""

    def __init__(self, view: memoryview, offset: int, buckets: int, *, live: bool = True) -> None:
        """`live` False: the table starts stopped (readers ask the service) until the first `beat`."""
        if buckets <= 0 or buckets & (buckets - 1):
            raise ValueError(f"presence table buckets must be a power of two, got {buckets}")
        self.offset = offset
        self.buckets = buckets
        self.fingerprints = Fingerprints()
        view[offset : offset + table_bytes(buckets)] = bytes(table_bytes(buckets))
        self._header = view[offset : offset + HEADER_SIZE]
        self._slots = view[offset + HEADER_SIZE : offset + table_bytes(buckets)].cast("Q")
        _HEADER.pack_into(
            self._header, 0, MAGIC, VERSION, SLOTS_PER_BUCKET, buckets, time.monotonic_ns() if live else 0
        )
        # bucket -> {tag: units} of keys that found their bucket full
        self.spilled: dict[int, dict[int, int]] = {}
        self.entries = 0
        self.hints = 0  # slots holding a LOWER_TIER hint (not counted in `entries`)

    @property
    def spilled_entries(self) -> int:
        return sum(len(s) for s in self.spilled.values())

    def put(self, tag: int, units: int = 0) -> None:
        """Record `tag` (with `units`); replaces the units of a tag already there."""
        value = tag | (units & UNITS_MASK)
        bucket = bucket_of(tag, self.buckets)
        base = bucket * SLOTS_PER_BUCKET
        slots = self._slots
        last = tag | UNITS_MASK
        free = hint = -1
        for j, slot in enumerate(slots[base : base + SLOTS_PER_BUCKET].tolist()):
            if tag <= slot <= last:  # this tag, whatever its units
                if slot & UNITS_MASK == LOWER_TIER:  # the pool holds what was a hint
                    self.hints -= 1
                    self.entries += 1
                if slot != value:
                    slots[base + j] = value
                return
            if slot == 0 and free < 0:
                free = j
            elif slot & UNITS_MASK == LOWER_TIER and hint < 0:
                hint = j
        spill = self.spilled.get(bucket)
        if spill is not None and tag in spill:
            spill[tag] = units
            return
        self.entries += 1
        if free < 0 and hint >= 0:  # a key the pool holds takes a hint's slot
            free = hint
            self.hints -= 1
        if free >= 0:
            slots[base + free] = value
        else:
            self.spilled.setdefault(bucket, {})[tag] = units

    def hint(self, tag: int) -> bool:
        """Mark `tag` as held by a lower tier only; False where its bucket has no room to spare
        or the tag is already there (held by the pool, or hinted)."""
        bucket = bucket_of(tag, self.buckets)
        base = bucket * SLOTS_PER_BUCKET
        slots = self._slots
        last = tag | UNITS_MASK
        free = []
        for j, slot in enumerate(slots[base : base + SLOTS_PER_BUCKET].tolist()):
            if tag <= slot <= last:
                return False
            if slot == 0:
                free.append(j)
        spill = self.spilled.get(bucket)
        if len(free) <= HINT_FREE_SLOTS or (spill is not None and tag in spill):
            return False
        slots[base + free[0]] = tag | LOWER_TIER
        self.hints += 1
        return True

    def unhint(self, tag: int) -> None:
        """Drop the hint for `tag` (nothing when the slot holds the pool's own entry)."""
        base = bucket_of(tag, self.buckets) * SLOTS_PER_BUCKET
        slots = self._slots
        value = tag | LOWER_TIER
        for j, slot in enumerate(slots[base : base + SLOTS_PER_BUCKET].tolist()):
            if slot == value:
                slots[base + j] = 0
                self.hints -= 1
                return

    def put_many(self, tags: Sequence[int], units: Sequence[int]) -> None:
        """`put` of every (tag, units) pair into a table that holds no entry yet (a recovered
        pool's); where a tag comes twice, its last units count."""
        if self.entries:
            raise RuntimeError("put_many fills an empty presence table")
        if not tags:
            return
        t = np.asarray(tags, dtype=np.uint64)
        u = np.asarray(units, dtype=np.uint64) & np.uint64(UNITS_MASK)
        last = len(t) - 1 - np.unique(t[::-1], return_index=True)[1]  # the last of each tag
        t, u = t[last], u[last]
        bucket = (t >> np.uint64(8)) & np.uint64(self.buckets - 1)
        order = np.argsort(bucket, kind="stable")
        t, u, bucket = t[order], u[order], bucket[order]
        first = np.searchsorted(bucket, bucket, side="left")
        rank = np.arange(len(bucket)) - first
        fits = rank < SLOTS_PER_BUCKET
        table = np.frombuffer(self._slots, dtype=np.uint64)
        table[(bucket[fits] * np.uint64(SLOTS_PER_BUCKET) + rank[fits].astype(np.uint64)).astype(np.int64)] = (
            t[fits] | u[fits]
        )
        for b, tag, n in zip(bucket[~fits].tolist(), t[~fits].tolist(), u[~fits].tolist()):
            self.spilled.setdefault(b, {})[tag] = n
        self.entries = len(t)

    def discard(self, tag: int) -> None:
        bucket = bucket_of(tag, self.buckets)
        spill = self.spilled.get(bucket)
        if spill is not None and spill.pop(tag, None) is not None:
            self.entries -= 1
            if not spill:
                del self.spilled[bucket]
            return
        base = bucket * SLOTS_PER_BUCKET
        slots = self._slots
        last = tag | UNITS_MASK
        for j, slot in enumerate(slots[base : base + SLOTS_PER_BUCKET].tolist()):
            if tag <= slot <= last:
                if slot & UNITS_MASK == LOWER_TIER:
                    return  # a hint, not an entry of the pool's (unhint drops it)
                self.entries -= 1
                if spill:
                    moved, units = spill.popitem()
                    if not spill:
                        del self.spilled[bucket]
                    slots[base + j] = moved | units
                else:
                    slots[base + j] = 0
                return

    def beat(self) -> None:
        """Tell readers the service is alive (call every BEAT_S)."""
        struct.pack_into("<Q", self._header, _BEAT_AT, time.monotonic_ns())

    def close(self) -> None:
        """Tell readers the service is gone (they ask the service, which reconnects them)."""
        struct.pack_into("<Q", self._header, _BEAT_AT, 0)


class PresenceReader:
    """A client's side: answers lookups from the table, or None where only the service knows."""

    def __init__(self, view: memoryview, offset: int, buckets: int) -> None:
        magic, version, per_bucket, have_buckets, _ = _HEADER.unpack_from(view, offset)
        if (magic, version, per_bucket, have_buckets) != (MAGIC, VERSION, SLOTS_PER_BUCKET, buckets):
            raise ValueError(f"no presence table of {buckets} buckets at region offset {offset}")
        self.buckets = buckets
        self._header = view[offset : offset + HEADER_SIZE]
        self._slots = view[offset + HEADER_SIZE : offset + table_bytes(buckets)].cast("Q")
        self.fingerprints = Fingerprints()

    @property
    def live(self) -> bool:
        """Whether the service beat within STALE_S."""
        beat = struct.unpack_from("<Q", self._header, _BEAT_AT)[0]
        return beat != 0 and time.monotonic_ns() - beat < STALE_S * 1e9

    def _units(self, tag: int) -> int | None:
        """The units recorded for `tag`; -1 where it is certainly absent; None where unknown."""
        base = bucket_of(tag, self.buckets) * SLOTS_PER_BUCKET
        last = tag | UNITS_MASK
        full = True
        for slot in self._slots[base : base + SLOTS_PER_BUCKET].tolist():
            if tag <= slot <= last:
                return slot & UNITS_MASK
            if slot == 0:
                full = False
        return None if full else -1

    def lookup_prefix(self, ns: str, keys: Sequence[bytes]) -> int | None:
        """How many leading `keys` the pool holds; None where the table cannot tell."""
        if not self.live:
            return None
        fps = self.fingerprints
        n = 0
        for key in keys:
            found = self._units(fps.of_object(ns, key))
            if found is None:
                return None
            if found < 0 or found == LOWER_TIER:
                break
            n += 1
        return n

    def lookup_tiers(self, ns: str, keys: Sequence[bytes]) -> tuple[int, int] | None:
        """(how many leading `keys` the pool holds, how many keys right after those a lower tier
        is hinted to hold); None where the table cannot tell the first."""
        if not self.live:
            return None
        fps = self.fingerprints
        n = hinted = 0
        for key in keys:
            found = self._units(fps.of_object(ns, key))
            if hinted == 0 and found is None:
                return None
            if found == LOWER_TIER:
                hinted += 1
            elif hinted or found is None or found < 0:
                break
            else:
                n += 1
        return n, hinted

    def lookup_parts(self, ns: str, keys: Sequence[bytes]) -> list[int] | None:
        """For each part key, the units the newest object naming it holds (0: none); None where
        the table cannot tell."""
        if not self.live:
            return None
        fps = self.fingerprints
        out = []
        for key in keys:
            found = self._units(fps.of_part(ns, key))
            if found is None or found == UNITS_MASK:
                return None
            out.append(found if 0 < found < LOWER_TIER else 0)
        return out


def write_units(units: int) -> int:
    """The units a part entry records: MAX_UNITS marks "more than fits" (readers ask the service);
    LOWER_TIER and above are never recorded as a count."""
    return units if units < LOWER_TIER else MAX_UNITS
