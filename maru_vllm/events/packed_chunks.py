"""A snapshot page of binary chunk metadata as arrays, and its stores as ready-made vLLM events.

A resync of 10^6 chunks cannot afford Python objects per chunk and token: the relay's share
must stay within a few microseconds per chunk. `ChunkColumns.of` reads the headers of a whole
page of binary chunk metadata (`maru_vllm.pool.chunk_codec`) at once with numpy, and keeps the
chunks that share one geometry (block size, blocks per chunk, hash length, no LoRA, no cache salt) as arrays:
block hashes as vLLM announces int hashes (their low 64 bits), parents, token ids. Everything
else (another geometry, a LoRA name, a cache salt, a malformed value, bytes hashes) is left to the per-chunk
path, which reads it or refuses it exactly as before.

`ChunkStores` announces a run of such chunks, each stored whole; `vllm_format` encodes it as
vLLM's `BlockStored` msgpack maps (the bytes msgspec writes for vLLM's struct, with every int
at full width: block hashes as uint64, token ids as uint32, which every msgpack reader decodes
to the same values), built as one byte matrix per run and spliced into `KVEventBatch` payloads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec
import numpy as np

from maru_vllm.events.types import BlocksStored
from maru_vllm.pool import chunk_codec as C

_HEADER = np.dtype(
    [
        ("magic", "<u4"),
        ("v", "<u2"),
        ("rank", "<u2"),
        ("chunk", "<u4"),
        ("block_size", "<u4"),
        ("nblocks", "<u4"),
        ("hash_len", "<u2"),
        ("flags", "u1"),
        ("zero", "u1"),
        ("lora_len", "<u2"),
        ("salt_len", "<u2"),
        ("pad", "V4"),
    ]
)
assert _HEADER.itemsize == C.HEADER_SIZE
_MAGIC = int.from_bytes(C.MAGIC, "little")
_VERSIONS = np.array(sorted(C.SUPPORTED_CHUNK_META_VERSIONS), dtype=np.uint16)


@dataclasses.dataclass
class ChunkColumns:
    """Chunks of one geometry from one page; row i is `metas[rows[i]]` of `ChunkColumns.of`."""

    rows: np.ndarray  # int64 (n,)
    chunk_index: np.ndarray  # int64 (n,)
    hashes: np.ndarray  # uint64 (n, blocks): each block's hash as vLLM announces it (int)
    has_parent: np.ndarray  # bool (n,)
    parent: np.ndarray  # uint64 (n,), 0 where there is none
    tokens: np.ndarray  # uint32 (n, blocks * block_size)
    block_size: int

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def of(cls, metas: Sequence[bytes], block_size: int | None) -> ChunkColumns | None:
        """The chunks of `metas` (binary chunk metadata) that share the first well-formed one's
        geometry (and `block_size`, when given); None when there are none. Rows not taken are
        for the per-chunk path."""
        n = len(metas)
        if n == 0:
            return None
        lengths = np.fromiter(map(len, metas), dtype=np.int64, count=n)
        if (lengths < C.HEADER_SIZE).any() or (lengths % 4).any():
            keep = (lengths >= C.HEADER_SIZE) & (lengths % 4 == 0)
            rows = np.flatnonzero(keep)
            metas = [metas[i] for i in rows.tolist()]
            lengths = lengths[rows]
        else:
            rows = np.arange(n, dtype=np.int64)
        if len(rows) == 0:
            return None
        buf = np.frombuffer(b"".join(metas), dtype=np.uint8)
        starts = np.cumsum(lengths) - lengths
        head = buf[starts[:, None] + np.arange(C.HEADER_SIZE)].view(_HEADER).reshape(-1)
        ok = (head["magic"] == _MAGIC) & np.isin(head["v"], _VERSIONS)
        ok &= (head["lora_len"] == 0) & (head["salt_len"] == 0)
        ok &= (head["flags"] & ~np.uint8(C.FLAG_PARENT)) == 0
        first = np.flatnonzero(ok & (head["nblocks"] > 0) & (head["hash_len"] % 8 == 0) & (head["hash_len"] > 0))
        if block_size is not None:
            first = first[head["block_size"][first] == block_size]
        if len(first) == 0:
            return None
        f = head[first[0]]
        bs, nb, hl = int(f["block_size"]), int(f["nblocks"]), int(f["hash_len"])
        if bs < 1 or hl > C.MAX_HASH_BYTES:
            return None
        ok &= (head["block_size"] == bs) & (head["nblocks"] == nb) & (head["hash_len"] == hl)
        has_parent = (head["flags"] & C.FLAG_PARENT) != 0
        body = nb * hl + np.where(has_parent, hl, 0)
        token_at = C.HEADER_SIZE + body + (-body % 4)
        ok &= lengths == token_at + 4 * nb * bs
        take = np.flatnonzero(ok)
        if len(take) == 0:
            return None
        starts, has_parent, token_at = starts[take], has_parent[take], token_at[take]
        low = starts[:, None] + C.HEADER_SIZE + (np.arange(1, nb + 1) * hl - 8)  # each hash's last 8 bytes
        hashes = buf[low[:, :, None] + np.arange(8)].view(">u8").reshape(len(take), nb).astype(np.uint64)
        parent_low = starts + C.HEADER_SIZE + nb * hl + hl - 8
        parent = buf[parent_low[:, None] + np.arange(8)].view(">u8").reshape(-1).astype(np.uint64)
        parent[~has_parent] = 0
        words = buf.view("<u4")
        tokens = words[((starts + token_at) // 4)[:, None] + np.arange(nb * bs)]
        return cls(
            rows=rows[take],
            chunk_index=head["chunk"][take].astype(np.int64),
            hashes=hashes,
            has_parent=has_parent,
            parent=parent,
            tokens=tokens.astype(np.uint32, copy=False),
            block_size=bs,
        )

    def take(self, idx: np.ndarray | slice) -> ChunkColumns:
        """The rows `idx` (an index or mask array, in that order; or a slice, as views)."""
        return ChunkColumns(
            self.rows[idx],
            self.chunk_index[idx],
            self.hashes[idx],
            self.has_parent[idx],
            self.parent[idx],
            self.tokens[idx],
            self.block_size,
        )


@dataclasses.dataclass(frozen=True)
class StoreTemplate:
    """The constant bytes of a `BlockStored` msgpack map for one block size, medium and LoRA:
    `prefix` up to the block_hashes array, the keys before the parent and the token ids, and
    the `suffix` after the token ids."""

    prefix: bytes
    parent_key: bytes
    tokens_key: bytes
    suffix: bytes


def _uint_header(n: int) -> bytes:
    """msgpack array header for `n` elements."""
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


@dataclasses.dataclass(frozen=True)
class ChunkStores:
    """Announce: the chunks of `cols` are stored, each whole (one `BlockStored` per chunk,
    chained on its parent); all rows with a parent, or all without."""

    cols: ChunkColumns

    @property
    def block_count(self) -> int:
        return self.cols.hashes.size

    def split(self, max_blocks: int) -> list[ChunkStores]:
        per = max(1, max_blocks // max(1, self.cols.hashes.shape[1]))
        n = len(self.cols)
        if n <= per:
            return [self]
        return [ChunkStores(self.cols.take(slice(i, i + per))) for i in range(0, n, per)]

    def announcements(self) -> list[BlocksStored]:
        """The same stores as `BlocksStored` (what `raw_events` encodes; the slow, general form)."""
        cols = self.cols
        out = []
        for i in range(len(cols)):
            hashes = tuple(cols.hashes[i].tolist())
            parent = int(cols.parent[i]) if cols.has_parent[i] else None
            out.append(BlocksStored(hashes, parent, cols.tokens[i], cols.block_size))
        return out

    def raw_events(self, template: StoreTemplate) -> list[msgspec.Raw]:
        """Each chunk's `BlockStored` as msgpack, laid out as `template` says (see module docstring)."""
        cols = self.cols
        n, nb = cols.hashes.shape
        if n == 0:
            return []
        ntok = cols.tokens.shape[1]
        parts: list[np.ndarray] = []

        def const(b: bytes) -> None:
            parts.append(np.broadcast_to(np.frombuffer(b, dtype=np.uint8), (n, len(b))))

        def ints(marker: int, values: np.ndarray, width: str) -> None:
            k = values.shape[1]
            size = np.dtype(width).itemsize
            cell = np.empty((n, k, 1 + size), dtype=np.uint8)
            cell[:, :, 0] = marker
            cell[:, :, 1:] = values.astype(width).view(np.uint8).reshape(n, k, size)
            parts.append(cell.reshape(n, k * (1 + size)))

        const(template.prefix + _uint_header(nb))
        ints(0xCF, cols.hashes, ">u8")
        const(template.parent_key)
        if cols.has_parent[0]:
            ints(0xCF, cols.parent[:, None], ">u8")
        else:
            const(b"\xc0")
        const(template.tokens_key + _uint_header(ntok))
        ints(0xCE, cols.tokens, ">u4")
        const(template.suffix)
        records = np.concatenate(parts, axis=1)
        data, width = records.tobytes(), records.shape[1]
        return [msgspec.Raw(data[i : i + width]) for i in range(0, len(data), width)]
