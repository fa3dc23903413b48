"""What a pool object's bytes mean: the format trailer every connector object ends with.

An object's bytes are in the order its writer's copier made them: layer after layer of the
storing engine's pages (the torch copies, layouts.py), or LMCache's block order (LMCache's
kernel, transfer.py). Two engines of one model may lay their pages out differently (heads before
tokens or after, K/V fused into one axis or split into an axis of their own, kernel blocks) or
copy with different copiers and still share a namespace, so the object says how its bytes are
ordered and every load checks it before it copies anything:

* the same format as the reader's: the pages are copied as they are (the fast path; comparing
  64 bytes is all it costs);
* the same logical content in another order (same dtype, layer count, kernel-block split, KV
  head range, and the same axes with the same sizes): the pages are permuted into the reader's
  order while they are copied, bit for bit;
* anything else (another dtype or head range, axes that do not match, an older object without a
  trailer, a trailer this code does not know): a miss, recomputed, with one line naming both
  formats. Bytes are never read in an order they were not written in.

The trailer is the payload's last `TRAILER_BYTES`, after the pages, so page offsets stay what
they were and the payload checksum covers it (the fused kernel hashes payload bytes it does not
copy). Everything little-endian::

    offset  size  field
    0       4     magic b"MKVF"
    4       2     FORMAT_VERSION
    6       1     kind: 1 K/V heads, 2 MLA latent, 3 opaque (pages not described axis by axis)
    7       1     dtype code (`_DTYPES`)
    8       2     unique layers in the object
    10      1     object order: 0 layer after layer of pages ``[layers, blocks, *page axes]``;
                  1 LMCache's block order: ``[kv, layers, blocks, *the other page axes]``
                  when the page axes start with ``kv`` (K and V apart), else
                  ``[layers, blocks, *page axes]`` (blocks then being tokens of the object)
    11      1     0
    12      2     kernel blocks per block (vLLM's kernel-block split)
    14      2     first KV head this object holds
    16      2     one past its last KV head
    18      2     the model's KV heads (1 for MLA: the latent, whole on every rank)
    20      4     opaque kind: a digest of the layout signature; else 0
    24      8     page axes in storage order, one code each (`_AXES`; 0 ends the list)
    32      32    their sizes, uint32 each

Bytes 8-11 were one 4-byte layer count before the order byte: a reader that predates it reads
an LMCache-order object as one with 65,536 more layers than it has, a miss, and objects of
layer order read the same either way.

Axes of size 1 are left out (where they sit does not move a byte). vLLM 0.31's 4-D views
``[B, H, N, C]`` keep K then V in C, so a C of K/V heads is written as a ``kv`` axis of 2 over a
``dim`` axis: a fused page and a split one describe the same axes.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from maru_vllm.connector.chunks import rank_heads
from maru_vllm.connector.page_layout import LayoutMismatch, PageLayout

FORMAT_VERSION = 2  # 1: pages without a trailer
TRAILER_BYTES = 64
MAGIC = b"MKVF"
KIND_KV, KIND_MLA, KIND_OPAQUE = 1, 2, 3
ORDER_PAGES, ORDER_LMCACHE = 0, 1
_ORDERS = {ORDER_PAGES: "pages", ORDER_LMCACHE: "lmcache-block"}
_KINDS = {KIND_KV: "kv", KIND_MLA: "mla", KIND_OPAQUE: "opaque"}
_AXES = {"kv": 1, "tokens": 2, "heads": 3, "dim": 4, "latent": 5, "tgroup": 6, "kvdim": 7}
_AXIS_NAMES = {v: k for k, v in _AXES.items()}
_DTYPE_NAMES = (
    "float16",
    "bfloat16",
    "float32",
    "uint8",
    "int8",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float64",
)
_DTYPES = {getattr(torch, n): i + 1 for i, n in enumerate(_DTYPE_NAMES) if hasattr(torch, n)}
_DTYPE_BY_CODE = {v: k for k, v in _DTYPES.items()}
_HEAD = struct.Struct("<4sHBBHBBHHHHI8s8I")
assert _HEAD.size == TRAILER_BYTES

# The logical dims of each cache tensor shape vLLM hands over, by (rank, block dim); "C" is the
# last dim of a 4-D view or a 3-D MLA cache: K then V (kind kv) or the latent (MLA).
_DIM_NAMES = {
    (4, 0): ("block", "heads", "tokens", "C"),
    (5, 1): ("kv", "block", "tokens", "heads", "dim"),
    (5, 0): ("block", "kv", "tokens", "heads", "dim"),
    (3, 0): ("block", "tokens", "C"),
}


@dataclasses.dataclass(frozen=True)
class HeadRange:
    """The KV heads a rank's pages hold: ``[lo, hi)`` of the model's ``total`` (MLA: 0, 1, 1)."""

    lo: int
    hi: int
    total: int
    mla: bool = False

    @classmethod
    def for_rank(cls, total: int, tp_size: int, tp_rank: int, mla: bool = False) -> HeadRange:
        """vLLM's split: ``total / tp`` heads per rank, or one replicated head when ``total < tp``."""
        if mla:
            return cls(0, 1, 1, True)
        lo, hi = rank_heads(total, tp_size, tp_rank)
        return cls(lo, hi, max(1, int(total)))


@dataclasses.dataclass(frozen=True)
class ObjectFormat:
    """How one engine's objects are laid out (see the module docstring)."""

    kind: int
    dtype: int
    layers: int
    group: int
    heads: HeadRange
    axes: tuple[tuple[str, int], ...] = ()
    opaque_digest: int = 0
    version: int = FORMAT_VERSION
    order: int = ORDER_PAGES

    def trailer(self) -> bytes:
        codes = bytes(_AXES[name] for name, _ in self.axes).ljust(8, b"\0")
        sizes = [size for _, size in self.axes] + [0] * (8 - len(self.axes))
        h = self.heads
        return _HEAD.pack(
            MAGIC,
            self.version,
            self.kind,
            self.dtype,
            self.layers,
            self.order,
            0,
            self.group,
            h.lo,
            h.hi,
            h.total,
            self.opaque_digest,
            codes,
            *sizes,
        )

    @classmethod
    def from_trailer(cls, raw: bytes) -> ObjectFormat:
        """The format a trailer states; LayoutMismatch when it is not one this code reads."""
        if len(raw) != TRAILER_BYTES or raw[:4] != MAGIC:
            raise LayoutMismatch("the object has no format trailer (an older object format)")
        _m, version, kind, dtype, layers, order, spare, group, lo, hi, total, digest, codes, *sizes = _HEAD.unpack(raw)
        if version != FORMAT_VERSION:
            raise LayoutMismatch(f"object format version {version} is not supported (supported: {FORMAT_VERSION})")
        if order not in _ORDERS or spare:
            raise LayoutMismatch(f"the object's byte order {order}.{spare} is not one this code reads")
        n = codes.find(b"\0") if b"\0" in codes else 8
        if kind not in _KINDS or any(c not in _AXIS_NAMES for c in codes[:n]) or any(codes[n:]):
            raise LayoutMismatch(f"the object's format trailer is malformed (kind {kind}, axes {codes.hex()})")
        axes = tuple((_AXIS_NAMES[c], s) for c, s in zip(codes[:n], sizes))
        heads = HeadRange(lo, hi, total, kind == KIND_MLA)
        fmt = cls(kind, dtype, layers, group, heads, axes, digest, version, order)
        if order == ORDER_LMCACHE and kind == KIND_OPAQUE:
            raise LayoutMismatch(f"the object's format trailer is malformed ({fmt.describe()})")
        return fmt

    def describe(self) -> str:
        dt = _DTYPE_BY_CODE.get(self.dtype)
        dtype = str(dt).removeprefix("torch.") if dt is not None else f"dtype#{self.dtype}"
        if self.kind == KIND_OPAQUE:
            order = f"opaque pages #{self.opaque_digest:08x}"
        else:
            order = "[" + ", ".join(f"{n}={s}" for n, s in self.axes) + "]"
        if self.order != ORDER_PAGES:
            order = f"{_ORDERS.get(self.order, self.order)} {order}"
        h = self.heads
        return (
            f"v{self.version} {_KINDS.get(self.kind, self.kind)} {order} {dtype} layers={self.layers} "
            f"g={self.group} heads={h.lo}-{h.hi}/{h.total}"
        )

    def conversion_problem(self, written: ObjectFormat, heads: tuple[int, int] | None = None) -> str | None:
        """None when the KV heads ``heads`` (default: all of this format's) can be read out of an
        object in `written` format into this format's pages, bit for bit (the same content in
        another order, or a range of the writer's heads), else why not."""
        lo, hi = heads if heads is not None else (self.heads.lo, self.heads.hi)
        if written == self and (lo, hi) == (self.heads.lo, self.heads.hi):
            return None
        if KIND_OPAQUE in (self.kind, written.kind):
            return "the pages are not described axis by axis"
        same = (written.kind, written.dtype, written.layers, written.group, written.heads.total)
        if same != (self.kind, self.dtype, self.layers, self.group, self.heads.total):
            return "another kind, dtype, layer count, kernel-block split or model head count"
        if not (written.heads.lo <= lo < hi <= written.heads.hi and self.heads.lo <= lo and hi <= self.heads.hi):
            return f"KV heads {lo}-{hi} are not in the object's {written.heads.lo}-{written.heads.hi}"
        if self.kind == KIND_MLA and written.heads != self.heads:
            return "another MLA head range"
        if _without_heads(written.axes) != _without_heads(self.axes) or len({n for n, _ in self.axes}) != len(
            self.axes
        ):
            return "the page axes differ"
        if (written.bytes_per_head_page() or 0) == 0:
            return "the object's pages are empty"
        return None

    def bytes_per_head_page(self) -> int:
        """Elements of one page per KV head the object holds (its pages scale with its heads)."""
        count = self.heads.hi - self.heads.lo
        elems = 1
        for _, size in self.axes:
            elems *= size
        return elems // count if count > 0 else 0


def _without_heads(axes: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    return sorted(a for a in axes if a[0] != "heads")


def _c_axes(size: int, mla: bool) -> list[tuple[str, int]]:
    """The logical axes of a last dim "C" of `size`: MLA's latent, or K then V (a ``kv`` axis of 2
    over a ``dim`` axis; ``kvdim`` when it does not halve)."""
    if mla:
        return [("latent", size)]
    return [("kv", 2), ("dim", size // 2)] if size % 2 == 0 else [("kvdim", size)]


def _page_axes(lay: PageLayout, mla: bool) -> tuple[tuple[str, int], ...] | None:
    """The page's logical axes in storage order (size-1 axes left out); None when unknown."""
    rank = len(lay.perm) - (1 if lay.group > 1 else 0)
    names = _DIM_NAMES.get((rank, lay.block_dim))
    if names is None:
        return None
    names_l = list(names)
    if lay.group > 1:
        names_l.insert(lay.block_dim + 1, "tgroup")
    axes: list[tuple[str, int]] = []
    for d, size in zip(lay.perm[1:], lay.page_shape):
        name = names_l[d]
        if name == "C":
            c_axes = _c_axes(int(size), mla)
            if len(c_axes) > 1:
                axes += c_axes
                continue
            ((name, size),) = c_axes
        if size != 1:
            axes.append((name, int(size)))
    return tuple(axes)


def format_of(layouts: Sequence[PageLayout], signature: str, heads: HeadRange) -> ObjectFormat:
    """The format of objects made from these unique layers' pages (in object order)."""
    first = layouts[0]
    dtype = _DTYPES.get(first.dtype, 0)
    axes = _page_axes(first, heads.mla)
    same = all(lay.describe() == first.describe() for lay in layouts)
    kind = KIND_MLA if heads.mla else KIND_KV
    if axes is None or not same or len(axes) > 8 or dtype == 0:
        digest = xxhash.xxh32_intdigest(signature.encode())
        return ObjectFormat(KIND_OPAQUE, dtype, len(layouts), first.group, heads, (), digest)
    return ObjectFormat(kind, dtype, len(layouts), first.group, heads, axes)


def read_format(payload: Any) -> ObjectFormat:
    """The format the trailer of `payload` (a flat uint8 tensor) states (LayoutMismatch if none)."""
    if payload.numel() < TRAILER_BYTES:
        raise LayoutMismatch(f"a payload of {payload.numel()} bytes has no format trailer")
    return ObjectFormat.from_trailer(payload[-TRAILER_BYTES:].numpy().tobytes())


def page_dim_of(lay: PageLayout, axis: str, mla: bool) -> int | None:
    """Which dim of ``lay.page_shape`` is logical axis `axis` (e.g. "heads"), None when none is."""
    rank = len(lay.perm) - (1 if lay.group > 1 else 0)
    names = list(_DIM_NAMES.get((rank, lay.block_dim), ()))
    if not names:
        return None
    if lay.group > 1:
        names.insert(lay.block_dim + 1, "tgroup")
    page_names = [names[d] for d in lay.perm[1:]]
    return page_names.index(axis) if axis in page_names else None


def converted_pages(
    pages: torch.Tensor,
    written: ObjectFormat,
    own: ObjectFormat,
    page_shape: Sequence[int],
    heads: tuple[int, int] | None = None,
) -> torch.Tensor:
    """One layer's ``[n, *written page]`` pages as ``[n, *page_shape]`` in `own`'s order, holding
    the KV heads ``heads`` (default: all of `own`'s; `page_shape` then has that many heads)."""
    lo, hi = heads if heads is not None else (own.heads.lo, own.heads.hi)
    n = pages.shape[0]
    src = pages.reshape(n, *(s for _, s in written.axes))
    names = [name for name, _ in written.axes]
    if "heads" in names:
        at = 1 + names.index("heads")
        src = src.narrow(at, lo - written.heads.lo, hi - lo)
        if hi - lo == 1:
            src = src.squeeze(at)
            names.remove("heads")
    order = [0] + [1 + names.index(name) for name, _ in own.axes if name in names]
    return src.permute(order).reshape(n, *page_shape)


def lmcache_format(
    dtype: torch.dtype, layers: int, heads: HeadRange, block_size: int, head_count: int, head_size: int, kv_size: int
) -> ObjectFormat:
    """The format of LMCache's block objects, from its shape descriptor (`head_count` x
    `head_size` per token, `kv_size` 2 when K and V are apart), stated as pages of `block_size`
    tokens (axes of size 1 left out, as for pages):

    * K and V apart (``kv_size`` 2): ``[2, layers, tokens, heads, head_size]``;
    * one fused K|V per head (vLLM 0.31's ``[B, H, N, C]``, ``kv_size`` 1): ``[layers, tokens,
      heads, C]``, C being K then V, as in the pages;
    * MLA (``heads.mla``): ``[layers, tokens, latent]``.
    """
    axes: list[tuple[str, int]]
    if heads.mla:
        axes = [("tokens", block_size), *_c_axes(head_count * head_size, True)]
    elif kv_size == 2:
        axes = [("kv", 2), ("tokens", block_size), ("heads", head_count), ("dim", head_size)]
    else:
        axes = [("tokens", block_size), ("heads", head_count), *_c_axes(head_size, False)]
    kind = KIND_MLA if heads.mla else KIND_KV
    kept = tuple((name, int(size)) for name, size in axes if size != 1)
    return ObjectFormat(kind, _DTYPES.get(dtype, 0), layers, 1, heads, kept, order=ORDER_LMCACHE)


def lmcache_layer_pages(payload: torch.Tensor, written: ObjectFormat, n: int) -> list[torch.Tensor]:
    """Each layer's pages ``[n, *written page axes]`` of an LMCache-order object of `n` blocks
    (`payload`: its elements, typed, without the trailer), as strided views of it."""
    sizes = [size for _, size in written.axes]
    if written.axes and written.axes[0][0] == "kv":
        obj = payload.view(sizes[0], written.layers, n, *sizes[1:])
        return [obj[:, layer].movedim(0, 1) for layer in range(written.layers)]
    obj = payload.view(written.layers, n, *sizes)
    return [obj[layer] for layer in range(written.layers)]
