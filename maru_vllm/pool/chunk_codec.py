"""The chunk contract: what MaruKVConnector commits with each chunk, and its encodings.

Every side that writes or reads a chunk's metadata uses this module, and only it: the connector
builds a `ChunkMeta` per chunk under a namespace that starts with `model_namespace_prefix`; the
pool stores it opaquely (it checks only the binary form's layout at commit); event relays decode
it (`decode_chunk_meta`, either form) into router events. It depends on nothing of the pool but
the wire's error type and binary-metadata prefix (`messages`).

The compact binary encoding below is the form the pool stores and serves.

A chunk's JSON metadata is ~2 KiB, most of it ~256 token ids as decimal text, and parsing that
text back into ints was most of a relay's resync. The binary form is a fixed header followed by
raw arrays, so a reader slices it instead of parsing it:

```
offset  size                 field
0       4                    magic b"MKC" + FORMAT (the layout version; 1)
4       2                    ChunkMeta.v (the metadata version, `SUPPORTED_CHUNK_META_VERSIONS`)
6       2                    rank
8       4                    chunk
12      4                    block_size
16      4                    nblocks (len(block_hashes), >= 1)
20      2                    hash_len (bytes per block hash, 1..MAX_HASH_BYTES; every hash of the chunk has it)
22      1                    flags (1: a parent block hash follows the hashes, 2: a LoRA name follows,
                             4: a cache salt follows)
23      1                    0
24      2                    lora_len (UTF-8 bytes)
26      2                    salt_len (UTF-8 bytes)
28      4                    0
32      nblocks * hash_len   block hashes, in prompt order
        hash_len             parent block hash (flag 1)
        lora_len             LoRA name (flag 2)
        salt_len             cache salt (flag 4)
        0..3                 zero padding to a multiple of 4
        4 * nblocks * block_size   token ids, uint32 little-endian, block after block
```

Everything little-endian. The length of the whole is implied by the header and must match it
exactly (`problem` says what is wrong otherwise). JSON text never starts with `M`, so a stored
metadata value is binary exactly when it starts with MAGIC (`is_binary`).

Skew: a reader that does not know FORMAT or the metadata version `v` refuses the chunk
(`problem` names the value and what is supported), so it is never misread; a pool that does not
accept binary metadata says so in its hello (`HelloResult.chunk_meta_format` 0), and clients then
commit JSON as before.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any

import msgspec
import numpy as np

from maru_vllm.pool import messages as M

#: Tokens per pool object (a chunk) unless configured (`maru_kv_chunk_tokens`): the one home of the default.
DEFAULT_CHUNK_TOKENS = 256

#: `ChunkMeta.v` values this code writes and reads; bump when ChunkMeta changes incompatibly.
CHUNK_META_VERSION = 1
SUPPORTED_CHUNK_META_VERSIONS = frozenset({CHUNK_META_VERSION})

HexHash = Annotated[str, msgspec.Meta(min_length=2, max_length=256, pattern="^([0-9a-f]{2})+$")]


def model_namespace_prefix(model: str) -> str:
    """The namespace prefix MaruKVConnector uses for every engine of `model`.

    The connector's namespace is this prefix, `kv:<model base name, 40 chars>:`, followed by the
    digest of the KV layout (`maru_vllm.connector.namespace.KVIdentity.namespace`).
    """
    return f"kv:{model.rstrip('/').rsplit('/', 1)[-1][:40]}:"


class ChunkMeta(msgspec.Struct, omit_defaults=False):
    """The per-block facts committed with one connector chunk (what a KV event needs per block).

    `block_hashes` are vLLM BlockHash bytes as hex, in prompt order; `token_ids[i]` are the
    `block_size` tokens of block i; `parent_block_hash` is the hash of the block before the first
    one (None for the first chunk of a prompt); `rank` is the writer's rank in the TP x PP world.
    `lora_name` and `cache_salt` are the request's adapter and tenant salt as vLLM hashed them
    (both already in the block hashes; the relay announces them so that Dynamo's router credits
    the chunk only to requests with the same ones). Every chunk of a salted prompt carries its salt.
    """

    v: int
    chunk: int
    block_size: Annotated[int, msgspec.Meta(gt=0)]
    block_hashes: Annotated[list[HexHash], msgspec.Meta(min_length=1)]
    parent_block_hash: HexHash | None
    token_ids: list[list[int]]
    lora_name: str | None = None
    rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.v not in SUPPORTED_CHUNK_META_VERSIONS:
            raise ValueError(
                f"chunk metadata version {self.v} is not supported (supported: {sorted(SUPPORTED_CHUNK_META_VERSIONS)})"
            )
        if len(self.token_ids) != len(self.block_hashes):
            raise ValueError(f"{len(self.token_ids)} token blocks for {len(self.block_hashes)} block hashes")
        if any(len(block) != self.block_size for block in self.token_ids):
            raise ValueError(f"every token block must hold block_size={self.block_size} tokens")


_chunk_decoder = msgspec.json.Decoder(ChunkMeta)

FORMAT = 1
MAGIC = M.BINARY_META_PREFIX + bytes([FORMAT])
MAX_HASH_BYTES = 128  # as `HexHash` (256 hex digits)
MAX_LORA_BYTES = 1024
MAX_SALT_BYTES = 1024
FLAG_PARENT = 1
FLAG_LORA = 2
FLAG_SALT = 4
_HEADER = struct.Struct("<4sHHIIIHBBHH4x")
HEADER_SIZE = _HEADER.size  # 32


def is_binary(data: bytes | bytearray | memoryview) -> bool:
    """`data` is (meant to be) binary chunk metadata, not JSON."""
    return bytes(data[:3]) == M.BINARY_META_PREFIX


def encode(meta: ChunkMeta) -> bytes | None:
    """The binary form of `meta`; None when it has no binary form (block hashes of different
    lengths, a token id outside uint32, an overlong LoRA name or salt): store such a chunk as JSON."""
    try:
        hashes = [bytes.fromhex(h) for h in meta.block_hashes]
        parent = bytes.fromhex(meta.parent_block_hash) if meta.parent_block_hash is not None else b""
    except ValueError:
        return None
    hash_len = len(hashes[0]) if hashes else 0
    if not hashes or not 0 < hash_len <= MAX_HASH_BYTES or any(len(h) != hash_len for h in hashes):
        return None
    if meta.parent_block_hash is not None and len(parent) != hash_len:
        return None
    lora = meta.lora_name.encode() if meta.lora_name is not None else b""
    salt = meta.cache_salt.encode() if meta.cache_salt is not None else b""
    if len(salt) > MAX_SALT_BYTES:
        return None
    if len(lora) > MAX_LORA_BYTES or not 0 <= meta.rank < 1 << 16 or not 0 <= meta.v < 1 << 16:
        return None
    if not 0 <= meta.chunk < 1 << 32 or not 0 < meta.block_size < 1 << 32:
        return None
    try:
        tokens = np.array(meta.token_ids, dtype=np.int64).reshape(-1)
    except (ValueError, OverflowError):
        return None
    if tokens.size != len(hashes) * meta.block_size or (tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 32)):
        return None
    flags = (
        (FLAG_PARENT if meta.parent_block_hash is not None else 0)
        | (FLAG_LORA if meta.lora_name is not None else 0)
        | (FLAG_SALT if meta.cache_salt is not None else 0)
    )
    head = _HEADER.pack(
        MAGIC, meta.v, meta.rank, meta.chunk, meta.block_size, len(hashes), hash_len, flags, 0, len(lora), len(salt)
    )
    body = b"".join(hashes) + parent + lora + salt
    pad = b"\0" * (-len(body) % 4)
    return head + body + pad + tokens.astype("<u4").tobytes()


class Layout:
    """Where the parts of one binary chunk metadata value are (offsets into it)."""

    __slots__ = ("v", "rank", "chunk", "block_size", "nblocks", "hash_len", "parent", "lora", "salt", "tokens")

    def __init__(self, data: bytes | memoryview) -> None:
        """Raise MessageError naming the problem unless `data` is a well-formed binary chunk."""
        if len(data) < HEADER_SIZE:
            raise M.MessageError(
                f"binary chunk metadata of {len(data)} bytes is shorter than its {HEADER_SIZE}-byte header"
            )
        magic, v, rank, chunk, bs, nblocks, hash_len, flags, _zero, lora_len, salt_len = _HEADER.unpack_from(data, 0)
        if magic != MAGIC:
            raise M.MessageError(
                f"binary chunk metadata format {magic[3]} is not supported (supported: {FORMAT})"
                if magic[:3] == MAGIC[:3]
                else "not binary chunk metadata (bad magic)"
            )
        if v not in SUPPORTED_CHUNK_META_VERSIONS:
            raise M.MessageError(
                f"chunk metadata version {v} is not supported (supported: {sorted(SUPPORTED_CHUNK_META_VERSIONS)})"
            )
        bad_flags = flags & ~(FLAG_PARENT | FLAG_LORA | FLAG_SALT)
        if bs < 1 or nblocks < 1 or not 1 <= hash_len <= MAX_HASH_BYTES or bad_flags:
            raise M.MessageError(
                f"binary chunk metadata header is invalid (block_size={bs}, blocks={nblocks}, "
                f"hash_len={hash_len} (1..{MAX_HASH_BYTES}), flags={flags})"
            )
        if (not flags & FLAG_LORA and lora_len) or lora_len > MAX_LORA_BYTES:
            raise M.MessageError(f"binary chunk metadata has an invalid LoRA name length {lora_len}")
        if (not flags & FLAG_SALT and salt_len) or salt_len > MAX_SALT_BYTES:
            raise M.MessageError(f"binary chunk metadata has an invalid cache salt length {salt_len}")
        at = HEADER_SIZE + nblocks * hash_len
        self.parent = at if flags & FLAG_PARENT else -1
        at += hash_len if flags & FLAG_PARENT else 0
        self.lora = (at, at + lora_len) if flags & FLAG_LORA else None
        at += lora_len
        self.salt = (at, at + salt_len) if flags & FLAG_SALT else None
        at += salt_len
        at += -at % 4
        self.tokens = at
        expected = at + 4 * nblocks * bs
        if len(data) != expected:
            raise M.MessageError(f"binary chunk metadata is {len(data)} bytes; its header implies {expected}")
        self.v, self.rank, self.chunk, self.block_size = v, rank, chunk, bs
        self.nblocks, self.hash_len = nblocks, hash_len

    def lora_name(self, data: bytes | memoryview) -> str | None:
        return _text(data, self.lora, "a LoRA name")

    def cache_salt(self, data: bytes | memoryview) -> str | None:
        return _text(data, self.salt, "a cache salt")

    def hashes(self, data: bytes | memoryview) -> list[bytes]:
        h = self.hash_len
        return [bytes(data[HEADER_SIZE + i * h : HEADER_SIZE + (i + 1) * h]) for i in range(self.nblocks)]

    def parent_hash(self, data: bytes | memoryview) -> bytes | None:
        return None if self.parent < 0 else bytes(data[self.parent : self.parent + self.hash_len])

    def low64(self, data: bytes | memoryview) -> list[int]:
        """Each block hash's low 64 bits (its last 8 bytes, big-endian), as vLLM announces int hashes."""
        h = self.hash_len
        if h % 8 == 0:
            words = np.frombuffer(data, dtype=">u8", count=self.nblocks * h // 8, offset=HEADER_SIZE)
            return words[h // 8 - 1 :: h // 8].tolist()
        return [int.from_bytes(b[-8:], "big") for b in self.hashes(data)]

    def token_array(self, data: bytes | memoryview) -> np.ndarray:
        """The token ids, block after block (uint32, a read-only view of `data`)."""
        return np.frombuffer(data, dtype="<u4", count=self.nblocks * self.block_size, offset=self.tokens)


def _text(data: bytes | memoryview, span: tuple[int, int] | None, what: str) -> str | None:
    if span is None:
        return None
    try:
        return bytes(data[span[0] : span[1]]).decode()
    except UnicodeDecodeError:
        raise M.MessageError(f"binary chunk metadata has {what} that is not UTF-8") from None


def problem(data: bytes | memoryview) -> str | None:
    """None when `data` is well-formed binary chunk metadata, else what is wrong with it."""
    try:
        lay = Layout(data)
        lay.lora_name(data)
        lay.cache_salt(data)
    except M.MessageError as exc:
        return str(exc)
    return None


def decode(data: bytes | memoryview) -> ChunkMeta:
    """The `ChunkMeta` that `data` encodes; MessageError naming the problem when it is not one."""
    lay = Layout(data)
    bs = lay.block_size
    tokens = lay.token_array(data).tolist()
    parent = lay.parent_hash(data)
    return ChunkMeta(
        v=lay.v,
        chunk=lay.chunk,
        block_size=bs,
        block_hashes=[h.hex() for h in lay.hashes(data)],
        parent_block_hash=parent.hex() if parent is not None else None,
        token_ids=[tokens[i * bs : (i + 1) * bs] for i in range(lay.nblocks)],
        lora_name=lay.lora_name(data),
        rank=lay.rank,
        cache_salt=lay.cache_salt(data),
    )


def to_builtins(data: bytes | memoryview) -> Any:
    """The JSON-shaped dict of binary chunk metadata (what a JSON-committed chunk reads back as)."""
    return msgspec.to_builtins(decode(data))


def decode_chunk_meta(raw: msgspec.Raw | bytes | bytearray | memoryview) -> ChunkMeta:
    """`ChunkMeta` from its JSON or its binary form; `messages.MessageError` when neither."""
    if not isinstance(raw, msgspec.Raw) and bytes(raw[:3]) == M.BINARY_META_PREFIX:
        try:
            return decode(bytes(raw))
        except M.MessageError as exc:
            raise M.MessageError(f"not MaruKVConnector chunk metadata: {exc}") from None
    try:
        return _chunk_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise M.MessageError(f"not MaruKVConnector chunk metadata: {str(exc).splitlines()[0]}") from None
