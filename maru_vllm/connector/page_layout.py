"""How one layer's paged KV cache is laid out, found from the tensor vLLM hands over.

vLLM 0.31 hands every attention layer over as a 4-D ``[B, H, N, C]`` view of one
shared int8 allocation (C holds K then V; MLA has H == 1 and no V); the physical
order comes from ``KVCacheLayout`` (``LBHNC``, ``LBNHC``, ``BLHNC``, ...), so
the block dim is 0 but pages may be strided. Older releases used 5-D
``[2, B, N, H, D]`` (FlashAttention), ``[B, 2, N, H, D]`` (FlashInfer/Triton, HND
via stride order) and 3-D MLA ``[B, N, D]``; those are handled too. A page is
everything one block id addresses in one layer (`PageLayout`); layouts.py copies
whole pages between the cache and pool objects.

Std ``logging`` is used on purpose (see layouts.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "LayoutError",
    "AmbiguousLayout",
    "LayoutMismatch",
    "PageLayout",
    "layout_for_backend",
    "block_runs",
]

_SUPPORTED = (
    "[B, H, N, C] (vLLM 0.31 views of every backend, CPU; block dim 0), "
    "[2, B, N, H, D] / [2, B, H, N, D] (FlashAttention; block dim 1), "
    "[B, 2, N, H, D] / [B, 2, H, N, D] (FlashInfer, Triton; block dim 0), "
    "[B, N, D] (MLA; block dim 0)"
)

# Backends whose older 5-D cache put K/V first: [2, num_blocks, ...].
_KV_FIRST_BACKENDS = frozenset(
    {
        "FLASH_ATTN",
        "FLASH_ATTN_DIFFKV",
        "ROCM_ATTN",
        "ROCM_AITER_FA",
        "CPU_ATTN",
        "TORCH_SDPA",
        "XFORMERS",
        "FLEX_ATTENTION",
    }
)
# Backends whose older 5-D cache put blocks first: [num_blocks, 2, ...].
_BLOCK_FIRST_BACKENDS = frozenset({"FLASHINFER", "TRITON_ATTN", "TRITON_ATTN_DIFFKV", "ROCM_AITER_UNIFIED_ATTN"})


class LayoutError(ValueError):
    """A KV cache tensor cannot be handled as whole pages."""


class AmbiguousLayout(LayoutError):
    """The block dimension cannot be told from the shape alone."""


class LayoutMismatch(LayoutError):
    """A buffer does not match this cache set's geometry; treat it as a miss."""


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group block ids into runs of consecutive ids: ``(first_id, position, length)``.

    One copy per run instead of one per block keeps Python out of the hot path.
    """
    runs: list[tuple[int, int, int]] = []
    start_id = prev = -2
    start_pos = 0
    for pos, bid in enumerate(block_ids):
        bid = int(bid)
        if bid != prev + 1:
            if pos:
                runs.append((start_id, start_pos, pos - start_pos))
            start_id, start_pos = bid, pos
        prev = bid
    if block_ids:
        runs.append((start_id, start_pos, len(block_ids) - start_pos))
    return runs


def _candidate_block_dims(shape: tuple[int, ...]) -> list[int]:
    """Block dims the known layouts allow for a tensor of this rank/shape."""
    if len(shape) in (3, 4):
        return [0]
    if len(shape) == 5:
        return [d for d, two in ((1, shape[0]), (0, shape[1])) if two == 2]
    return []


@dataclass(frozen=True)
class PageLayout:
    """Where the pages of one layer's cache tensor are.

    ``perm`` orders the (grouped) tensor's dims as block dim first, then the page
    dims in storage order; ``page_shape`` is the page in that order. ``group`` > 1
    means vLLM split each manager block into that many kernel blocks along the
    block dim (they are regrouped so one block id is one page).
    """

    block_dim: int
    num_blocks: int
    page_shape: tuple[int, ...]
    perm: tuple[int, ...]
    group: int
    dtype: torch.dtype
    page_nbytes: int

    @classmethod
    def detect(
        cls, tensor: torch.Tensor, block_size: int, *, num_blocks: int | None = None, hint: int | None = None
    ) -> PageLayout:
        """Build the layout of ``tensor``; ``hint`` is an explicit block dim.

        ``block_size`` is tokens per (manager) block; ``num_blocks`` is the
        manager block count when known, which disambiguates shapes and enables
        kernel-block regrouping.
        """
        shape = tuple(tensor.shape)
        if hint is not None:
            if not -len(shape) <= hint < len(shape):
                raise LayoutError(f"block_dim hint {hint} out of range for shape {shape}")
            candidates = [hint % len(shape)]
        else:
            candidates = _candidate_block_dims(shape)
        fits: dict[int, int] = {}
        for bd in candidates:
            group = _group_for(shape, bd, block_size, num_blocks, trust=hint is not None)
            if group is not None:
                fits[bd] = group
        if len(fits) != 1:
            what = "ambiguous" if fits else "unsupported"
            raise (AmbiguousLayout if fits else LayoutError)(
                f"KV cache shape {list(shape)} (block_size={block_size}, "
                f"num_blocks={num_blocks}, hint={hint}) is {what}: candidate "
                f"block dims {sorted(fits) or candidates}. Supported: {_SUPPORTED}. "
                "Pass the attention backend name or an explicit block_dim."
            )
        ((bd, group),) = fits.items()
        return cls._build(tensor, bd, group)

    @classmethod
    def _build(cls, tensor: torch.Tensor, bd: int, group: int) -> PageLayout:
        t = tensor.unflatten(bd, (-1, group)) if group > 1 else tensor
        sizes, strides = t.shape, t.stride()
        page_dims = sorted(
            (d for d in range(t.dim()) if d != bd),
            key=lambda d: (sizes[d] == 1, -strides[d], d),
        )
        perm = (bd, *page_dims)
        page_shape = tuple(int(sizes[d]) for d in page_dims)
        return cls(
            block_dim=bd,
            num_blocks=int(sizes[bd]),
            page_shape=page_shape,
            perm=perm,
            group=group,
            dtype=tensor.dtype,
            page_nbytes=math.prod(page_shape) * tensor.element_size(),
        )

    def pages(self, tensor: torch.Tensor) -> torch.Tensor:
        """View ``tensor`` as ``[num_blocks, *page_shape]`` (no copy)."""
        t = tensor.unflatten(self.block_dim, (-1, self.group)) if self.group > 1 else tensor
        return t.permute(self.perm)

    def describe(self) -> str:
        """Geometry without num_blocks (which differs between instances)."""
        dt = str(self.dtype).removeprefix("torch.")
        page = "x".join(map(str, self.page_shape))
        perm = ".".join(map(str, self.perm))
        return f"bd={self.block_dim},g={self.group},perm={perm},page={page},{dt}"


def _group_for(
    shape: tuple[int, ...],
    bd: int,
    block_size: int,
    num_blocks: int | None,
    *,
    trust: bool = False,
) -> int | None:
    """Kernel blocks per manager block if ``bd`` fits, else None.

    ``trust`` (an explicit block dim) skips the tokens-dim check, for pages whose
    token axis is not ``block_size`` long (compressed or packed states).
    """
    page = shape[:bd] + shape[bd + 1 :]
    if num_blocks is None or shape[bd] == num_blocks:
        return 1 if trust or block_size in page else None
    if num_blocks <= 0 or shape[bd] % num_blocks:
        return None
    group = shape[bd] // num_blocks
    if block_size % group or (block_size // group) not in page:
        return None
    return group


def layout_for_backend(
    backend_name: str | None, tensor: torch.Tensor, block_size: int, *, num_blocks: int | None = None
) -> PageLayout:
    """Layout using the attention backend name to pick the block dim.

    vLLM 0.31 gives every backend a 4-D ``[B, H, N, C]`` view (block dim 0). For
    the older 5-D shapes the name decides between ``[2, B, ...]`` and
    ``[B, 2, ...]``, which shape alone cannot when num_blocks == 2. Unknown names
    fall back to detection.
    """
    name = (backend_name or "").upper()
    hint: int | None = None
    if tensor.dim() in (3, 4) and name:
        hint = 0
    elif tensor.dim() == 5:
        if name in _KV_FIRST_BACKENDS and tensor.shape[0] == 2:
            hint = 1
        elif name in _BLOCK_FIRST_BACKENDS or "MLA" in name:
            hint = 0
    return PageLayout.detect(tensor, block_size, num_blocks=num_blocks, hint=hint)
