"""The objects a capped `PoolView` counts, least recently used first, with what withdrawing one needs.

A relay sees the pool's stores and removals, not its reads. What it does see of use: a store
chained on a parent block means that the prompt's earlier chunks were just used (they are its
prefix, loaded from the pool or stored just before). So a store moves the chain of objects
its parent block leads back through to the most recently used end (`touch_chain`), and a
withdrawal for the cap takes the least recently used object. On the Mooncake conversation trace
this keeps a shared prompt's first chunks announced, which a cap by store order withdraws as
soon as N other chunks were stored (and with them the router's credit for every prompt that
starts there).

Per object it keeps the object-id digest, its parent block key and its block keys (8 B each),
and the object whose last block is a given key (the parent of the next chunk). Not thread-safe.
"""

from __future__ import annotations

import collections

import numpy as np

#: the most objects one chain walk moves (a prompt of 512-token chunks is far shorter)
MAX_CHAIN = 4096


class AnnouncedOrder:
    """Counted objects in use order (see module docstring)."""

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # okey -> [parent, *blocks]
        self._by_last_block: dict[int, int] = {}  # a chunk's last block key -> its object's okey

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, okey: int, parent: int, blocks: np.ndarray) -> None:
        """Count `okey` (parent block key, 0 for none; its block keys) as the most recently used."""
        # (uint64 throughout: mixed with a Python int numpy would go through float64)
        self._entries[okey] = np.array([parent], dtype=np.uint64).tobytes() + blocks.astype(np.uint64).tobytes()
        if len(blocks):
            self._by_last_block[int(blocks[-1])] = okey

    def touch_chain(self, parent: int) -> None:
        """Move the objects that block `parent` leads back through (it, its parent's, ...) to the
        most recently used end, the root of the prompt last."""
        chain: list[int] = []
        while parent and len(chain) < MAX_CHAIN:
            okey = self._by_last_block.get(parent)
            if okey is None or okey not in self._entries:
                break
            chain.append(okey)
            parent = int(np.frombuffer(self._entries[okey], dtype=np.uint64, count=1)[0])
        for okey in chain:
            self._entries.move_to_end(okey)

    def pop_oldest(self) -> tuple[int, np.ndarray]:
        """Uncount the least recently used object: (its okey, its block keys)."""
        okey, packed = self._entries.popitem(last=False)
        blocks = np.frombuffer(packed, dtype=np.uint64)[1:]
        self._forget_last(okey, blocks)
        return okey, blocks

    def discard(self, okey: int) -> None:
        packed = self._entries.pop(okey, None)
        if packed is not None:
            self._forget_last(okey, np.frombuffer(packed, dtype=np.uint64)[1:])

    def _forget_last(self, okey: int, blocks: np.ndarray) -> None:
        if len(blocks) and self._by_last_block.get(int(blocks[-1])) == okey:
            del self._by_last_block[int(blocks[-1])]
