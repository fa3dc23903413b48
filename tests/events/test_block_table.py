"""CountedKeys: the relay's counted key set agrees with a plain Counter, one key or a page at a time."""

from __future__ import annotations

import collections
import random

import numpy as np

from maru_vllm.events.block_table import MAX_COUNT, CountedKeys


def test_counts_match_a_counter_through_adds_removals_pages_and_rebuilds() -> None:
    table, ref = CountedKeys(), collections.Counter[int]()
    rng = random.Random(1)
    keys = [rng.getrandbits(64) or 1 for _ in range(3000)]
    for step in range(12_000):
        k = rng.choice(keys)
        if rng.random() < 0.6:
            assert table.add(k) == ref[k]
            ref[k] += 1
        else:
            expect = ref[k] - 1 if ref[k] else -1
            assert table.remove(k) == expect
            ref[k] = max(0, ref[k] - 1)
        if step % 500 == 0:  # a page, with repeats inside it
            page = np.array([rng.choice(keys) for _ in range(400)], dtype=np.uint64)
            before = table.add_many(page)
            for i, pk in enumerate(page.tolist()):
                assert before[i] == ref[pk]
                ref[pk] += 1
            assert table.counts_of(page).tolist() == [ref[pk] for pk in page.tolist()]
    assert len(table) == sum(1 for v in ref.values() if v)
    assert set(table.keys().tolist()) == {k for k, v in ref.items() if v}
    assert table.capacity >= 2 * len(table)  # rebuilt as it grew, dead slots dropped


def test_memory_is_a_few_bytes_per_key_and_counts_saturate() -> None:
    table = CountedKeys(100_000)
    table.add_many(np.arange(1, 100_001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    assert len(table) == 100_000 and table.nbytes <= 100_000 * 40  # a dict[int, int] costs ~85 B per key
    t = CountedKeys()
    t.add_many(np.full(MAX_COUNT + 10, 7, dtype=np.uint64))
    assert t.count(7) == MAX_COUNT and t.remove(7) == MAX_COUNT  # saturated: never withdrawn by counting
