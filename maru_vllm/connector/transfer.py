"""How pages move between the paged KV cache and pool objects: torch copies or LMCache's kernel.

Two implementations of `copier.Copier` (which states what a copier does and how it fails),
chosen once per KV cache group by `make_copier`:

* `TorchPageCopier` (every device; the only one on CPU): `KVCacheSet`'s whole-page copies,
  object format ``maru-pages`` (layer after layer, each block's page in its storage order,
  then the format trailer every load checks: object_format.py). On host caches
  those copies go through the fused copy + checksum kernel when it is built and enabled
  (maru_vllm.native, `MARU_NATIVE_COPY`): loads are verified and stores checksummed in the copy.
* `LMCacheBlockCopier` (CUDA, `maru_use_lmcache_kernels: true` and LMCache's compiled
  ``multi_layer_block_kv_transfer`` resolves): one kernel launch moves every layer of a chunk
  (or, for a fused load, of every chunk of the step) between the paged cache and pool objects
  in LMCache's block order (``lmcache-block``: [2,] layers x tokens x heads*head_size, then the
  same format trailer, stating that order), reading and writing the CUDA-registered pool region
  directly (see cuda_host.py). The engine KV format and page geometry come from LMCache's own
  detector, so the kernel gets exactly what LMCache itself would pass. Should a kernel launch
  fail at run time, the copier switches to LMCache's torch implementation of the same kernel
  (same object format), logged once, where the release ships one (0.4.7 and later); on older
  releases every later copy of that worker fails at once (a miss: recomputed, not stored),
  logged once.

Both orders live in one namespace and every load reads the trailer first: an object in the
copier's own format takes its fast path (the kernel only ever reads objects it wrote the way it
reads them); any other object the trailer says it can read (the other copier's order, another
page order, another TP split's heads) goes through `KVCacheSet`'s converting torch copies, and
the rest is a miss. So engines with and without LMCache's kernel, at any TP size, share chunks.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from maru_vllm.connector.copier import Copier, WholeChunk
from maru_vllm.connector.kernels import LMCacheKernels, lmcache_copier_api, resolve_lmcache_kernels
from maru_vllm.connector.layouts import KVCacheSet
from maru_vllm.connector.object_format import TRAILER_BYTES, HeadRange, ObjectFormat, lmcache_format
from maru_vllm.connector.page_layout import LayoutMismatch
from maru_vllm.connector.payload_digests import PayloadDigests
from maru_vllm.pool.objects import checksum_from_digest

logger = logging.getLogger(__name__)

FORMAT_PAGES = "maru-pages"
FORMAT_LMCACHE_BLOCK = "lmcache-block"
# LMCache's compiled block kernel takes at most this many objects per launch.
MAX_OBJECTS_PER_LAUNCH = 4


def block_kernel_available(kernels: LMCacheKernels | None) -> bool:
    return kernels is not None and kernels.multi_layer_block_kv_transfer is not None


def copy_format(device_type: str, use_lmcache_kernels: bool) -> str:
    """The object order an engine on `device_type` with this config writes (for its start-up
    line: it reads every order, object_format.py)."""
    if device_type != "cuda" or not use_lmcache_kernels:
        return FORMAT_PAGES
    return FORMAT_LMCACHE_BLOCK if block_kernel_available(resolve_lmcache_kernels(True)) else FORMAT_PAGES


class TorchPageCopier:
    format = FORMAT_PAGES
    fuses_loads = False  # `unpack_many` is one `unpack` per chunk

    def __init__(self, codec: KVCacheSet) -> None:
        self.codec = codec

    @property
    def object_format(self) -> ObjectFormat | None:
        """The format its objects state (None until the cache set is given one)."""
        return self.codec.format

    @property
    def name(self) -> str:
        """How pages move now (for logs): ``native-<isa>`` (fused copy + checksum) or ``torch``."""
        return self.codec.copy_path()

    def chunk_nbytes(self, n_blocks: int) -> int:
        return self.codec.chunk_nbytes(n_blocks)

    def pack(self, block_ids: Sequence[int], out: Any) -> int | None:
        """Copy the pages into `out`; the payload's checksum when the copy computed it (host caches
        with the fused kernel, see maru_vllm.native), else None."""
        return self.codec.pack_with_checksum(block_ids, out)

    def unpack(
        self,
        block_ids: Sequence[int],
        src: Any,
        *,
        skip_blocks: int = 0,
        chunk_blocks: int | None = None,
        hasher: Any = None,
    ) -> None:
        self.codec.unpack(block_ids, src, skip_blocks=skip_blocks, chunk_blocks=chunk_blocks, hasher=hasher)

    def unpack_many(self, items: Sequence[tuple[Sequence[int], Any, int]]) -> None:
        for block_ids, src, skip in items:
            self.unpack(block_ids, src, skip_blocks=skip)

    def unpack_heads(self, block_ids: Sequence[int], srcs: Sequence[Any], *, skip_blocks: int = 0) -> None:
        self.codec.unpack_heads(block_ids, srcs, skip_blocks=skip_blocks)

    def unpack_whole_many(self, items: Sequence[WholeChunk]) -> list[int | None] | None:
        """Whole chunks into their pages, the step's chunks at once: host caches through the fused
        kernel, GPU caches one DMA per chunk with the payloads hashed on host threads meanwhile.

        On the host the segments of every chunk are planned in one vectorised pass and each
        payload goes straight to the kernel (no torch views, no per-chunk planning): per chunk,
        what is left is one kernel call. Returns, per chunk, the XXH3-64 digest of its whole payload when
        `hashed` (None when not hashed, or when the payload is too short for the kernel's hash:
        verify it another way), or None when these caches cannot batch (use `unpack`).
        Sizes and block ids of every chunk are checked before anything is copied
        (`LayoutMismatch`, `IndexError`).
        """
        return self._whole_many(items, load=True)

    def pack_whole_many(self, items: Sequence[WholeChunk]) -> list[int | None] | None:
        """`pack` of a step's whole chunks at once, like `unpack_whole_many`: per chunk the payload's
        checksum (`objects.payload_checksum`; None when too short for the kernel, then the pool
        client hashes it), or None when these caches cannot use the kernel (use `pack`)."""
        digests = self._whole_many(items, load=False)
        if digests is None:
            return None
        return [None if d is None else checksum_from_digest(d) for d in digests]

    def _whole_many(self, items: Sequence[WholeChunk], *, load: bool) -> list[int | None] | None:
        plan = self.codec.fused_plan()
        if plan is None:
            return self._device_whole_many(items, load=load) if self.codec.device.type != "cpu" else None
        kernel, planner = plan
        what = "unpack" if load else "pack"
        groups: dict[tuple[int, int], list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault((len(item.block_ids), item.skip_blocks), []).append(i)
        planned: list[tuple[int, np.ndarray]] = []
        for (m, skip), members in groups.items():
            ids = np.array([items[i].block_ids for i in members], dtype=np.int64).reshape(len(members), m)
            if ids.size and (ids.min() < 0 or ids.max() >= self.codec.num_blocks):
                raise IndexError(f"{what}: a block id is not in [0, {self.codec.num_blocks})")
            want = self.codec.chunk_nbytes(m + skip)
            for i in members:
                if items[i].payload.nbytes != want:
                    raise LayoutMismatch(f"{what}: buffer has {items[i].payload.nbytes} bytes, {want} expected")
                if load and self.codec.written_format(items[i].payload, what) is not None:
                    raise LayoutMismatch(f"{what}: an object in another page order (read chunk by chunk)")
            planned += zip(members, planner.segments_many(ids, m + skip, skip))
        digests: list[int | None] = [None] * len(items)
        for i, segments in planned:
            if not load:
                self.codec.write_trailer(items[i].payload)  # before the copy hashes the payload
            hashed = items[i].hashed or not load  # a stored payload always gets its checksum
            digest = kernel.copy(items[i].payload, segments, load, hashed)
            digests[i] = digest if hashed else None
        return digests

    def finish(self) -> None:
        """Torch's copies from host memory return once the source was read: nothing to wait for."""

    def _device_whole_many(self, items: Sequence[WholeChunk], *, load: bool) -> list[int | None]:
        """Caches on a GPU: each chunk one DMA each way (`KVCacheSet.staged_pack`), its payload
        hashed on the host threads meanwhile (`PayloadDigests`): a load hashes a chunk while it
        and the next are copied in, a store hashes a chunk once it is out."""
        what = "unpack" if load else "pack"
        for item in items:  # every size, block id and format before the first copy
            self.codec.check_chunk(item.block_ids, item.payload.nbytes, what, item.skip_blocks)
            if load and self.codec.written_format(item.payload, what) is not None:
                raise LayoutMismatch(f"{what}: an object in another page order (read chunk by chunk)")
        digests = PayloadDigests()
        try:
            for item in items:
                if load:
                    digests.add(item.payload if item.hashed else None)
                    self.codec.staged_unpack(item.block_ids, item.payload, skip_blocks=item.skip_blocks)
                else:
                    self.codec.staged_pack(item.block_ids, item.payload)
                    digests.add(item.payload)
        except BaseException:
            digests.wait()  # the caller may unpin the payloads once this returns
            raise
        return digests.results()


class LMCacheBlockCopier:
    """LMCache's ``multi_layer_block_kv_transfer`` over the registered KV caches."""

    format = FORMAT_LMCACHE_BLOCK
    fuses_loads = True  # `unpack_many`: up to MAX_OBJECTS_PER_LAUNCH chunks per kernel launch

    def __init__(
        self,
        kernel: Any,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        block_size: int,
        num_blocks: int,
        blocks_per_chunk: int,
        kv_layout: str | None = None,
        name: str = "lmcache",
        heads: HeadRange | None = None,
        pages: TorchPageCopier | None = None,
    ) -> None:
        """``kv_layout``: vLLM's resolved layout (``KVCacheLayout`` name, e.g. ``LBNHC``). A fused
        K/V page's head and token axes cannot be told apart by shape, so LMCache reads them by it;
        None leaves LMCache's platform default (heads first on CPU, tokens first elsewhere).
        ``heads``: the KV heads these caches hold (default: all of a model with the caches' head
        count). ``pages``: the torch copies over the same caches, for objects not in this copier's
        own format (without: those are misses)."""
        self._api = lmcache_copier_api()  # the installed release's helpers (kernels.py); ImportError: none
        self.name = name
        unique: dict[int, torch.Tensor] = {}
        for t in kv_caches.values():
            unique.setdefault(t.data_ptr(), t)
        layers = list(unique.values())
        self.device = layers[0].device
        self.dtype = layers[0].dtype
        # NotImplementedError: a layout this release cannot copy.
        self.engine_format, self.paged = self._api.detect(layers, kv_layout)
        self.num_layers = len(layers)
        self.block_size = block_size
        self.chunk_tokens = block_size * blocks_per_chunk
        self.shape_desc = self._api.shape_desc(self.paged, self.engine_format, self.num_layers, num_blocks, block_size)
        d = self.shape_desc
        width = int(d.nh) * int(d.hs)
        self._tokens_shape = ((2, self.num_layers) if int(d.kv_size) == 2 else (self.num_layers,), width)
        self.bytes_per_token = int(d.kv_size) * self.num_layers * width * self.dtype.itemsize
        nh = int(d.nh)
        own_heads = heads if heads is not None else HeadRange(0, nh, nh)
        _check_kv_order(self.engine_format, int(d.kv_size), own_heads.mla)
        self.object_format = lmcache_format(
            self.dtype, self.num_layers, own_heads, block_size, nh, int(d.hs), int(d.kv_size)
        )
        self._trailer = self.object_format.trailer()
        self._pages = pages
        if pages is not None:  # LMCache's reading of the caches must be the one vLLM laid out
            span = own_heads.hi - own_heads.lo
            if self.chunk_nbytes(1) != pages.chunk_nbytes(1) or (span and nh != span):
                raise LayoutMismatch(
                    f"LMCache's kernel reads these caches as {self.object_format.describe()}, but vLLM "
                    f"laid them out as {pages.codec.layout_signature()} holding {span} KV heads"
                )
        self._kernel = kernel
        self._compiled = _is_compiled(kernel)
        # Set when the compiled kernel failed and this LMCache release has no torch version of it.
        self._broken: str | None = None
        self._ptrs = None
        if self._compiled:
            import numpy as np

            ptrs = np.array(
                self._api.group_ptrs(self.paged, self.engine_format, self.num_layers), dtype=np.uint64
            ).view(np.int64)
            self._ptrs = torch.from_numpy(ptrs).to(self.device)

    def chunk_nbytes(self, n_blocks: int) -> int:
        return n_blocks * self.block_size * self.bytes_per_token + TRAILER_BYTES

    def _object(self, buf: Any, n_blocks: int) -> torch.Tensor:
        """A pool buffer's payload (its trailer left out) as the CPU tensor LMCache's object
        format expects (no copy)."""
        mv = _bytes(buf)
        if mv.nbytes != self.chunk_nbytes(n_blocks):
            raise LayoutMismatch(f"object has {mv.nbytes} bytes, {n_blocks} blocks need {self.chunk_nbytes(n_blocks)}")
        lead, width = self._tokens_shape
        flat = torch.frombuffer(mv, dtype=torch.uint8)[: mv.nbytes - TRAILER_BYTES]
        return flat.view(self.dtype).view(*lead, n_blocks * self.block_size, width)

    def _own(self, buf: Any) -> bool:
        """Whether the object is in this copier's own format (its trailer, 64 bytes compared)."""
        mv = _bytes(buf)
        return mv.nbytes >= TRAILER_BYTES and mv[-TRAILER_BYTES:] == self._trailer

    def _other(self) -> TorchPageCopier:
        """The torch copies for an object in another format (LayoutMismatch: none, a miss)."""
        if self._pages is None:
            raise LayoutMismatch(f"the object is not in this copier's format ({self.object_format.describe()})")
        return self._pages

    def pack(self, block_ids: Sequence[int], out: Any) -> int | None:
        """A DMA copy on the device: no checksum computed on the way (the pool client hashes)."""
        obj = self._object(out, len(block_ids))
        _bytes(out)[-TRAILER_BYTES:] = self._trailer  # bytes the kernel does not write
        self._launch([obj], list(block_ids), store=True, skip=0)
        return None

    def unpack(
        self,
        block_ids: Sequence[int],
        src: Any,
        *,
        skip_blocks: int = 0,
        chunk_blocks: int | None = None,
        hasher: Any = None,
    ) -> None:
        if not self._own(src):  # another copier's order, page order or TP split: converted copies
            self._other().unpack(block_ids, src, skip_blocks=skip_blocks, chunk_blocks=chunk_blocks, hasher=hasher)
            return
        if hasher is not None:  # the kernel reads the object itself: hash it in one pass first
            hasher.update(src if isinstance(src, memoryview) else memoryview(src))
        # The kernel indexes block ids by position in the object; the skipped leading positions
        # are never read, any valid id fills them.
        ids = [int(block_ids[0])] * skip_blocks + list(block_ids) if block_ids else []
        used = len(block_ids) + skip_blocks
        obj = self._object(src, chunk_blocks or used)
        if chunk_blocks and chunk_blocks != used:
            # A chunk shared in part: its leading blocks only. The object is token-major, so their
            # tokens are a strided slice of every layer; the kernel wants one contiguous object.
            obj = obj[..., : used * self.block_size, :].contiguous()
        self._launch([obj], ids, store=False, skip=skip_blocks)

    def unpack_heads(self, block_ids: Sequence[int], srcs: Sequence[Any], *, skip_blocks: int = 0) -> None:
        """Objects of a finer TP split, in either order: the torch copies assemble this rank's heads."""
        self._other().unpack_heads(block_ids, srcs, skip_blocks=skip_blocks)

    def unpack_many(self, items: Sequence[tuple[Sequence[int], Any, int]]) -> None:
        """Fused load: every whole chunk of the step in one launch (a partial first chunk, and
        objects in another format, one by one)."""
        whole: list[tuple[Sequence[int], Any]] = []
        for ids, src, skip in items:
            if skip == 0 and self._own(src):
                whole.append((ids, src))
            else:
                self.unpack(ids, src, skip_blocks=skip)
        if not whole:
            return
        sizes = {len(ids) for ids, _ in whole}
        if len(sizes) != 1 or sizes.pop() * self.block_size != self.chunk_tokens:
            for ids, src in whole:
                self.unpack(ids, src)
            return
        for i in range(0, len(whole), MAX_OBJECTS_PER_LAUNCH if self._compiled else len(whole)):
            group = whole[i : i + (MAX_OBJECTS_PER_LAUNCH if self._compiled else len(whole))]
            self._launch(
                [self._object(src, len(ids)) for ids, src in group],
                [b for ids, _ in group for b in ids],
                store=False,
                skip=0,
            )

    def unpack_whole_many(self, items: Sequence[WholeChunk]) -> list[int | None] | None:
        """No batched host path here: the kernel reads device-registered objects (use `unpack_many`)."""
        return None

    def pack_whole_many(self, items: Sequence[WholeChunk]) -> list[int | None] | None:
        """No batched host path here (use `pack`)."""
        return None

    def finish(self) -> None:
        """Wait until launched kernels have read the pool objects (before their pins are released)."""
        if self._compiled and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _launch(self, objects: list[torch.Tensor], block_ids: list[int], *, store: bool, skip: int) -> None:
        directions = self._api.TransferDirection
        direction = directions.D2H if store else directions.H2D
        args: tuple[Any, ...]
        if self._compiled:
            args = (
                self._ptrs,
                [o.data_ptr() for o in objects],
                torch.tensor(block_ids, dtype=torch.int64, device=self.device),
            )
        else:
            args = (self.paged, objects, block_ids)
        tokens_per_object = objects[0].shape[-2]
        if self._broken is not None:  # no fallback in this release: every copy is a miss, at once
            raise RuntimeError(self._broken)
        try:
            self._kernel(*args, self.device, direction, self.shape_desc, tokens_per_object, self.engine_format, skip)
        except (RuntimeError, TypeError, ValueError) as exc:
            if not self._compiled:
                raise RuntimeError(f"LMCache's torch block kernel failed: {exc}") from exc
            fallback, where = self._api.torch_block_kernel()
            if fallback is None:
                self._broken = f"LMCache block kernel failed ({exc}); {where}"
                logger.error("%s: every copy of this worker is now a miss (recomputed, not stored)", self._broken)
                raise RuntimeError(self._broken) from exc
            logger.warning(
                "LMCache block kernel failed (%s); using LMCache's torch implementation of it "
                "(%s) from now on (same object format)",
                exc,
                where,
            )
            self._kernel, self._compiled, self.name = fallback, False, "lmcache-torch"
            self._launch(objects, block_ids, store=store, skip=skip)


def _check_kv_order(engine_format: Any, kv_size: int, mla: bool) -> None:
    """The object order `lmcache_format` states for `kv_size` must be the one LMCache's kernel
    uses for this engine format: K and V apart (a ``TWO`` in the format's name) with a `kv_size`
    of 2, one fused K|V per head (``CS``) or MLA's latent with 1. LayoutMismatch otherwise."""
    name = str(getattr(engine_format, "name", engine_format))
    parts = name.split("_")
    expect = 1 if mla else 2 if "TWO" in parts else 1 if "CS" in parts else 0
    if expect == 0 or kv_size != expect:
        raise LayoutMismatch(
            f"LMCache's kernel copies engine format {name} with K/V size {kv_size}: an object order "
            "this connector does not describe"
        )


def _bytes(buf: Any) -> memoryview:
    """A buffer's bytes as a flat memoryview."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _is_compiled(fn: Any) -> bool:
    """A pybind/C++ binding (takes device pointers) rather than a Python function (takes tensors)."""
    return isinstance(fn, types.BuiltinFunctionType) or not isinstance(fn, types.FunctionType)


def make_copier(
    codec: KVCacheSet,
    kv_caches: Mapping[str, torch.Tensor],
    kernels: LMCacheKernels | None,
    *,
    block_size: int,
    num_blocks: int,
    blocks_per_chunk: int,
    kv_layout: str | None = None,
) -> Copier:
    """The copier for these caches: LMCache's block kernel on CUDA when it resolved, else torch."""
    pages = TorchPageCopier(codec)
    if codec.device.type == "cuda" and block_kernel_available(kernels):
        assert kernels is not None and kernels.multi_layer_block_kv_transfer is not None
        try:
            return LMCacheBlockCopier(
                kernels.multi_layer_block_kv_transfer,
                kv_caches,
                block_size=block_size,
                num_blocks=num_blocks,
                blocks_per_chunk=blocks_per_chunk,
                kv_layout=kv_layout,
                heads=None if codec.format is None else codec.format.heads,
                pages=pages,
            )
        except LayoutMismatch as exc:
            logger.warning("%s; copying with torch instead of LMCache's kernel", exc)
    return pages
