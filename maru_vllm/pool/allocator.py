"""Space allocation inside the region's data area: page runs plus slab size classes.

Why this design: KV chunks of one model nearly all have the same size, and the pool churns
(store, evict, store) forever. Two tiers keep that cheap and bounded:

* **Page runs** (4 KiB pages) for large objects (> 256 KiB, which is what real KV chunks are).
  Free runs are coalesced with both neighbours on free and kept in power-of-two buckets, so an
  allocation looks at one bucket above the request (any run there fits) - O(log pages) bucket
  checks, a small constant - and waste is at most one page per object (< 1.6%). Because a
  chunk size repeats, a freed chunk's run is exactly what the next chunk needs, so churn does
  not fragment.
* **Slab size classes** for small objects: classes grow geometrically (8 steps per doubling,
  so internal waste < 12.5%); each slab is a page run holding many same-class slots with a
  free-slot stack - O(1) allocate/free. A slab that becomes empty is returned to the page
  runs at once, so memory is never stranded in a class that is no longer used (the classic
  slab "calcification" blow-up under a changing size mix).

The allocator only tracks space; it never touches the region's bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PAGE = 4096
SMALL_MAX = 256 * 1024
MIN_CLASS = 64
STEPS_PER_DOUBLING = 8
MIN_SLAB = 64 * 1024
SLOTS_PER_SLAB = 16


@dataclass(eq=False, slots=True)
class Slab:
    start_page: int
    npages: int
    cls: SizeClass
    free: list[int]
    used: int = 0


@dataclass(eq=False, slots=True)
class SizeClass:
    size: int
    slab_pages: int
    slots: int
    partial: dict[int, Slab] = field(default_factory=dict)  # start_page -> slab with free slots


@dataclass(eq=False, slots=True)
class Allocation:
    """A block handed out: `offset` is relative to the data area start."""

    offset: int
    capacity: int
    slab: Slab | None = None
    slot: int = -1
    npages: int = 0


def _make_classes() -> list[int]:
    sizes: list[int] = []
    base = MIN_CLASS
    while base < SMALL_MAX:
        for step in range(STEPS_PER_DOUBLING):
            s = base + base * step // STEPS_PER_DOUBLING
            s = (s + 63) // 64 * 64
            if not sizes or s > sizes[-1]:
                sizes.append(s)
        base *= 2
    sizes.append(SMALL_MAX)
    return sizes


_CLASS_SIZES = _make_classes()


class PageRuns:
    """Free-run allocator over `npages` pages with neighbour coalescing."""

    def __init__(self, npages: int, free_runs: Iterable[tuple[int, int]] | None = None) -> None:
        """`free_runs`: (start, pages) of the free runs (default: every page is free)."""
        self.npages = npages
        self.free_pages = 0
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._buckets: list[dict[int, None]] = [dict() for _ in range(max(1, npages.bit_length() + 1))]
        for start, n in [(0, npages)] if free_runs is None else free_runs:
            if n > 0:
                self._insert(start, n)

    def _insert(self, start: int, n: int) -> None:
        self._by_start[start] = n
        self._by_end[start + n] = start
        self._buckets[n.bit_length() - 1][start] = None
        self.free_pages += n

    def _remove(self, start: int) -> int:
        n = self._by_start.pop(start)
        del self._by_end[start + n]
        del self._buckets[n.bit_length() - 1][start]
        self.free_pages -= n
        return n

    def alloc(self, n: int) -> int | None:
        if n <= 0 or n > self.free_pages:
            return None
        b = n.bit_length() - 1
        start = -1
        # Any run in a higher bucket is >= 2**(b+1) > n; take the smallest such bucket.
        for bucket in self._buckets[b + 1 :]:
            if bucket:
                start = next(iter(bucket))
                break
        if start < 0:  # only same-bucket runs left: scan that bucket (bounded by its size)
            for s in self._buckets[b]:
                if self._by_start[s] >= n:
                    start = s
                    break
        if start < 0:
            return None
        length = self._remove(start)
        if length > n:
            self._insert(start + n, length - n)
        return start

    def free(self, start: int, n: int) -> None:
        end = start + n
        left = self._by_end.get(start)
        if left is not None:
            n += self._remove(left)
            start = left
        if end in self._by_start:
            n += self._remove(end)
        self._insert(start, n)

    def largest_free(self) -> int:
        for i in range(len(self._buckets) - 1, -1, -1):
            if self._buckets[i]:
                return max(self._by_start[s] for s in self._buckets[i])
        return 0


class Allocator:
    """Allocate/free blocks in a data area of `capacity` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity // PAGE * PAGE
        self.pages = PageRuns(self.capacity // PAGE)
        self.classes = [self._new_class(s) for s in _CLASS_SIZES]
        self.allocated_bytes = 0  # capacity handed out to callers (slot or page-run size)
        self.slab_bytes = 0  # pages currently held by slabs
        self.small_bytes = 0  # slot bytes handed out from slabs

    @staticmethod
    def _new_class(size: int) -> SizeClass:
        slab_bytes = max(MIN_SLAB, size * SLOTS_PER_SLAB)
        pages = (slab_bytes + PAGE - 1) // PAGE
        return SizeClass(size=size, slab_pages=pages, slots=pages * PAGE // size)

    def class_for(self, size: int) -> SizeClass | None:
        if size > SMALL_MAX:
            return None
        lo, hi = 0, len(self.classes) - 1
        while lo < hi:  # first class with class.size >= size
            mid = (lo + hi) // 2
            if self.classes[mid].size >= size:
                hi = mid
            else:
                lo = mid + 1
        return self.classes[lo]

    def alloc(self, size: int) -> Allocation | None:
        """A block of at least `size` bytes, or None when no space is free right now."""
        if size < 0 or size > self.capacity:
            return None
        size = max(size, 1)
        cls = self.class_for(size)
        if cls is None:
            return self._alloc_run(size)
        slab = next(iter(cls.partial.values()), None)
        if slab is None:
            start = self.pages.alloc(cls.slab_pages)
            if start is None:
                # no room for a whole slab (small or nearly full pool): a page run still fits
                return self._alloc_run(size) if size > PAGE // 2 else None
            slab = Slab(start, cls.slab_pages, cls, list(range(cls.slots - 1, -1, -1)))
            cls.partial[start] = slab
            self.slab_bytes += cls.slab_pages * PAGE
        slot = slab.free.pop()
        slab.used += 1
        if not slab.free:
            del cls.partial[slab.start_page]
        self.allocated_bytes += cls.size
        self.small_bytes += cls.size
        return Allocation(offset=slab.start_page * PAGE + slot * cls.size, capacity=cls.size, slab=slab, slot=slot)

    def _alloc_run(self, size: int) -> Allocation | None:
        npages = (size + PAGE - 1) // PAGE
        start = self.pages.alloc(npages)
        if start is None:
            return None
        self.allocated_bytes += npages * PAGE
        return Allocation(offset=start * PAGE, capacity=npages * PAGE, npages=npages)

    def free(self, a: Allocation) -> None:
        self.allocated_bytes -= a.capacity
        slab = a.slab
        if slab is None:
            self.pages.free(a.offset // PAGE, a.npages)
            return
        cls = slab.cls
        self.small_bytes -= cls.size
        if not slab.free:
            cls.partial[slab.start_page] = slab
        slab.free.append(a.slot)
        slab.used -= 1
        if slab.used == 0:  # give the whole slab back so other sizes can use it
            del cls.partial[slab.start_page]
            self.pages.free(slab.start_page, slab.npages)
            self.slab_bytes -= slab.npages * PAGE

    def restore(self, blocks: Sequence[tuple[int, int, int]]) -> list[Allocation | None]:
        """Claim again the blocks a previous owner of the data area handed out (a warm restart).

        `blocks`: (offset, capacity, slab start page or -1 for a page run) each. Call once, on a
        fresh allocator. A block out of bounds, of a shape this allocator does not make, claimed
        twice, or overlapping another is refused (None; for a slab, every block in it); the rest
        are allocated exactly where they were, and every page no kept block covers is free.
        """
        out: list[Allocation | None] = [None] * len(blocks)
        npages = self.pages.npages
        by_size = {c.size: c for c in self.classes}
        runs: list[tuple[int, int, int]] = []  # (start page, pages, block index)
        slabs: dict[int, tuple[SizeClass, dict[int, int]]] = {}  # start page -> (class, {slot: block index})
        refused_slabs: set[int] = set()
        twice: set[tuple[int, int]] = set()
        for i, (off, cap, slab) in enumerate(blocks):
            if slab < 0:
                if off >= 0 and cap > 0 and not off % PAGE and not cap % PAGE and off + cap <= self.capacity:
                    runs.append((off // PAGE, cap // PAGE, i))
                continue
            cls = by_size.get(cap)
            rel = off - slab * PAGE
            if (
                cls is None
                or slab + cls.slab_pages > npages
                or rel < 0
                or rel % cls.size
                or rel >= cls.slots * cls.size
            ):
                continue
            held = slabs.setdefault(slab, (cls, {}))
            if held[0] is not cls:
                refused_slabs.add(slab)
            elif rel // cls.size in held[1]:
                twice.add((slab, rel // cls.size))
            else:
                held[1][rel // cls.size] = i
        for slab, slot in twice:
            del slabs[slab][1][slot]
        for slab in refused_slabs | {s for s, (_, members) in slabs.items() if not members}:
            del slabs[slab]
        # extents in page order; tag >= 0: a run's block index, < 0: ~(a slab's start page)
        extents = sorted([*runs, *((s, c.slab_pages, ~s) for s, (c, _) in slabs.items())])
        refused: set[int] = set()
        end, furthest = 0, 0
        for start, n, tag in extents:
            if start < end:  # overlaps the extent before it that reaches furthest
                refused.update((tag, furthest))
            if start + n > end:
                end, furthest = start + n, tag
        free_runs, at = [], 0
        for start, n, tag in extents:
            if tag in refused:
                continue
            free_runs.append((at, start - at))
            at = start + n
            if tag >= 0:
                out[tag] = Allocation(offset=start * PAGE, capacity=n * PAGE, npages=n)
                self.allocated_bytes += n * PAGE
                continue
            cls, members = slabs[~tag]
            slab_obj = Slab(start, n, cls, [s for s in range(cls.slots - 1, -1, -1) if s not in members], len(members))
            if slab_obj.free:
                cls.partial[start] = slab_obj
            self.slab_bytes += n * PAGE
            for slot, i in members.items():
                out[i] = Allocation(offset=start * PAGE + slot * cls.size, capacity=cls.size, slab=slab_obj, slot=slot)
                self.allocated_bytes += cls.size
                self.small_bytes += cls.size
        free_runs.append((at, npages - at))
        self.pages = PageRuns(npages, free_runs)
        return out

    def stats(self) -> dict[str, int]:
        return {
            "capacity_bytes": self.capacity,
            "allocated_bytes": self.allocated_bytes,
            "free_page_bytes": self.pages.free_pages * PAGE,
            "slab_bytes": self.slab_bytes,
        }

    def check(self) -> None:
        """Internal consistency (tests): every page is free, in a slab, or in a large block."""
        large = self.allocated_bytes - self.small_bytes
        if self.pages.free_pages * PAGE + self.slab_bytes + large != self.capacity:
            raise AssertionError(
                f"allocator pages do not add up: free {self.pages.free_pages * PAGE} + slabs "
                f"{self.slab_bytes} + large {large} != capacity {self.capacity}"
            )
        if self.small_bytes > self.slab_bytes:
            raise AssertionError(f"small objects {self.small_bytes} exceed slab pages {self.slab_bytes}")
