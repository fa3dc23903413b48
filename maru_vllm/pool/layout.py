"""Where things lie in a pool's region: header, presence table, catalog, heap.

```
 0          HEADER_SIZE        catalog_offset          heap_offset                       size
 | header   | presence table   | catalog (16 B/slot)   | heap: payloads + record blocks    |
```

Every part starts on a page. The layout is decided once from the region's size and the service's
settings (`Layout.decide`) and written into the region header, so a service started again on the
region can tell whether it lies out the region the same way (a warm restart needs that: objects
stay at the offsets where they were written).
"""

from __future__ import annotations

from dataclasses import dataclass

from maru_vllm.pool.catalog import Catalog
from maru_vllm.pool.presence import default_buckets, table_bytes

HEADER_SIZE = 4096
PAGE_SIZE = 4096
MIN_CATALOG_SLOTS = 256


def round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def default_catalog_slots(region_size: int, max_objects: int) -> int:
    """One slot per 4 KiB of region (0.4% of it), at most one per object the index may hold."""
    return max(MIN_CATALOG_SLOTS, min(region_size // 4096, max_objects))


@dataclass(frozen=True)
class Layout:
    size: int  # the whole region
    presence_buckets: int  # 0: no presence table
    catalog_slots: int  # 0: no catalog (objects are not recoverable)

    @classmethod
    def decide(cls, size: int, max_objects: int, presence_buckets: int | None) -> Layout:
        """The layout of a `size`-byte region; `presence_buckets` None: sized from the region."""
        if presence_buckets is None:
            presence_buckets = default_buckets(size - HEADER_SIZE, max_objects)
        return cls(size, presence_buckets, default_catalog_slots(size, max_objects))

    @property
    def presence_offset(self) -> int:
        return HEADER_SIZE

    @property
    def catalog_offset(self) -> int:
        if not self.presence_buckets:
            return HEADER_SIZE
        return HEADER_SIZE + round_up(table_bytes(self.presence_buckets), PAGE_SIZE)

    @property
    def heap_offset(self) -> int:
        return self.catalog_offset + round_up(Catalog.table_bytes(self.catalog_slots), PAGE_SIZE)

    @property
    def heap_bytes(self) -> int:
        return self.size - self.heap_offset

    def describe(self) -> str:
        return (
            f"size {self.size}, presence table {self.presence_buckets} buckets, catalog {self.catalog_slots} slots, "
            f"heap at {self.heap_offset}"
        )
