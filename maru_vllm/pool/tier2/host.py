"""`Tier2Host` over the pool service's index, region and presence table.

The tier is one more client of the index, with a session of its own (`maru-tier2`): it pins an
object while a write-through thread copies it out, and it reserves, fills and commits the
objects it fetches exactly as a client does (the service's header check included), so a fetched
object is an ordinary pool object: it is announced in the pool's events and snapshots, counted,
evicted and pinned like any other. Everything here runs on the service's event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from maru_vllm.pool import chunk_codec
from maru_vllm.pool.index import PoolIndex
from maru_vllm.pool.messages import MAX_KEY, MAX_META_BYTES, MAX_PARTS
from maru_vllm.pool.objects import OBJ_HEADER_SIZE, expected_checksum, key_digest, validate, write_header
from maru_vllm.pool.presence import PresenceTable
from maru_vllm.pool.records import Obj
from maru_vllm.pool.tier2.interface import LocalObject, Slot

CLIENT_NAME = "maru-tier2"


class IndexHost:
    def __init__(
        self,
        index: PoolIndex,
        view: memoryview,
        presence: PresenceTable | None,
        verify: Callable[[Obj], str | None],
    ) -> None:
        self.index = index
        self.view = view
        self.presence = presence
        self._verify = verify
        self.sid = index.open_session(CLIENT_NAME)

    def _session(self) -> int:
        if self.sid not in self.index.sessions:  # expired (a long stall of the loop): start over
            self.sid = self.index.open_session(CLIENT_NAME)
        self.index.touch_session(self.sid)
        return self.sid

    def keep_alive(self) -> None:
        self._session()

    def is_own(self, session: int) -> bool:
        return session == self.sid

    def holds(self, ns: str, key: bytes) -> bool:
        return (ns, key) in self.index.objects

    def _pin(self, ns: str, key: bytes) -> Obj | None:
        (obj,) = self.index.acquire(self._session(), ns, [key])
        # the tier's own pins are not lookups: they stay out of the pool's hit and miss counts
        self.index.counters["hits" if obj is not None else "misses"] -= 1
        return obj

    def pin(self, ns: str, key: bytes) -> LocalObject | None:
        obj = self._pin(ns, key)
        if obj is None:
            return None
        v = self.view
        header = v[obj.header_offset : obj.payload_offset]
        payload = v[obj.payload_offset : obj.payload_offset + obj.size]
        if validate(header, payload, obj.oid, obj.size, key_digest(ns, key), check_crc=False) is not None:
            self.index.release(self.sid, [obj.oid])
            return None
        return LocalObject(
            ns, key, payload.toreadonly(), expected_checksum(header), self.index.meta_of(obj), obj.parts, obj.oid
        )

    def unpin(self, obj: LocalObject) -> None:
        self.index.release(self._session(), [obj.handle])  # type: ignore[list-item]  # an oid, from pin

    def hold(self, ns: str, key: bytes) -> object | None:
        obj = self._pin(ns, key)
        return None if obj is None else obj.oid

    def unhold(self, handle: object) -> None:
        self.index.release(self._session(), [handle])  # type: ignore[list-item]  # an oid, from hold

    def reserve(self, ns: str, key: bytes, size: int) -> Slot | None:
        (obj,) = self.index.reserve(self._session(), ns, [(key, size)])
        if obj is None:
            return None
        return Slot(ns, key, self.view[obj.payload_offset : obj.payload_offset + obj.size], obj)

    def commit(self, slot: Slot, checksum: int, meta: bytes | None, parts: Sequence[bytes]) -> bool:
        obj = slot.handle
        assert isinstance(obj, Obj)
        if _meta_problem(meta, parts) is not None:
            self.index.abort(self._session(), [obj.oid])
            return False
        header = self.view[obj.header_offset : obj.header_offset + OBJ_HEADER_SIZE]
        write_header(header, obj.oid, obj.size, key_digest(slot.ns, slot.key), None, True, known_checksum=checksum)
        (ok,) = self.index.commit(self._session(), [obj.oid], [meta], self._verify, [list(parts)])
        return ok

    def abort(self, slot: Slot) -> None:
        obj = slot.handle
        assert isinstance(obj, Obj)
        self.index.abort(self._session(), [obj.oid])

    def hint(self, ns: str, key: bytes) -> None:
        if self.presence is not None:
            self.presence.hint(self.presence.fingerprints.of_object(ns, key))

    def hints(self) -> int:
        return self.presence.hints if self.presence is not None else 0

    def unhint(self, ns: str, key: bytes) -> None:
        if self.presence is not None:
            self.presence.unhint(self.presence.fingerprints.of_object(ns, key))

    def close(self) -> None:
        self.index.close_session(self.sid)


def _meta_problem(meta: bytes | None, parts: Sequence[bytes]) -> str | None:
    """Why metadata and part keys read from the tier cannot be committed (None: they can): the
    same bounds a client's commit meets (`pool.messages`)."""
    if len(parts) > MAX_PARTS or any(len(p) > MAX_KEY for p in parts):
        return "too many or too long part keys"
    if meta is None:
        return None
    if len(meta) + sum(map(len, parts)) > MAX_META_BYTES:
        return "metadata too large"
    if chunk_codec.is_binary(meta):
        return chunk_codec.problem(meta)
    try:
        msgspec.json.decode(meta)
    except msgspec.DecodeError:
        return "metadata is neither binary chunk metadata nor JSON"
    return None
