"""Reading objects that are not in this rank's own format but hold what it needs, bit for bit.

`KVCacheSet.unpack` copies an object in the cache set's own format as it is. It comes here when
the object's format trailer (object_format.py) states the same content in another page order
or in LMCache's block order (its kernel's objects), or more KV heads than this rank holds (a
writer that split the heads coarser, or replicated heads when a model has fewer KV heads than
TP ranks): each layer's pages are viewed in the writer's axes, the rank's head range is taken,
and the result is permuted into the rank's page order while it is copied (torch copies: the
fast path is the own format's). `unpack_heads` assembles one rank's heads from the objects of
writers that split them finer. Everything is checked before anything is copied; a failed check
is `LayoutMismatch`, a miss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from maru_vllm.connector.object_format import (
    ORDER_LMCACHE,
    TRAILER_BYTES,
    ObjectFormat,
    converted_pages,
    lmcache_layer_pages,
    page_dim_of,
    read_format,
)
from maru_vllm.connector.page_copies import byte_tensor, copy_runs
from maru_vllm.connector.page_layout import LayoutMismatch, PageLayout, block_runs


class PageCodec(Protocol):
    """What these reads need of a rank's cache set (`layouts.KVCacheSet` is one)."""

    @property
    def format(self) -> ObjectFormat | None: ...

    @property
    def unique_layers(self) -> tuple[str, ...]: ...

    @property
    def layouts(self) -> Mapping[str, PageLayout]: ...

    def pages_of(self, layer: str) -> torch.Tensor: ...

    def check_chunk(self, block_ids: Sequence[int], nbytes: int, what: str, skip_blocks: int = 0) -> int: ...


def own_nbytes(codec: PageCodec, nbytes: int, written: ObjectFormat) -> int:
    """The size an object of `written` format and `nbytes` bytes would have holding this rank's
    heads; -1 when the sizes do not scale (a wrong size: a miss)."""
    assert codec.format is not None
    own = codec.format.heads.hi - codec.format.heads.lo
    pages = (nbytes - TRAILER_BYTES) * own
    span = written.heads.hi - written.heads.lo
    return -1 if span <= 0 or pages % span else pages // span + TRAILER_BYTES


def convert_unpack(
    codec: PageCodec,
    block_ids: Sequence[int],
    flat: torch.Tensor,
    n: int,
    skip_blocks: int,
    written: ObjectFormat,
    hasher: Any,
    heads: tuple[int, int] | None = None,
) -> None:
    """Copy an object of `written` format into the pages of `block_ids`: the KV heads ``heads``
    (default: all of this rank's) of each layer, in this rank's page order. `n` is the chunk's
    block count; with `hasher` every byte of `flat` is hashed first."""

    own = codec.format
    assert own is not None
    if hasher is not None:
        hasher.update(flat.numpy().data)
    lo, hi = heads if heads is not None else (own.heads.lo, own.heads.hi)
    span, mine = written.heads.hi - written.heads.lo, own.heads.hi - own.heads.lo
    runs = block_runs(block_ids)
    by_layer: list[torch.Tensor] = []
    if written.order == ORDER_LMCACHE:  # layers interleaved with K and V: strided views of the object
        dtype = codec.layouts[codec.unique_layers[0]].dtype
        by_layer = lmcache_layer_pages(flat[: flat.numel() - TRAILER_BYTES].view(dtype), written, n)
    off = 0
    for index, name in enumerate(codec.unique_layers):
        lay = codec.layouts[name]
        size = n * lay.page_nbytes * span // mine
        src = by_layer[index] if by_layer else flat[off : off + size].view(lay.dtype).view(n, -1)
        dst, shape = codec.pages_of(name), list(lay.page_shape)
        if (lo, hi) != (own.heads.lo, own.heads.hi):
            at = page_dim_of(lay, "heads", own.heads.mla)
            assert at is not None  # checked by unpack_heads
            dst, shape[at] = dst.narrow(1 + at, lo - own.heads.lo, hi - lo), hi - lo
        pages = converted_pages(src, written, own, shape, (lo, hi))
        copy_runs([(pages, dst)], runs, into_cache=True, skip_blocks=skip_blocks)
        off += size


def unpack_heads(codec: PageCodec, block_ids: Sequence[int], srcs: Sequence[Any], *, skip_blocks: int = 0) -> None:
    """Copy a chunk written by ranks that split the KV heads finer than this one: `srcs` are their
    objects, whose head ranges together are exactly this rank's. Every source is checked before
    anything is copied (LayoutMismatch: a miss); the caller verifies each one's checksum."""

    own = codec.format
    if own is None:
        raise LayoutMismatch("unpack_heads: this cache set has no object format")
    first = codec.layouts[codec.unique_layers[0]]
    parts: list[tuple[torch.Tensor, ObjectFormat, int]] = []
    for src in srcs:
        flat = byte_tensor(src, writable=False)
        written = read_format(flat)
        lo, hi = written.heads.lo, written.heads.hi
        problem = own.conversion_problem(written, (lo, hi))
        if problem is not None:
            raise LayoutMismatch(f"unpack_heads: the object is {written.describe()} ({problem})")
        if (lo, hi) != (own.heads.lo, own.heads.hi) and page_dim_of(first, "heads", own.heads.mla) is None:
            raise LayoutMismatch("unpack_heads: this rank's pages have no heads axis to split")
        nbytes = own_nbytes(codec, flat.numel(), written)
        parts.append((flat, written, codec.check_chunk(block_ids, nbytes, "unpack_heads", skip_blocks)))
    covered = sorted((w.heads.lo, w.heads.hi) for _, w, _ in parts)
    edges = [own.heads.lo] + [h for r in covered for h in r] + [own.heads.hi]
    if not covered or any(edges[i] != edges[i + 1] for i in range(0, len(edges), 2)):
        raise LayoutMismatch(
            f"unpack_heads: objects of KV heads {covered} are not exactly heads {own.heads.lo}-{own.heads.hi}"
        )
    for flat, written, n in parts:
        convert_unpack(codec, block_ids, flat, n, skip_blocks, written, None, (written.heads.lo, written.heads.hi))
