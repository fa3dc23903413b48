"""The per-object header written in front of every payload in the region.

The writer (the client) fills it in at commit; the service checks it before making the object
visible, and every reader checks it again before using the bytes. Any mismatch - wrong magic,
object id, length, key digest or checksum - makes the read a miss, never bad data. The object
id is unique per incarnation, so a block that was freed and reused for another object can
never validate against stale metadata.
"""

from __future__ import annotations

import hashlib
import struct

import xxhash

OBJ_MAGIC = 0x4A424F4D  # "MOBJ"
OBJ_VERSION = 2  # 2: the checksum is XXH3-64 (low 32 bits)
FLAG_CHECKSUM = 1
OBJ_HEADER_SIZE = 64  # keeps payloads 64-byte aligned
# magic, version, flags, object id, length, key digest, checksum
_OBJ = struct.Struct("<IHHQQ16sI")


def key_digest(namespace: str, key: bytes) -> bytes:
    return hashlib.blake2b(namespace.encode() + b"\0" + key, digest_size=16).digest()


def payload_checksum(payload: memoryview) -> int:
    """32-bit checksum of a payload (XXH3-64 truncated): catches bit flips, not adversaries."""
    return xxhash.xxh3_64_intdigest(payload) & 0xFFFFFFFF


def payload_hasher() -> xxhash.xxh3_64:
    """A streaming hasher whose `checksum_of(h)` equals `payload_checksum` of the bytes fed to it,
    so a reader can verify a payload piece by piece while each piece is still in cache."""
    return xxhash.xxh3_64()


def checksum_of(hasher: xxhash.xxh3_64) -> int:
    return hasher.intdigest() & 0xFFFFFFFF


def expected_checksum(header: memoryview) -> int | None:
    """The checksum a header carries, or None when its writer stored none."""
    _magic, _version, flags, _oid, _len, _digest, crc = _OBJ.unpack_from(header, 0)
    return crc if flags & FLAG_CHECKSUM else None


def write_header(
    buf: memoryview, oid: int, length: int, digest: bytes, payload: memoryview | None, checksum: bool
) -> None:
    """Write the header into `buf` (the OBJ_HEADER_SIZE bytes just before the payload)."""
    crc = payload_checksum(payload) if (checksum and payload is not None) else 0
    flags = FLAG_CHECKSUM if checksum else 0
    _OBJ.pack_into(buf, 0, 0, OBJ_VERSION, flags, oid, length, digest, crc)
    struct.pack_into("<I", buf, 0, OBJ_MAGIC)  # magic last: a torn header never validates


def clear_header(buf: memoryview) -> None:
    struct.pack_into("<I", buf, 0, 0)


def validate(
    header: memoryview, payload: memoryview, oid: int, length: int, digest: bytes, *, check_crc: bool = True,
    require_crc: bool = False,
) -> str | None:
    """None when the object is intact, else the reason it is not (for logs and counters).

    `require_crc`: an object written without a checksum is refused too (its bytes cannot be
    vouched for: a stale writer may have overwritten them)."""
    magic, version, flags, h_oid, h_len, h_digest, crc = _OBJ.unpack_from(header, 0)
    if magic != OBJ_MAGIC or version != OBJ_VERSION:
        return "bad object magic/version"
    if h_oid != oid:
        return f"object id {h_oid} != expected {oid}"
    if h_len != length or len(payload) != length:
        return f"length {h_len} != expected {length}"
    if h_digest != digest:
        return "key digest mismatch"
    if require_crc and not flags & FLAG_CHECKSUM:
        return "object carries no checksum"
    if check_crc and flags & FLAG_CHECKSUM and payload_checksum(payload) != crc:
        return "checksum mismatch"
    return None
