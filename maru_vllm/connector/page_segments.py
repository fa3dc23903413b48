"""Where each byte of a whole-page chunk lives in a CPU KV cache, as segments for the fused copy.

A chunk of ``n`` blocks is layer-major: for every unique layer, ``n`` pages back to back, each
page in its storage order (see layouts.py). `PageSegments` turns a list of block ids into the
``(payload offset, address, length)`` triples `maru_vllm.native` copies, in payload order, with
neighbours that are contiguous on both sides merged. The arithmetic is vectorised (numpy) over
layers x blocks x contiguous pieces of a page, so the per-chunk cost does not grow with Python
loops over pages.

Built only when every unique layer has the same page geometry (shape, strides, dtype) and lives
in host memory; otherwise the codec keeps its torch copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["PageSegments"]


class PageSegments:
    """The segment planner of one KV cache set (one rank's registered layers)."""

    def __init__(
        self, bases: np.ndarray, block_stride: int, page_nbytes: int, piece_offsets: np.ndarray, piece_nbytes: int
    ) -> None:
        self.bases = bases  # [L] int64: address of block 0's page, per layer
        self.block_stride = block_stride  # bytes between two consecutive blocks' pages
        self.page_nbytes = page_nbytes
        self.piece_offsets = piece_offsets  # [P] int64: contiguous pieces of a page, in page order
        self.piece_nbytes = piece_nbytes

    @classmethod
    def build(cls, pages: Sequence[torch.Tensor]) -> PageSegments | None:
        """From each unique layer's ``[num_blocks, *page]`` view; None when they differ or are not on CPU."""
        if not pages:
            return None
        p0 = pages[0]
        for p in pages:
            if p.device.type != "cpu" or p.shape != p0.shape or p.stride() != p0.stride() or p.dtype != p0.dtype:
                return None
        esize = p0.element_size()
        sizes, strides = list(p0.shape[1:]), [s * esize for s in p0.stride()[1:]]
        # The longest contiguous tail of the page's dims is one piece; the dims before it enumerate pieces.
        piece = esize
        cut = len(sizes)
        while cut > 0 and (sizes[cut - 1] == 1 or strides[cut - 1] == piece):
            piece *= sizes[cut - 1]
            cut -= 1
        offsets = np.zeros(1, dtype=np.int64)
        for size, stride in zip(sizes[:cut], strides[:cut]):
            offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).ravel()
        page_nbytes = math.prod(sizes) * esize
        if page_nbytes == 0:
            return None
        bases = np.array([p.data_ptr() for p in pages], dtype=np.int64)
        return cls(bases, p0.stride()[0] * esize, page_nbytes, offsets, piece)

    def segments(self, block_ids: Sequence[int], n_blocks: int, skip_blocks: int = 0) -> np.ndarray:
        """``[k, 3]`` uint64 (payload offset, address, length) for blocks ``skip_blocks ..`` of a chunk
        of ``n_blocks`` going to / coming from ``block_ids``; payload bytes outside them are not copied."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size == 0:
            return np.zeros((0, 3), dtype=np.uint64)
        return self.segments_many(ids[None, :], n_blocks, skip_blocks)[0]

    def segments_many(self, block_ids: np.ndarray, n_blocks: int, skip_blocks: int = 0) -> list[np.ndarray]:
        """`segments` of ``C`` chunks in one vectorised pass: ``block_ids`` is ``[C, m]``, one row per
        chunk, every chunk ``n_blocks`` long with the same ``skip_blocks`` (a step's whole chunks)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        chunks, m = ids.shape
        layers = self.bases.size
        pieces = self.piece_offsets.size
        plen = self.piece_nbytes
        addr = (
            self.bases[None, :, None, None]
            + ids[:, None, :, None] * self.block_stride
            + self.piece_offsets[None, None, None, :]
        ).ravel()
        page_index = np.arange(layers, dtype=np.int64)[:, None] * n_blocks + skip_blocks + np.arange(m)[None, :]
        poff_one = (
            page_index[:, :, None] * self.page_nbytes + np.arange(pieces, dtype=np.int64)[None, None, :] * plen
        ).ravel()
        poff = np.tile(poff_one, chunks)
        per_chunk = poff_one.size
        # A segment starts where either side is not contiguous with the previous piece, and at
        # every chunk's first piece (segments never cross from one chunk's payload to the next).
        starts = np.ones(poff.size, dtype=bool)
        starts[1:] = (poff[1:] != poff[:-1] + plen) | (addr[1:] != addr[:-1] + plen)
        starts[::per_chunk] = True
        first = np.flatnonzero(starts)
        out = np.empty((first.size, 3), dtype=np.int64)
        out[:, 0] = poff[first]
        out[:, 1] = addr[first]
        out[:, 2] = np.diff(np.append(first, poff.size)) * plen
        bounds = np.searchsorted(first, np.arange(1, chunks) * per_chunk)
        return np.split(out.view(np.uint64), bounds)
