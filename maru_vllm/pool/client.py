"""The synchronous, thread-safe pool client the vLLM connector uses.

Control plane: one request/reply per batched call over the service socket (connection.py: trust
check, hello, reconnects, heartbeat, framing). Data plane: the client maps the region itself and
writes/reads payloads in place - a reservation's `.buffer` and a pin's `.data` are memoryviews
straight into the shared mapping.

Restarts: every reservation and pin remembers the connection generation it came from. When
the service goes away the failing call raises `PoolUnavailable`; the next call reconnects
(with backoff), maps the new incarnation's region, and old reservations/pins become inert
(commit returns False, release does nothing). Metadata from one incarnation is never used to
read another incarnation's region. A request that misses its deadline (`timeout`) drops the
connection the same way; with a `breaker` the whole process then stops waiting for the pool
until it answers again (connection.py).

Trust: see connection.py for who may serve a unix socket. With `checksum=True` every read must
carry a valid checksum.

Size: one method per pool operation (each with its failure value documented); the transport
under them is connection.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import msgspec

from maru_vllm.pool import chunk_codec
from maru_vllm.pool import messages as M
from maru_vllm.pool import protocol as P
from maru_vllm.pool.breaker import PoolBreaker
from maru_vllm.pool.connection import PoolConnection
from maru_vllm.pool.errors import InvalidArgument, PoolProtocolError, PoolUnavailable
from maru_vllm.pool.objects import (
    OBJ_HEADER_SIZE,
    expected_checksum,
    key_digest,
    payload_checksum,
    validate,
    write_header,
)
from maru_vllm.pool.presence import PresenceReader

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class Reservation:
    """Space reserved for one object; write the payload into `.buffer`, then commit."""

    key: bytes
    size: int
    buffer: memoryview
    namespace: str
    oid: int
    _gen: int
    _header: memoryview = field(repr=False)
    done: bool = False
    # The payload's checksum (objects.payload_checksum) when whoever filled `buffer` computed it
    # in the same pass (a fused copy); commit then does not hash the payload again.
    payload_checksum: int | None = None


@dataclass(eq=False)
class ReadPin:
    """A pinned, validated object; `.data` stays valid until released.

    `checksum` is the payload checksum its header carries (None when the writer stored none).
    When the pin came from `acquire(..., verify_payload=False)` its header is checked but its
    payload is not yet: the reader must verify it (`verify()`, or stream the bytes through
    `objects.payload_hasher()` while copying them) before trusting them.
    """

    key: bytes
    data: memoryview
    namespace: str
    oid: int
    _gen: int
    _client: PoolClient | None = field(default=None, repr=False)
    released: bool = False
    checksum: int | None = None
    payload_verified: bool = True

    def verify(self) -> bool:
        """Check the payload against its checksum (True when it has none)."""
        if not self.payload_verified:
            self.payload_verified = self.checksum is None or payload_checksum(self.data) == self.checksum
        return self.payload_verified

    def __enter__(self) -> ReadPin:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._client is not None:
            self._client.release([self])


@dataclass(eq=False)
class PartPin(ReadPin):
    """A pinned object found by a part key: its leading `units` units are what the key names."""

    units: int = 0


class PoolClient(PoolConnection):
    """The pool's operations (lookups, reserve/commit, acquire/release, snapshots) over a
    `PoolConnection`; thread-safe."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        timeout: float = 5.0,
        checksum: bool = False,
        region_path: str | None = None,
        heartbeat: bool = True,
        populate: bool = True,
        write_checksum: bool | None = None,
        breaker: PoolBreaker | None = None,
        local_lookups: bool = False,
    ) -> None:
        """`local_lookups`: answer `lookup_prefix` / `lookup_parts` from the region's presence
        table (`pool.presence`) while connected, asking the service only where the table cannot
        tell; such lookups do not refresh the objects' LRU position or the service's hit counters."""
        super().__init__(
            address,
            token,
            timeout=timeout,
            region_path=region_path,
            heartbeat=heartbeat,
            populate=populate,
            breaker=breaker,
        )
        self.checksum = checksum  # reads: require a valid checksum on every object
        self.write_checksum = checksum if write_checksum is None else write_checksum
        self.local_lookups = local_lookups
        self.lookups_local = 0  # lookups answered from the presence table
        self.lookups_asked = 0  # lookups that went to the service
        self._table_after = 0.0  # monotonic time before which lookups ask the service

    def ask_service_for(self, seconds: float) -> None:
        """Send lookups to the service, not the presence table, for the next `seconds`."""
        self._table_after = max(self._table_after, time.monotonic() + seconds)

    def _table(self) -> PresenceReader | None:
        """The presence table when lookups may use it: asked for, connected, pool not marked down,
        not told to ask the service (`ask_service_for`)."""
        if not self.local_lookups or self._sock is None or self.marked_down:
            return None
        if self._table_after and time.monotonic() < self._table_after:
            return None
        return self.presence

    # -- public API -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], namespace: str = "default") -> list[bool]:
        return self._call("lookup", {"keys": _keys(keys), "ns": _ns(namespace)})

    def lookup_prefix(self, keys: Sequence[bytes], namespace: str = "default") -> int:
        return self._lookup("lookup_prefix", PresenceReader.lookup_prefix, keys, namespace)

    def lookup_parts(self, keys: Sequence[bytes], namespace: str = "default") -> list[int]:
        """For each part key (see `commit`), how many leading units of a committed object it
        names; 0 where no object names it."""
        return self._lookup("lookup_parts", PresenceReader.lookup_parts, keys, namespace)

    def lookup_tiers(self, keys: Sequence[bytes], namespace: str = "default") -> tuple[int, int]:
        """(how many leading `keys` the pool holds, how many keys right after those its lower tier
        holds): the presence table's answer and hints (`pool.presence`); where the table cannot
        tell, the service's `lookup_prefix` and no lower-tier count."""
        ns, checked = _ns(namespace), _keys(keys)
        table = self._table()
        if table is not None:
            found = table.lookup_tiers(ns, checked)
            if found is not None:
                self.lookups_local += 1
                return found
        self.lookups_asked += 1
        return int(self._call("lookup_prefix", {"keys": checked, "ns": ns})), 0

    def promote(self, keys: Sequence[bytes], namespace: str = "default") -> int:
        """Ask the pool to fetch `keys` from its lower tier into the region; does not wait (a
        fetched key shows as present in later lookups, one that cannot be fetched loses its hint)."""
        args = {"keys": _keys(keys), "ns": _ns(namespace)}
        with self._request():
            self._send_unanswered("promote", args)
        return len(args["keys"])

    def _lookup(
        self,
        op: str,
        read: Callable[[PresenceReader, str, list[bytes]], T | None],
        keys: Sequence[bytes],
        namespace: str,
    ) -> T:
        """`read` the presence table where lookups may use it and it can tell; else ask the service `op`."""
        ns, checked = _ns(namespace), _keys(keys)
        table = self._table()
        if table is not None:
            found = read(table, ns, checked)
            if found is not None:
                self.lookups_local += 1
                return found
        self.lookups_asked += 1
        return cast(T, self._call(op, {"keys": checked, "ns": ns}))

    def reserve(self, items: Sequence[tuple[bytes, int]], namespace: str = "default") -> list[Reservation | None]:
        clean = []
        for key, size in items:
            _key(key)
            if not isinstance(size, int) or size < 0:
                raise InvalidArgument(f"invalid size {size!r} for key {bytes(key)[:32].hex()}: must be an int >= 0")
            clean.append((bytes(key), size))
        ns = _ns(namespace)
        with self._request():
            result = self._roundtrip("reserve", {"items": clean, "ns": ns})
            view = self._region.view  # type: ignore[union-attr]  # _ensure() connected: the region is mapped
            out: list[Reservation | None] = []
            for (key, _size), r in zip(clean, result):
                if r is None:
                    out.append(None)
                    continue
                oid, off, rsize = r.oid, r.offset, r.size
                out.append(
                    Reservation(
                        key, rsize, view[off : off + rsize], ns, oid, self._gen, view[off - OBJ_HEADER_SIZE : off]
                    )
                )
            return out

    def commit(
        self,
        reservations: Sequence[Reservation],
        metas: Sequence[Any] | None = None,
        parts: Sequence[Sequence[bytes] | None] | None = None,
    ) -> list[bool]:
        """Publish written reservations. Each meta (a JSON-shaped dict or msgspec Struct, e.g.
        `chunk_codec.ChunkMeta`, or None) is stored with the object and rides on events and
        snapshots: a `ChunkMeta` in its binary form (`chunk_codec`) where the pool accepts it
        (its hello says so), everything else as JSON;
        `parts[i][j]` (optional) is a key naming the first j + 1 units of object i, for
        `lookup_parts` / `acquire_parts`."""
        if metas is not None and len(metas) != len(reservations):
            raise InvalidArgument(f"commit got {len(reservations)} reservations but {len(metas)} metas")
        if parts is not None and len(parts) != len(reservations):
            raise InvalidArgument(f"commit got {len(reservations)} reservations but {len(parts)} part lists")
        if parts is not None:
            for p in parts:
                if p is not None and len(p) > P.MAX_PARTS:
                    raise InvalidArgument(f"{len(p)} part keys for one object; at most {P.MAX_PARTS}")
        with self._request():
            if not self._region_is_current():
                # another service took the region over (a warm restart) before this session noticed
                # its service was gone: these reservations are stale, and nothing may be written
                for r in reservations:
                    r.done = True
                self._drop_connection()
                return [False] * len(reservations)
            send: list[int] = []
            send_metas: list[Any] = []
            send_parts: list[list[bytes] | None] = []
            idx: list[int] = []
            out = [False] * len(reservations)
            binary = self.hello.get("chunk_meta_format") == chunk_codec.FORMAT
            for i, r in enumerate(reservations):
                if r.done or r._gen != self._gen:
                    r.done = True
                    continue  # from a previous connection: that session's space is already gone
                write_header(
                    r._header,
                    r.oid,
                    r.size,
                    key_digest(r.namespace, r.key),
                    r.buffer,
                    self.write_checksum,
                    known_checksum=r.payload_checksum,
                )
                send.append(r.oid)
                meta = metas[i] if metas is not None else None
                if binary and isinstance(meta, chunk_codec.ChunkMeta):
                    meta = chunk_codec.encode(meta) or meta  # None: no binary form, sent as JSON
                send_metas.append(meta)
                part_keys = parts[i] if parts is not None else None
                send_parts.append(_keys(part_keys) if part_keys else None)
                idx.append(i)
            if send:
                args: dict[str, Any] = {"oids": send, "metas": send_metas}
                if parts is not None:
                    args["parts"] = send_parts
                result = self._roundtrip("commit", args)
                for i, ok in zip(idx, result):
                    out[i] = bool(ok)
                    reservations[i].done = True
            return out

    def abort(self, reservations: Sequence[Reservation]) -> None:
        with self._lock:
            oids = [r.oid for r in reservations if not r.done and r._gen == self._gen]
            for r in reservations:
                r.done = True
            if oids and self._can_clean_up():
                self._roundtrip("abort", {"oids": oids})

    def acquire(
        self, keys: Sequence[bytes], namespace: str = "default", *, verify_payload: bool = True
    ) -> list[ReadPin | None]:
        """Pin objects for reading; a missing or invalid one is None.

        With `verify_payload=False` only the headers are checked here and each pin carries its
        checksum: the caller verifies the payload itself (e.g. fused with its copy, while the
        bytes are in cache) and releases a mismatching pin with `release(..., bad=[pin])`.
        """
        return self._acquire("acquire", keys, namespace, verify_payload)

    def acquire_parts(
        self, keys: Sequence[bytes], namespace: str = "default", *, verify_payload: bool = True
    ) -> list[PartPin | None]:
        """Pin, for each part key (see `commit`), the latest committed object naming it; release
        them with `release`. A pin's `.key` is the object's own key, `.units` what the part names;
        `verify_payload` as in `acquire` (the checksum covers the whole object)."""
        return self._acquire("acquire_parts", keys, namespace, verify_payload)

    def _acquire(self, op: str, keys: Sequence[bytes], namespace: str, verify_payload: bool) -> list[Any]:
        """Pin what `op` places for each key: a `ReadPin` per `Placement`, a `PartPin` per
        `PartPlacement`; objects failing validation are None, and released as bad at once."""
        ns = _ns(namespace)
        keys = _keys(keys)
        with self._request():
            result = self._roundtrip(op, {"keys": keys, "ns": ns})
            view = self._region.view  # type: ignore[union-attr]  # _ensure() connected: the region is mapped
            out: list[ReadPin | None] = []
            bad: list[int] = []
            for key, r in zip(keys, result):
                if r is None:
                    out.append(None)
                elif isinstance(r, M.PartPlacement):
                    out.append(
                        self._pin(PartPin, view, ns, r.key, r.oid, r.offset, r.size, bad, verify_payload, units=r.units)
                    )
                else:
                    out.append(self._pin(ReadPin, view, ns, key, r.oid, r.offset, r.size, bad, verify_payload))
            if bad:
                self._roundtrip("release", {"oids": bad, "bad": bad})
            return out

    def _pin(
        self,
        cls: type[ReadPin],
        view: memoryview,
        ns: str,
        key: bytes,
        oid: int,
        off: int,
        size: int,
        bad: list[int],
        verify_payload: bool,
        **extra: Any,
    ) -> Any:
        """A `cls` pin on a validated object, or None (its oid added to `bad`) if invalid."""
        payload = view[off : off + size]
        header = view[off - OBJ_HEADER_SIZE : off]
        problem = validate(
            header, payload, oid, size, key_digest(ns, key), check_crc=verify_payload, require_crc=self.checksum
        )
        if problem is not None:
            logger.warning("object %s/%s failed validation (%s); treating as a miss", ns, key.hex(), problem)
            bad.append(oid)
            return None
        return cls(
            key,
            payload.toreadonly(),
            ns,
            oid,
            self._gen,
            self,
            checksum=expected_checksum(header),
            payload_verified=verify_payload,
            **extra,
        )

    def release(self, pins: Sequence[ReadPin | None], bad: Sequence[ReadPin] = (), *, wait: bool = True) -> None:
        """Unpin; pins in `bad` failed the reader's payload check and the pool removes them.

        `wait=False` sends the release without waiting for its reply (read before the next
        request's): the caller may not touch the pins' data afterwards, and the service may
        still hold them for the moment it takes to read the request."""
        with self._lock:
            oids = []
            for p in pins:
                if p is None or p.released:
                    continue
                p.released = True
                if p._gen == self._gen:
                    oids.append(p.oid)
            bad_oids = [p.oid for p in bad if p._gen == self._gen and p.oid in oids]
            if oids and self._can_clean_up():
                args = {"oids": oids, "bad": bad_oids} if bad_oids else {"oids": oids}
                if wait:
                    self._roundtrip("release", args)
                else:
                    self._send_unanswered("release", args)

    def put(
        self, key: bytes, data: Any, namespace: str = "default", meta: Any = None, parts: Sequence[bytes] | None = None
    ) -> bool:
        """Store one object (reserve, copy into the region, commit; `parts` as in `commit`).
        False if it was not stored (already present, or no space could be freed)."""
        src = memoryview(data).cast("B")
        (res,) = self.reserve([(key, src.nbytes)], namespace)
        if res is None:
            return False
        try:
            res.buffer[:] = src
        except BaseException:
            self.abort([res])
            raise
        return self.commit([res], [meta], None if parts is None else [parts])[0]

    @contextmanager
    def get(self, key: bytes, namespace: str = "default") -> Iterator[memoryview | None]:
        """Pin one object and yield its read-only payload view (None on a miss)."""
        (pin,) = self.acquire([key], namespace)
        try:
            yield None if pin is None else pin.data
        finally:
            if pin is not None:
                self.release([pin])

    def stats(self) -> dict[str, Any]:
        return self._call("stats", {})

    def remove(self, keys: Sequence[bytes] | None, namespace: str = "default") -> int:
        """Remove objects by key (or the whole namespace with keys=None); returns how many.

        Subscribers get a `removed` event for each, as for an eviction.
        """
        return self._call("remove", {"ns": _ns(namespace), "keys": None if keys is None else _keys(keys)})

    def snapshot(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Every visible object (namespace, key hex, size, meta) as dicts (small pools, tools)."""
        return self.snapshot_full(namespace)["objects"]

    def snapshot_full(self, namespace: str | None = None) -> dict[str, Any]:
        """The snapshot as one dict, with the incarnation and the event `seq` it is consistent with
        (see `snapshot_pages` for what that means across pages)."""
        first: M.SnapshotPage | None = None
        objects: list[dict[str, Any]] = []
        for page in self.snapshot_pages(namespace):
            first = first or page
            objects.extend(
                {
                    "namespace": o.namespace,
                    "key": o.key,
                    "size": o.size,
                    "meta": msgspec.json.decode(o.meta) if o.bmeta is None else chunk_codec.to_builtins(o.bmeta),
                }
                for o in page.objects
            )
        assert first is not None
        return {"pool": first.pool, "incarnation": first.incarnation, "seq": first.seq, "objects": objects}

    def snapshot_pages(
        self,
        namespace: str | None = None,
        page_size: int = P.MAX_SNAPSHOT_PAGE,
        recent: int = 0,
        prefixes: Sequence[str] | None = None,
    ) -> Iterator[M.SnapshotPage]:
        """The visible objects, one `messages.SnapshotPage` (a few MiB at most) at a time, in commit
        order. Apply the events after the FIRST page's `seq` on top of all pages to get the exact
        current set (why that is exact: `SnapshotPage`). Raises PoolUnavailable if the pool
        restarts (a new incarnation) between pages. `recent` > 0: only the `recent` most recently
        used objects, as each page is served (a pool that predates it lists them all); `prefixes`:
        only namespaces starting with one of these, and `recent` counts only those."""
        ns = None if namespace is None else _ns(namespace)
        after = 0
        incarnation = None
        args: dict[str, Any] = {"ns": ns, "limit": page_size, "encoding": "msgpack"}
        if recent > 0:
            args["recent"] = recent
        if prefixes is not None:
            args["prefixes"] = [_ns(p) for p in prefixes]
        while True:
            data = self._call("snapshot", {**args, "after": after})
            try:
                page = M.decode_snapshot_page(data)
            except M.MessageError as exc:
                raise PoolProtocolError(str(exc)) from exc
            if incarnation is None:
                incarnation = page.incarnation
            elif page.incarnation != incarnation:
                raise PoolUnavailable(
                    f"pool restarted during a snapshot (incarnation {incarnation} -> {page.incarnation}); take it again"
                )
            yield page
            if page.next is None:
                return
            after = page.next

    def ping(self) -> None:
        self._call("ping", {})


def _key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"keys must be bytes, got {type(key).__name__}")
    if len(key) > P.MAX_KEY:
        raise InvalidArgument(f"key of {len(key)} bytes is too long (at most {P.MAX_KEY} bytes)")
    return bytes(key)


def _keys(keys: Sequence[bytes]) -> list[bytes]:
    if len(keys) > P.MAX_BATCH:
        raise InvalidArgument(f"batch of {len(keys)} keys is too large (at most {P.MAX_BATCH})")
    if _ONLY_BYTES.issuperset(map(type, keys)) and max(map(len, keys), default=0) <= P.MAX_KEY:
        return list(keys)  # the common case, checked at C speed (a commit carries hundreds of part keys)
    return [_key(k) for k in keys]


_ONLY_BYTES = frozenset({bytes})


def _ns(namespace: str) -> str:
    if not isinstance(namespace, str) or len(namespace) > P.MAX_NAMESPACE:
        raise InvalidArgument(f"namespace {namespace!r} must be a str of at most {P.MAX_NAMESPACE} characters")
    return namespace
