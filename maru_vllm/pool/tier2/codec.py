"""The format of a pool object in the second tier, and its name there.

A pool object goes to the tier whole, with what it needs to come back as the same object in
another domain's pool: its namespace, key, metadata (the `ChunkMeta` its committer gave it, so
the fetching pool's events credit it at the router), part keys, and the payload checksum its
writer computed (the pool header's XXH3-64, low 32 bits)::

    header (48 bytes, little-endian):
        magic b"MARUT2\\0\\0", u16 version, u16 namespace length, u16 key length, u16 part count,
        u32 metadata length, u32 payload checksum, u64 payload length,
        u64 XXH3-64 of the header (this field zero) and everything up to the payload,
        u64 reserved (0)
    namespace (UTF-8), key, part keys (each a u16 length + bytes), metadata, payload

The name is `maru1-` + 32 hex digits of BLAKE2b-128 over namespace and key: the same object key
in another namespace has another name, and `decode` checks the namespace and key it was asked
for against the ones inside, so objects of different namespaces never mix even if two names
collided. `decode` refuses anything that does not check out - a wrong magic or version, lengths
that do not add up, a header digest or payload checksum that does not match - by raising
`Tier2Corrupt`; the caller counts that as a miss and recomputes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from maru_vllm.pool.objects import key_digest, payload_checksum

MAGIC = b"MARUT2\0\0"
VERSION = 1
_HEAD = struct.Struct("<8sHHHHIIQQQ")
HEADER_SIZE = _HEAD.size
_PART_LEN = struct.Struct("<H")
_DIGEST_AT = 32  # byte offset of the header digest field


class Tier2Corrupt(ValueError):
    """Bytes from the tier that are not the object asked for, intact."""


def object_name(ns: str, key: bytes) -> str:
    """The tier's name for object `key` of namespace `ns`."""
    return "maru1-" + key_digest(ns, key).hex()


@dataclass(frozen=True)
class Tier2Object:
    """A decoded, verified object: `payload` is a view into the bytes `decode` was given."""

    ns: str
    key: bytes
    checksum: int
    meta: bytes | None
    parts: tuple[bytes, ...]
    payload: memoryview


def encoded_size(ns: str, key: bytes, meta: bytes | None, parts: Sequence[bytes], payload_len: int) -> int:
    return (
        HEADER_SIZE
        + len(ns.encode())
        + len(key)
        + sum(_PART_LEN.size + len(p) for p in parts)
        + len(meta or b"")
        + payload_len
    )


def encode_into(
    buf: memoryview,
    ns: str,
    key: bytes,
    checksum: int,
    meta: bytes | None,
    parts: Sequence[bytes],
    payload: memoryview,
) -> int:
    """Write the object into `buf` (at least `encoded_size` bytes); returns the bytes written.
    `checksum` is the payload's (`objects.payload_checksum`); it is not recomputed here."""
    nsb = ns.encode()
    meta = meta or b""
    at = HEADER_SIZE
    for chunk in (nsb, key):
        buf[at : at + len(chunk)] = chunk
        at += len(chunk)
    for p in parts:
        _PART_LEN.pack_into(buf, at, len(p))
        at += _PART_LEN.size
        buf[at : at + len(p)] = p
        at += len(p)
    buf[at : at + len(meta)] = meta
    at += len(meta)
    _HEAD.pack_into(buf, 0, MAGIC, VERSION, len(nsb), len(key), len(parts), len(meta), checksum, len(payload), 0, 0)
    digest = xxhash.xxh3_64_intdigest(buf[:at])
    struct.pack_into("<Q", buf, _DIGEST_AT, digest)
    buf[at : at + len(payload)] = payload
    return at + len(payload)


def encode(
    ns: str, key: bytes, checksum: int, meta: bytes | None, parts: Sequence[bytes], payload: memoryview
) -> bytearray:
    out = bytearray(encoded_size(ns, key, meta, parts, len(payload)))
    encode_into(memoryview(out), ns, key, checksum, meta, parts, payload)
    return out


def decode(data: bytes | memoryview, ns: str, key: bytes) -> Tier2Object:
    """The object `key` of `ns` in `data`, verified (header digest and payload checksum)."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        raise Tier2Corrupt(f"{len(view)} bytes are shorter than the {HEADER_SIZE}-byte header")
    magic, version, ns_len, key_len, nparts, meta_len, checksum, payload_len, digest, _ = _HEAD.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise Tier2Corrupt("not a tier-2 object of this version (magic/version)")
    at = HEADER_SIZE
    got_ns = bytes(view[at : at + ns_len])
    at += ns_len
    got_key = bytes(view[at : at + key_len])
    at += key_len
    if got_ns != ns.encode() or got_key != key:
        raise Tier2Corrupt("the object is of another namespace or key")
    parts = []
    for _ in range(nparts):
        if at + _PART_LEN.size > len(view):
            raise Tier2Corrupt("part keys run past the end")
        (n,) = _PART_LEN.unpack_from(view, at)
        at += _PART_LEN.size
        parts.append(bytes(view[at : at + n]))
        at += n
    meta = bytes(view[at : at + meta_len]) if meta_len else None
    at += meta_len
    if at + payload_len != len(view):
        raise Tier2Corrupt(f"lengths add up to {at + payload_len} bytes, the object has {len(view)}")
    head = bytearray(view[:at])
    struct.pack_into("<Q", head, _DIGEST_AT, 0)
    if xxhash.xxh3_64_intdigest(head) != digest:
        raise Tier2Corrupt("header digest mismatch")
    payload = view[at:]
    if payload_checksum(payload) != checksum:
        raise Tier2Corrupt("payload checksum mismatch")
    return Tier2Object(ns, key, checksum, meta, tuple(parts), payload)
