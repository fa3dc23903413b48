"""What moves pages between the paged KV cache and pool objects: the `Copier` interface.

A copier is made once per KV cache group when the worker registers its caches
(`transfer.make_copier`) and is then used by the worker side's loads and the store writer's
thread. Its implementations are in `transfer.py`.

Failure contract: a copy that cannot be done raises before it writes anything it was not given
(`LayoutMismatch` for a buffer of the wrong size, `IndexError` for a block id outside the cache,
`RuntimeError` / `ValueError` from the kernel); the caller turns that into a miss (load) or a
skipped store, never into KV it trusts. A compiled LMCache kernel that fails at run time is
replaced by the installed release's torch implementation of it (same object format) where that
release has one; anything else a kernel raises reaches the caller as a `RuntimeError`. A copier
never unpins, commits or hashes on the pool's behalf: a load's payload is verified by the caller
against the digest or hasher it handed in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from maru_vllm.connector.object_format import ObjectFormat


@dataclasses.dataclass(frozen=True)
class WholeChunk:
    """One whole chunk of a batched copy: its blocks, its pool payload, and (loads) whether to
    hash the payload on the way (a store always does)."""

    block_ids: Sequence[int]
    payload: memoryview
    skip_blocks: int = 0
    hashed: bool = True


class Copier(Protocol):
    """Copies whole pages of one KV cache group between its blocks and pool objects."""

    @property
    def format(self) -> str:
        """The object order it writes (`transfer.copy_format`, for logs: every copier reads every
        order its objects' trailers state, object_format.py)."""

    @property
    def object_format(self) -> ObjectFormat | None:
        """The format trailer its objects carry (None: none given yet)."""

    @property
    def name(self) -> str:
        """How pages move now, for logs (may change once, e.g. to a fallback kernel)."""

    @property
    def fuses_loads(self) -> bool:
        """Whether `unpack_many` moves a step's whole chunks in fewer launches than one per chunk
        (what `maru_enable_fused_load` asks for)."""

    def chunk_nbytes(self, n_blocks: int) -> int:
        """The payload size of an object of `n_blocks` blocks."""

    def pack(self, block_ids: Sequence[int], out: Any) -> int | None:
        """Copy the pages of `block_ids` into `out`; the payload's checksum when the copy computed
        it, else None (the pool client hashes it)."""

    def unpack(
        self,
        block_ids: Sequence[int],
        src: Any,
        *,
        skip_blocks: int = 0,
        chunk_blocks: int | None = None,
        hasher: Any = None,
    ) -> None:
        """Copy blocks [skip_blocks, skip_blocks + len(block_ids)) of the object `src` (of
        `chunk_blocks` blocks, default exactly those) into `block_ids`, feeding `hasher` the whole
        payload on the way when given."""

    def unpack_many(self, items: Sequence[tuple[Sequence[int], Any, int]]) -> None:
        """`unpack` of several (block_ids, src, skip_blocks) objects, already verified."""

    def unpack_heads(self, block_ids: Sequence[int], srcs: Sequence[Any], *, skip_blocks: int = 0) -> None:
        """Copy one chunk out of the objects of writers that split the KV heads finer (each holds
        a part of this rank's heads; together exactly its heads), already verified."""

    def unpack_whole_many(self, items: Sequence[WholeChunk]) -> list[int | None] | None:
        """Whole chunks in one batched pass: per chunk the XXH3-64 digest of its payload when
        `hashed` (None: verify it another way), or None when this copier has no batched pass
        (use `unpack`). Sizes and block ids are checked before anything is copied."""

    def pack_whole_many(self, items: Sequence[WholeChunk]) -> list[int | None] | None:
        """`pack` of whole chunks in one batched pass: per chunk its checksum (None: too short,
        the pool client hashes it), or None when this copier has no batched pass (use `pack`)."""

    def finish(self) -> None:
        """Return once every launched copy has read its objects (before their pins are released)."""
