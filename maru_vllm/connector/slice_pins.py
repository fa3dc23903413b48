"""The pool objects one rank reads a chunk from, when writers of another TP size stored it.

A load names its chunk and the split it was found under (`ChunkLoad.split`, chunks.py). Under
this engine's own split a rank reads the one object of its own slice. Under another TP size's,
it reads every slice of that split holding a part of its KV heads: one object when the writer
split coarser (`KVCacheSet.unpack` takes the rank's head range out of it), several when it split
finer (`SlicePins`, copied by `Copier.unpack_heads`). Chunks shared only in part are always
found under the own split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from maru_vllm.connector.chunks import Slice, Split, chunk_key, slices_to_read
from maru_vllm.connector.metadata import ChunkLoad
from maru_vllm.pool import ReadPin


@dataclasses.dataclass
class SlicePins:
    """The pins of the objects one chunk is read from (None: that object is missing)."""

    pins: list[ReadPin | None]

    @property
    def complete(self) -> bool:
        return all(p is not None for p in self.pins)


def load_keys(load: ChunkLoad, own: Slice, splits: Sequence[Split]) -> list[bytes]:
    """The keys of the objects `load` reads ([] when its split is not one this rank knows: a miss)."""
    if load.split == 0 or load.chunk_blocks:
        return [chunk_key(load.key, own.name)]
    if not 0 < load.split < len(splits):
        return []
    return [chunk_key(load.key, s.name) for s in slices_to_read(splits[load.split], own)]


def flat_pins(pins: Sequence[object]) -> list[ReadPin | None]:
    """Every pin of a step's loads, `SlicePins` spread out (what one `release` unpins)."""
    out: list[ReadPin | None] = []
    for pin in pins:
        if isinstance(pin, SlicePins):
            out.extend(pin.pins)
        else:
            out.append(pin)  # type: ignore[arg-type]
    return out
