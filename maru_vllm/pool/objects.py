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
from typing import Any

import xxhash

from maru_vllm.native import copy_kernel

OBJ_MAGIC = 0x4A424F4D  # "MOBJ"
OBJ_VERSION = 2  # 2: the checksum is XXH3-64 (low 32 bits)
FLAG_CHECKSUM = 1
OBJ_HEADER_SIZE = 64  # keeps payloads 64-byte aligned
# magic, version, flags, object id, length, key digest, checksum
_OBJ = struct.Struct("<IHHQQ16sI")


def key_digest(namespace: str, key: bytes) -> bytes:
    return hashlib.blake2b(namespace.encode() + b"\0" + key, digest_size=16).digest()


def checksum_from_digest(digest: int) -> int:
    """The header's 32-bit checksum from a payload's full XXH3-64 digest."""
    return digest & 0xFFFFFFFF


def payload_checksum(payload: Any) -> int:
    """32-bit checksum of a payload (XXH3-64 truncated): catches bit flips, not adversaries.

    The compiled kernel (maru_vllm.native) computes the same XXH3-64 as the `xxhash` package,
    without holding the GIL; either may be used by either side."""
    kernel = copy_kernel()
    digest = kernel.hash(payload) if kernel is not None else None
    if digest is None:
        digest = xxhash.xxh3_64_intdigest(payload)
    return checksum_from_digest(digest)


class PayloadHasher:
    """The checksum of a payload a reader verifies while copying it.

    Either bytes are streamed in with `update` (piece by piece, each while still in cache), or a
    fused copy kernel that hashed the whole payload in its copy hands the digest over with
    `set_digest`; `checksum_of(h)` then equals `payload_checksum` of the payload."""

    def __init__(self) -> None:
        self._stream = xxhash.xxh3_64()
        self._fed = False
        self._digest: int | None = None

    @property
    def fresh(self) -> bool:
        """Nothing was hashed yet (a fused kernel may then take over the whole payload)."""
        return not self._fed and self._digest is None

    def update(self, data: Any) -> None:
        if self._digest is not None:
            raise RuntimeError("PayloadHasher: the whole payload's digest was already set")
        self._stream.update(data)
        self._fed = True

    def set_digest(self, digest: int) -> None:
        """The XXH3-64 of the whole payload, computed elsewhere (a fused copy)."""
        if not self.fresh:
            raise RuntimeError("PayloadHasher: bytes were already streamed in")
        self._digest = digest

    def checksum(self) -> int:
        return checksum_from_digest(self._stream.intdigest() if self._digest is None else self._digest)


def payload_hasher() -> PayloadHasher:
    """A hasher whose `checksum_of(h)` equals `payload_checksum` of the payload fed to it."""
    return PayloadHasher()


def checksum_of(hasher: PayloadHasher) -> int:
    return hasher.checksum()


def expected_checksum(header: memoryview) -> int | None:
    """The checksum a header carries, or None when its writer stored none."""
    _magic, _version, flags, _oid, _len, _digest, crc = _OBJ.unpack_from(header, 0)
    return crc if flags & FLAG_CHECKSUM else None


def write_header(
    buf: memoryview,
    oid: int,
    length: int,
    digest: bytes,
    payload: memoryview | None,
    checksum: bool,
    known_checksum: int | None = None,
) -> None:
    """Write the header into `buf` (the OBJ_HEADER_SIZE bytes just before the payload).

    `known_checksum`: the payload's checksum as its writer computed it while filling it (a fused
    copy); the payload is then not hashed again."""
    crc = 0
    if checksum and known_checksum is not None:
        crc = known_checksum
    elif checksum and payload is not None:
        crc = payload_checksum(payload)
    flags = FLAG_CHECKSUM if checksum else 0
    _OBJ.pack_into(buf, 0, 0, OBJ_VERSION, flags, oid, length, digest, crc)
    struct.pack_into("<I", buf, 0, OBJ_MAGIC)  # magic last: a torn header never validates


def clear_header(buf: memoryview) -> None:
    struct.pack_into("<I", buf, 0, 0)


def validate(
    header: memoryview,
    payload: memoryview,
    oid: int,
    length: int,
    digest: bytes,
    *,
    check_crc: bool = True,
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
