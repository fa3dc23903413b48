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
from maru_vllm.pool.address import parse_address
from maru_vllm.pool.errors import InvalidArgument, PoolError, PoolProtocolError, PoolUnavailable
from maru_vllm.pool.objects import OBJ_HEADER_SIZE, key_digest, validate, write_header
from maru_vllm.pool.region import Region, RegionError

logger = logging.getLogger(__name__)

_IDEMPOTENT = frozenset({"lookup", "lookup_prefix", "stats", "snapshot", "ping"})


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


@dataclass(eq=False)
class ReadPin:
    """A pinned, validated object; `.data` stays valid until released."""

    key: bytes
    data: memoryview
    namespace: str
    oid: int
    _gen: int
    _client: PoolClient | None = field(default=None, repr=False)
    released: bool = False

    def __enter__(self) -> ReadPin:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._client is not None:
            self._client.release([self])


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
    ) -> None:
        self.address = parse_address(address)
        self._address_text = address
        self.token = token
        self.timeout = timeout
        self.checksum = checksum
        self._region_path_override = region_path
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._region: Region | None = None
        self._ids = itertools.count(1)
        self._gen = 0
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

    # -- connection -------------------------------------------------------------------------
    def _connect(self) -> None:
        a = self.address
        try:
            if a.kind == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                sock.connect(a.path)
            else:
                sock = socket.create_connection((a.host, a.port), timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise PoolUnavailable(f"cannot connect to pool at {self._address_text}: {exc}") from exc
        self._sock = sock
        try:
            hello = msgspec.structs.asdict(
                self._roundtrip("hello", {"token": self.token, "client": "maru-client", "pid": os.getpid()})
            )
            path = self._region_path_override or hello["region_path"]
            region = Region.attach(
                path, size=hello["region_size"], region_uuid=hello["region_uuid"],
                incarnation=hello["incarnation"], backend=hello.get("backend", "shm"),
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
        sock = self._sock
        if sock is None:
            raise PoolUnavailable("not connected")
        req_id = next(self._ids)
        try:
            sock.sendall(P.encode_request(req_id, op, args))
            n = P.LEN.unpack(_recv_exact(sock, 4))[0]
            if n > P.MAX_FRAME:
                # The rest of that frame is still on the wire: this byte stream is out of step for
                # good, so drop it; the next call reconnects.
                self._drop_connection()
                raise PoolProtocolError(f"reply frame of {n} bytes to {op} exceeds {P.MAX_FRAME}; "
                                        "connection dropped")
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
            view = self._region.view  # type: ignore[union-attr]
            out: list[Reservation | None] = []
            for (key, size), r in zip(clean, result):
                if r is None:
                    out.append(None)
                    continue
                oid, off, rsize = r.oid, r.offset, r.size
                out.append(Reservation(key, rsize, view[off : off + rsize], ns, oid, self._gen,
                                       view[off - OBJ_HEADER_SIZE : off]))
            return out

    def commit(
        self, reservations: Sequence[Reservation], metas: Sequence[Any] | None = None
    ) -> list[bool]:
        """Publish written reservations. Each meta (a JSON-shaped dict or msgspec Struct, e.g.
        `messages.ChunkMeta`, or None) is stored as JSON and rides on events and snapshots."""
        if metas is not None and len(metas) != len(reservations):
            raise InvalidArgument(f"commit got {len(reservations)} reservations but {len(metas)} metas")
        with self._lock:
            self._ensure()
            send: list[int] = []
            send_metas: list[Any] = []
            idx: list[int] = []
            out = [False] * len(reservations)
            for i, r in enumerate(reservations):
                if r.done or r._gen != self._gen:
                    r.done = True
                    continue  # from a previous connection: that session's space is already gone
                write_header(r._header, r.oid, r.size, key_digest(r.namespace, r.key), r.buffer, self.checksum)
                send.append(r.oid)
                send_metas.append(metas[i] if metas is not None else None)
                idx.append(i)
            if send:
                result = self._roundtrip("commit", {"oids": send, "metas": send_metas})
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

    def acquire(self, keys: Sequence[bytes], namespace: str = "default") -> list[ReadPin | None]:
        ns = _ns(namespace)
        keys = _keys(keys)
        with self._lock:
            self._ensure()
            result = self._roundtrip("acquire", {"keys": keys, "ns": ns})
            view = self._region.view  # type: ignore[union-attr]
            out: list[ReadPin | None] = []
            bad: list[int] = []
            for key, r in zip(keys, result):
                if r is None:
                    out.append(None)
                    continue
                oid, off, size = r.oid, r.offset, r.size
                payload = view[off : off + size]
                problem = validate(view[off - OBJ_HEADER_SIZE : off], payload, oid, size, key_digest(ns, key))
                if problem is not None:
                    logger.warning("object %s/%s failed validation (%s); treating as a miss", ns, key.hex(), problem)
                    bad.append(oid)
                    out.append(None)
                    continue
                out.append(ReadPin(key, payload.toreadonly(), ns, oid, self._gen, self))
            if bad:
                self._roundtrip("release", {"oids": bad, "bad": bad})
            return out

    def release(self, pins: Sequence[ReadPin | None]) -> None:
        with self._lock:
            oids = []
            for p in pins:
                if p is None or p.released:
                    continue
                p.released = True
                if p._gen == self._gen:
                    oids.append(p.oid)
            if oids and self._sock is not None:
                self._roundtrip("release", {"oids": oids})

    def put(self, key: bytes, data: Any, namespace: str = "default", meta: Any = None) -> bool:
        """Store one object (reserve, copy into the region, commit). False if it was not stored
        (already present, or no space could be freed)."""
        src = memoryview(data).cast("B")
        (res,) = self.reserve([(key, src.nbytes)], namespace)
        if res is None:
            return False
        try:
            res.buffer[:] = src
        except BaseException:
            self.abort([res])
            raise
        return self.commit([res], [meta])[0]

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
            objects.extend({"namespace": o.namespace, "key": o.key, "size": o.size,
                            "meta": msgspec.json.decode(o.meta)} for o in page.objects)
        assert first is not None
        return {"pool": first.pool, "incarnation": first.incarnation, "seq": first.seq, "objects": objects}

    def snapshot_pages(self, namespace: str | None = None, page_size: int = P.MAX_SNAPSHOT_PAGE) -> Iterator[M.SnapshotPage]:
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
                raise PoolUnavailable(f"pool restarted during a snapshot (incarnation {incarnation} -> "
                                      f"{page.incarnation}); take it again")
            yield page
            if page.next is None:
                return
            after = page.next

    def ping(self) -> None:
        self._call("ping", {})


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
