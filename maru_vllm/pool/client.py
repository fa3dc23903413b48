"""The synchronous, thread-safe pool client the vLLM connector uses.

Control plane: one request/reply per batched call over the service socket, serialised by a
lock (the connector hooks are synchronous and may run on several threads). Data plane: the
client maps the region itself and writes/reads payloads in place - a reservation's `.buffer`
and a pin's `.data` are memoryviews straight into the shared mapping.

Restarts: every reservation and pin remembers the connection generation it came from. When
the service goes away the failing call raises `PoolUnavailable`; the next call reconnects
(with backoff), maps the new incarnation's region, and old reservations/pins become inert
(commit returns False, release does nothing). Metadata from one incarnation is never used to
read another incarnation's region.

Trust: on a unix socket the client checks who serves it (SO_PEERCRED) before sending its
token: the server must run as this user, as root, or as the owner of the socket's directory
(who controls what is in it). With `checksum=True` every read must carry a valid checksum.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec

from maru_vllm.pool import messages as M
from maru_vllm.pool import protocol as P
from maru_vllm.pool.address import parse_address, peer_credentials
from maru_vllm.pool.errors import InvalidArgument, PoolError, PoolProtocolError, PoolUnavailable
from maru_vllm.pool.objects import (
    OBJ_HEADER_SIZE,
    expected_checksum,
    key_digest,
    payload_checksum,
    validate,
    write_header,
)
from maru_vllm.pool.region import Region, RegionError

logger = logging.getLogger(__name__)

_IDEMPOTENT = frozenset({"lookup", "lookup_prefix", "lookup_parts", "stats", "snapshot", "ping"})


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


class PoolClient:
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
    ) -> None:
        self.address = parse_address(address)
        self._address_text = address
        self.token = token
        self.timeout = timeout
        self.checksum = checksum  # reads: require a valid checksum on every object
        self.write_checksum = checksum if write_checksum is None else write_checksum
        self._region_path_override = region_path
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._region: Region | None = None
        self._ids = itertools.count(1)
        self._gen = 0
        # (op, request id) of requests sent without waiting for their replies, oldest first
        self._unanswered: list[tuple[str, int]] = []
        self._last_io = 0.0
        self._retry_at = 0.0
        self._backoff = 0.05
        self._closed = False
        self.hello: dict[str, Any] = {}
        self._hb_stop = threading.Event()
        self._hb: threading.Thread | None = None
        self._want_heartbeat = heartbeat
        self._populate = populate

    @classmethod
    def connect(cls, address: str, token: str | None = None, *, timeout: float = 5.0, **kw: Any) -> PoolClient:
        client = cls(address, token, timeout=timeout, **kw)
        with client._lock:
            client._connect()
        return client

    @property
    def incarnation(self) -> str | None:
        return self.hello.get("incarnation") if self._sock is not None else None

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def region_view(self) -> memoryview | None:
        """The current mapping of the whole region (None before the first connect), e.g. to
        register it with a GPU once (cudaHostRegister)."""
        region = self._region
        return None if region is None else region.view

    # -- connection -------------------------------------------------------------------------
    def _connect(self) -> None:
        a = self.address
        try:
            if a.kind == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                sock.connect(a.path)
                _check_server_uid(sock, a.path)
            else:
                sock = socket.create_connection((a.host, a.port), timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except PoolUnavailable:
            sock.close()
            raise
        except OSError as exc:
            raise PoolUnavailable(f"cannot connect to pool at {self._address_text}: {exc}") from exc
        self._sock = sock
        try:
            hello = msgspec.structs.asdict(
                self._roundtrip("hello", {"token": self.token, "client": "maru-client", "pid": os.getpid()})
            )
            path = self._region_path_override or hello["region_path"]
            region = Region.attach(
                path,
                size=hello["region_size"],
                region_uuid=hello["region_uuid"],
                incarnation=hello["incarnation"],
                backend=hello.get("backend", "shm"),
                populate=self._populate,
            )
        except RegionError as exc:
            self._drop_connection()
            raise PoolUnavailable(f"pool at {self._address_text}: {exc}") from exc
        except PoolError:
            self._drop_connection()
            raise
        if self._region is not None:
            self._region.close()  # views still held by callers keep the old mapping alive
        self._region = region
        self.hello = hello
        self._gen += 1
        self._backoff = 0.05
        logger.debug("connected to pool %s incarnation %s", hello["pool"], hello["incarnation"])
        if self._want_heartbeat and self._hb is None:
            self._hb = threading.Thread(target=self._heartbeat, name="maru-pool-heartbeat", daemon=True)
            self._hb.start()

    def _drop_connection(self) -> None:
        self._unanswered.clear()  # their replies went with the connection
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None

    def _ensure(self) -> None:
        if self._closed:
            raise PoolUnavailable("client is closed")
        if self._sock is not None:
            return
        now = time.monotonic()
        if now < self._retry_at:
            raise PoolUnavailable(f"pool at {self._address_text} unavailable; retrying in {self._retry_at - now:.2f}s")
        try:
            self._connect()
        except PoolUnavailable:
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, 2.0)
            raise

    def reconnect(self) -> None:
        """Force a fresh connection now (drops the current session)."""
        with self._lock:
            self._drop_connection()
            self._retry_at = 0.0
            self._connect()

    def close(self) -> None:
        self._hb_stop.set()
        with self._lock:
            self._closed = True
            self._drop_connection()
            if self._region is not None:
                self._region.close()
                self._region = None

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _heartbeat(self) -> None:
        while not self._hb_stop.is_set():
            lease = float(self.hello.get("lease_s", 30.0))
            if self._hb_stop.wait(max(0.05, lease / 4)):
                return
            if not self._lock.acquire(timeout=lease / 4):
                continue
            try:
                if self._sock is not None and time.monotonic() - self._last_io > lease / 4:
                    self._roundtrip("ping", {})
            except PoolError as exc:
                logger.debug("heartbeat failed: %s", exc)
            finally:
                self._lock.release()

    # -- request/reply ----------------------------------------------------------------------
    def _roundtrip(self, op: str, args: dict[str, Any]) -> Any:
        self._drain()
        req_id = self._send(op, args)
        return self._reply(op, req_id)

    def _send(self, op: str, args: dict[str, Any]) -> int:
        sock = self._sock
        if sock is None:
            raise PoolUnavailable("not connected")
        req_id = next(self._ids)
        try:
            sock.sendall(P.encode_request(req_id, op, args))
        except OSError as exc:  # the service may have refused the connection just before
            refusal = _pending_refusal(sock)
            self._drop_connection()
            if refusal is not None:
                self._raise_connection_error(op, refusal)
            raise PoolUnavailable(f"pool at {self._address_text} went away during {op}: {exc}") from exc
        return req_id

    def _send_unanswered(self, op: str, args: dict[str, Any]) -> None:
        """Send a request whose reply is read (and checked) before the next one's, not now."""
        self._drain()
        self._unanswered.append((op, self._send(op, args)))

    def _drain(self) -> None:
        """Read the replies of requests sent by `_send_unanswered`; an error reply is logged."""
        while self._unanswered:
            op, req_id = self._unanswered[0]
            try:
                self._reply(op, req_id)
            except PoolProtocolError as exc:
                logger.warning("pool %s: %s", self._address_text, exc)
            finally:
                if self._unanswered and self._unanswered[0][1] == req_id:
                    self._unanswered.pop(0)

    def _reply(self, op: str, req_id: int) -> Any:
        sock = self._sock
        if sock is None:
            raise PoolUnavailable("not connected")
        try:
            n = P.LEN.unpack(_recv_exact(sock, 4))[0]
            if n > P.MAX_FRAME:
                # The rest of that frame is still on the wire: this byte stream is out of step for
                # good, so drop it; the next call reconnects.
                self._drop_connection()
                raise PoolProtocolError(f"reply frame of {n} bytes to {op} exceeds {P.MAX_FRAME}; connection dropped")
            body = _recv_exact(sock, n)
        except (OSError, EOFError) as exc:
            self._drop_connection()
            raise PoolUnavailable(f"pool at {self._address_text} went away during {op}: {exc}") from exc
        self._last_io = time.monotonic()
        try:
            reply = P.decode_reply(body)
        except P.FrameError as exc:
            self._drop_connection()
            raise PoolProtocolError(f"{exc}; connection dropped") from exc
        if reply.id == 0 and not reply.ok:  # about the connection, not a request: it is being closed
            self._drop_connection()
            self._raise_connection_error(op, reply)
        if reply.id != req_id:
            self._drop_connection()
            raise PoolProtocolError(f"reply id {reply.id} does not match request {req_id} ({op})")
        if not reply.ok:
            err = reply.error
            code, msg = (err.code, err.message) if err else ("unknown", "no error detail")
            if code in ("session_expired",):
                self._drop_connection()
                raise PoolUnavailable(f"{op}: {msg}")
            raise PoolProtocolError(f"{op} rejected by pool ({code}): {msg}", code)
        try:
            return M.decode_result(op, reply.result)
        except M.MessageError as exc:
            self._drop_connection()  # a peer that answers in a shape we do not know is not trusted further
            raise PoolProtocolError(f"{exc}; connection dropped") from exc

    def _raise_connection_error(self, op: str, reply: P.RawReply) -> None:
        code, msg = (reply.error.code, reply.error.message) if reply.error else ("unknown", "no error detail")
        if code == "too_many_connections":
            raise PoolUnavailable(f"pool at {self._address_text} refused the connection ({code}): {msg}")
        raise PoolProtocolError(f"{op} rejected by pool ({code}): {msg}", code)

    def _call(self, op: str, args: dict[str, Any]) -> Any:
        with self._lock:
            self._ensure()
            gen = self._gen
            try:
                return self._roundtrip(op, args)
            except PoolUnavailable:
                if op not in _IDEMPOTENT:
                    raise
            # safe to retry once on a fresh connection (e.g. the service restarted)
            self._retry_at = 0.0
            self._ensure()
            if self._gen == gen:
                raise PoolUnavailable(f"{op}: reconnect did not happen")
            return self._roundtrip(op, args)

    # -- public API -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], namespace: str = "default") -> list[bool]:
        return self._call("lookup", {"keys": _keys(keys), "ns": _ns(namespace)})

    def lookup_prefix(self, keys: Sequence[bytes], namespace: str = "default") -> int:
        return self._call("lookup_prefix", {"keys": _keys(keys), "ns": _ns(namespace)})

    def lookup_parts(self, keys: Sequence[bytes], namespace: str = "default") -> list[int]:
        """For each part key (see `commit`), how many leading units of a committed object it
        names; 0 where no object names it."""
        return self._call("lookup_parts", {"keys": _keys(keys), "ns": _ns(namespace)})

    def reserve(self, items: Sequence[tuple[bytes, int]], namespace: str = "default") -> list[Reservation | None]:
        clean = []
        for key, size in items:
            _key(key)
            if not isinstance(size, int) or size < 0:
                raise InvalidArgument(f"invalid size {size!r} for key {bytes(key)[:32].hex()}: must be an int >= 0")
            clean.append((bytes(key), size))
        ns = _ns(namespace)
        with self._lock:
            self._ensure()
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
        `messages.ChunkMeta`, or None) is stored as JSON and rides on events and snapshots;
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
        with self._lock:
            self._ensure()
            send: list[int] = []
            send_metas: list[Any] = []
            send_parts: list[list[bytes] | None] = []
            idx: list[int] = []
            out = [False] * len(reservations)
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
                send_metas.append(metas[i] if metas is not None else None)
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
            if oids and self._sock is not None:
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
        with self._lock:
            self._ensure()
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
            if oids and self._sock is not None:
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
                {"namespace": o.namespace, "key": o.key, "size": o.size, "meta": msgspec.json.decode(o.meta)}
                for o in page.objects
            )
        assert first is not None
        return {"pool": first.pool, "incarnation": first.incarnation, "seq": first.seq, "objects": objects}

    def snapshot_pages(
        self, namespace: str | None = None, page_size: int = P.MAX_SNAPSHOT_PAGE
    ) -> Iterator[M.SnapshotPage]:
        """The visible objects, one `messages.SnapshotPage` (a few MiB at most) at a time, in commit
        order. Apply the events after the FIRST page's `seq` on top of all pages to get the exact
        current set (why that is exact: `SnapshotPage`). Raises PoolUnavailable if the pool
        restarts (a new incarnation) between pages."""
        ns = None if namespace is None else _ns(namespace)
        after = 0
        incarnation = None
        while True:
            data = self._call("snapshot", {"ns": ns, "after": after, "limit": page_size})
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


def _peer_uid(sock: socket.socket) -> int:
    return peer_credentials(sock)[1]


def _check_server_uid(sock: socket.socket, path: str) -> None:
    """Refuse a unix-socket server run by someone who could not have put the socket there
    legitimately (e.g. another user squatting a name in a shared directory like /tmp)."""
    uid = _peer_uid(sock)
    own = os.geteuid()
    directory = os.path.dirname(path) or "/"
    try:
        dir_owner = os.stat(directory).st_uid
    except OSError:
        dir_owner = own
    if uid in (own, 0, dir_owner):
        return
    raise PoolUnavailable(
        f"the pool socket {path} is served by uid {uid}, not by you (uid {own}), root, or the owner of "
        f"{directory} (uid {dir_owner}); refusing to connect (it may be squatted - check who runs it)"
    )


def _pending_refusal(sock: socket.socket) -> P.RawReply | None:
    """An error reply the service sent before closing, if one is waiting to be read."""
    try:
        sock.settimeout(0.5)
        n = P.LEN.unpack(_recv_exact(sock, 4))[0]
        if n > P.MAX_HELLO_FRAME:
            return None
        reply = P.decode_reply(_recv_exact(sock, n))
    except (OSError, EOFError, P.FrameError):
        return None
    return None if reply.ok else reply


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed by the pool service")
        got += k
    return bytes(buf)


def _key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"keys must be bytes, got {type(key).__name__}")
    if len(key) > P.MAX_KEY:
        raise InvalidArgument(f"key of {len(key)} bytes is too long (at most {P.MAX_KEY} bytes)")
    return bytes(key)


def _keys(keys: Sequence[bytes]) -> list[bytes]:
    if len(keys) > P.MAX_BATCH:
        raise InvalidArgument(f"batch of {len(keys)} keys is too large (at most {P.MAX_BATCH})")
    return [_key(k) for k in keys]


def _ns(namespace: str) -> str:
    if not isinstance(namespace, str) or len(namespace) > P.MAX_NAMESPACE:
        raise InvalidArgument(f"namespace {namespace!r} must be a str of at most {P.MAX_NAMESPACE} characters")
    return namespace
