"""The pool client's connection to the service: the control plane's transport.

One socket per client: connect (on a unix socket, first check who serves it: SO_PEERCRED - the
server must run as this user, as root, or as the owner of the socket's directory, who controls
what is in it), `hello` with the token, map the region the service names, and then one
request/reply at a time under a lock (the connector hooks are synchronous and may run on
several threads). A request sent without waiting (`_send_unanswered`, e.g. a release) has its
reply read before the next request's.

Restarts: when the service goes away the failing call raises `PoolUnavailable` and the next call
reconnects (with backoff up to 2 s) and maps the new incarnation's region (the same incarnation's
mapping is kept); every connection has a generation number so that reservations and pins from an
earlier one are recognised as inert. Read-only operations are retried once on a fresh connection.
An idle connection is kept alive by a heartbeat thread (the service releases a silent session's
pins after its lease).

Deadlines: `timeout` bounds every wait of a request - for the connection lock, connecting and
hello, sending, each reply. A request that misses it raises `PoolTimeout` and drops the
connection (its late reply would otherwise be read as the next request's); the session's pins
and reservations become inert and the service releases them when it reads the close. With a
`breaker` (`breaker.shared_breaker`, one per address and process) a missed deadline marks the
pool down for every connection of the process: they refuse requests without waiting until the
breaker's probe (`probe_service`) sees the service answer again.

`PoolClient` (client.py) is the operations over it.

Size: one transport state machine (hello, trust check, framing, deadlines, reconnects,
heartbeat, breaker hand-off) whose states are only correct together; split by file they would
share every field.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

import msgspec

from maru_vllm.pool import messages as M
from maru_vllm.pool import protocol as P
from maru_vllm.pool.address import parse_address, peer_credentials
from maru_vllm.pool.breaker import PoolBreaker, Probe, shared_breaker
from maru_vllm.pool.errors import PoolError, PoolProtocolError, PoolTimeout, PoolUnavailable
from maru_vllm.pool.presence import PresenceReader
from maru_vllm.pool.region import Region, RegionError

logger = logging.getLogger(__name__)

# Operations safe to send again on a fresh connection when the first try lost the service.
_IDEMPOTENT = frozenset({"lookup", "lookup_prefix", "lookup_parts", "stats", "snapshot", "ping"})

# How long the breaker's probe waits for a service that does not answer its hello before it
# tries a fresh connection (a stopped service answers the waiting one the moment it resumes).
PROBE_PATIENCE_S = 5.0


class PoolConnection:
    """One client's session with the pool service (see the module docstring); `PoolClient` adds
    the operations. `_call` is the one way a request goes out and its result comes back."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        timeout: float = 5.0,
        region_path: str | None = None,
        heartbeat: bool = True,
        populate: bool = True,
        breaker: PoolBreaker | None = None,
    ) -> None:
        self.address = parse_address(address)
        self._address_text = address
        self.token = token
        self.timeout = timeout  # every wait of one request (see the module docstring)
        self._breaker = breaker
        # The socket a request is waiting on (what `interrupt` shuts down), and whether it did.
        self._waiting_sock: socket.socket | None = None
        self._interrupted = False
        self._region_path_override = region_path
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._region: Region | None = None
        # the region's presence table (`pool.presence`), read by lookups without a round trip
        self.presence: PresenceReader | None = None
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
        if breaker is not None:
            breaker.join(self)

    @classmethod
    def connect(cls, address: str, token: str | None = None, *, timeout: float = 5.0, **kw: Any) -> Self:
        client = cls(address, token, timeout=timeout, **kw)
        with client._lock:
            client._refuse_if_down()
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
    def _open_socket(self) -> socket.socket:
        """A connected socket to the service whose server passed the trust check."""
        a = self.address
        try:
            if a.kind == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(self.timeout)
                    sock.connect(a.path)
                    _check_server_uid(sock, a.path)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((a.host, a.port), timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except PoolUnavailable:
            raise
        except TimeoutError as exc:
            raise self._missed("a connection") from exc
        except OSError as exc:
            raise PoolUnavailable(f"cannot connect to pool at {self._address_text}: {exc}") from exc
        return sock

    def _hello_args(self) -> dict[str, Any]:
        return {"token": self.token, "client": "maru-client", "pid": os.getpid()}

    def _connect(self) -> None:
        self._sock = self._open_socket()
        try:
            hello = msgspec.structs.asdict(self._roundtrip("hello", self._hello_args()))
            region = self._region_for(hello)
        except RegionError as exc:
            self._drop_connection()
            raise PoolUnavailable(f"pool at {self._address_text}: {exc}") from exc
        except PoolError:
            self._drop_connection()
            raise
        if self._region is not None and self._region is not region:
            self._region.close()  # views still held by callers keep the old mapping alive
        self._region = region
        self.presence = _presence_reader(region, hello)
        self.hello = hello
        self._gen += 1
        self._backoff = 0.05
        logger.debug("connected to pool %s incarnation %s", hello["pool"], hello["incarnation"])
        if self._want_heartbeat and self._hb is None:
            self._hb = threading.Thread(target=self._heartbeat, name="maru-pool-heartbeat", daemon=True)
            self._hb.start()

    def _region_for(self, hello: dict[str, Any]) -> Region:
        """The region `hello` announces: the current mapping when it is that one (a session lost
        to a hang or a lease, not to a restart), else a fresh one."""
        path = self._region_path_override or hello["region_path"]
        current = self._region
        if current is not None:
            info = current.info
            if (info.path, info.size, info.region_uuid, info.incarnation) == (
                path,
                hello["region_size"],
                hello["region_uuid"],
                hello["incarnation"],
            ):
                return current
        return Region.attach(
            path,
            size=hello["region_size"],
            region_uuid=hello["region_uuid"],
            incarnation=hello["incarnation"],
            backend=hello.get("backend", "shm"),
            populate=self._populate,
        )

    def _drop_connection(self) -> None:
        """Close the session: its pins and reservations become inert (their generation), the
        service releases them when it reads the close, and replies still due are never read."""
        self._unanswered.clear()  # their replies went with the connection
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._interrupted = False

    def _region_is_current(self) -> bool:
        """Whether the mapped region's header still names this session's incarnation (a service
        that recovered the region after a restart writes its own there first)."""
        region = self._region
        if region is None:
            return False
        try:
            return region.serves_incarnation()
        except ValueError:  # unmapped
            return False

    @property
    def marked_down(self) -> bool:
        """Whether this connection's breaker holds the pool for down (never, without one)."""
        return self._breaker is not None and self._breaker.is_open

    def _refuse_if_down(self) -> None:
        """While the pool is marked down: drop the session (nothing of it may wait for the pool,
        not even a release) and raise, without touching the socket."""
        breaker = self._breaker
        if breaker is None or not breaker.is_open:
            return
        if self._sock is not None:
            self._drop_connection()
        raise PoolUnavailable(
            f"pool at {self._address_text} is not answering (marked down {breaker.open_for_s:.1f} s ago); "
            "not waiting for it"
        )

    def _missed(self, what: str) -> PoolTimeout:
        """The error for `what` not answered within the deadline; trips the breaker."""
        err = PoolTimeout(f"pool at {self._address_text} did not answer {what} within {self.timeout * 1000:.0f} ms")
        if self._breaker is not None:
            self._breaker.trip(str(err))
        return err

    def interrupt(self) -> None:
        """Cut short the request this connection is waiting on, if any (the breaker calls this
        from the thread that tripped it): the waiting thread fails at once and drops the session."""
        sock = self._waiting_sock
        if sock is None:
            return
        self._interrupted = True
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    @contextmanager
    def _request(self) -> Iterator[None]:
        """Hold the connection for one request, connected: waits at most `timeout` for the lock
        (another thread's request on it is bounded by the same deadline)."""
        if not self._lock.acquire(timeout=self.timeout):
            raise PoolUnavailable(f"pool connection to {self._address_text} busy for {self.timeout * 1000:.0f} ms")
        try:
            self._ensure()
            yield
        finally:
            self._lock.release()

    def _can_clean_up(self) -> bool:
        """Whether a release or abort can be sent now (call with the lock held); while the pool
        is marked down the session is dropped instead, which releases all it held."""
        if self.marked_down and self._sock is not None:
            self._drop_connection()
        return self._sock is not None

    def _ensure(self) -> None:
        if self._closed:
            raise PoolUnavailable("client is closed")
        self._refuse_if_down()
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

    def connect_now(self, timeout: float | None = None) -> None:
        """Connect (hello, map the region) now instead of in the first request, waiting up to
        `timeout` seconds (default: the request deadline); raises `PoolError` like a request."""
        with self._lock:
            deadline, self.timeout = self.timeout, timeout or self.timeout
            try:
                self._ensure()
            finally:
                self.timeout = deadline

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _heartbeat(self) -> None:
        while not self._hb_stop.is_set():
            lease = float(self.hello.get("lease_s", 30.0))
            if self._hb_stop.wait(max(0.05, lease / 4)):
                return
            if self.marked_down or not self._lock.acquire(timeout=lease / 4):
                continue
            try:
                if self._sock is not None and not self.marked_down and time.monotonic() - self._last_io > lease / 4:
                    self._roundtrip("ping", {})
            except PoolError as exc:
                logger.debug("heartbeat failed: %s", exc)
            finally:
                self._lock.release()

    # -- request/reply ----------------------------------------------------------------------
    def _roundtrip(self, op: str, args: dict[str, Any]) -> Any:
        """Send `op` and return its result, within one deadline (`timeout`) from now."""
        deadline = time.monotonic() + self.timeout
        self._waiting_sock = self._sock
        try:
            self._drain(deadline)
            req_id = self._send(op, args, deadline)
            return self._reply(op, req_id, deadline)
        finally:
            self._waiting_sock = None

    def _send(self, op: str, args: dict[str, Any], deadline: float) -> int:
        sock = self._sock
        if sock is None:
            raise PoolUnavailable("not connected")
        req_id = next(self._ids)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            sock.sendall(P.encode_request(req_id, op, args))
        except TimeoutError as exc:
            self._drop_connection()
            raise self._missed(op) from exc
        except OSError as exc:  # the service may have refused the connection just before
            interrupted = self._interrupted
            refusal = None if interrupted else _pending_refusal(sock)
            self._drop_connection()
            if refusal is not None:
                self._raise_connection_error(op, refusal)
            raise self._went_away(op, exc, interrupted) from exc
        return req_id

    def _went_away(self, op: str, exc: BaseException, interrupted: bool) -> PoolUnavailable:
        if interrupted:
            return PoolUnavailable(f"{op} to pool at {self._address_text} cut short: the pool is marked down")
        return PoolUnavailable(f"pool at {self._address_text} went away during {op}: {exc}")

    def _send_unanswered(self, op: str, args: dict[str, Any]) -> None:
        """Send a request whose reply is read (and checked) before the next one's, not now."""
        deadline = time.monotonic() + self.timeout
        self._waiting_sock = self._sock
        try:
            self._drain(deadline)
            self._unanswered.append((op, self._send(op, args, deadline)))
        finally:
            self._waiting_sock = None

    def _drain(self, deadline: float) -> None:
        """Read the replies of requests sent by `_send_unanswered`; an error reply is logged."""
        while self._unanswered:
            op, req_id = self._unanswered[0]
            try:
                self._reply(op, req_id, deadline)
            except PoolProtocolError as exc:
                logger.warning("pool %s: %s", self._address_text, exc)
            finally:
                if self._unanswered and self._unanswered[0][1] == req_id:
                    self._unanswered.pop(0)

    def _reply(self, op: str, req_id: int, deadline: float) -> Any:
        sock = self._sock
        if sock is None:
            raise PoolUnavailable("not connected")
        try:
            n = P.LEN.unpack(_recv_exact(sock, 4, deadline))[0]
            if n > P.MAX_FRAME:
                # The rest of that frame is still on the wire: this byte stream is out of step for
                # good, so drop it; the next call reconnects.
                self._drop_connection()
                raise PoolProtocolError(f"reply frame of {n} bytes to {op} exceeds {P.MAX_FRAME}; connection dropped")
            body = _recv_exact(sock, n, deadline)
        except TimeoutError as exc:
            # Its reply may still come: this byte stream is out of step, so the session goes.
            self._drop_connection()
            raise self._missed(op) from exc
        except (OSError, EOFError) as exc:
            interrupted = self._interrupted
            self._drop_connection()
            raise self._went_away(op, exc, interrupted) from exc
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
        with self._request():
            gen = self._gen
            try:
                return self._roundtrip(op, args)
            except PoolTimeout:
                raise  # the service did not answer: asking again would only wait again
            except PoolUnavailable:
                if op not in _IDEMPOTENT or self.marked_down:
                    raise
            # safe to retry once on a fresh connection (e.g. the service restarted)
            self._retry_at = 0.0
            self._ensure()
            if self._gen == gen:
                raise PoolUnavailable(f"{op}: reconnect did not happen")
            return self._roundtrip(op, args)


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
        deadline = time.monotonic() + 0.5
        n = P.LEN.unpack(_recv_exact(sock, 4, deadline))[0]
        if n > P.MAX_HELLO_FRAME:
            return None
        reply = P.decode_reply(_recv_exact(sock, n, deadline))
    except (OSError, EOFError, P.FrameError):
        return None
    return None if reply.ok else reply


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(remaining)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed by the pool service")
        got += k
    return bytes(buf)


def probe_service(address: str, token: str | None, deadline_s: float, *, patience_s: float = PROBE_PATIENCE_S) -> None:
    """Return once the service at `address` answers: its hello within `patience_s` (a stopped
    service answers the moment it resumes), then a ping within `deadline_s`. Raises
    `PoolError` otherwise. A connection of its own, no region mapped, no breaker."""
    conn = PoolConnection(address, token, timeout=patience_s, heartbeat=False)
    try:
        with conn._lock:
            conn._sock = conn._open_socket()
            conn._roundtrip("hello", conn._hello_args())
            t0 = time.monotonic()
            conn._roundtrip("ping", {})
            took = time.monotonic() - t0
    finally:
        conn.close()
    if took > deadline_s:
        raise PoolTimeout(f"pool at {address} answered a ping in {took * 1000:.0f} ms, over {deadline_s * 1000:.0f} ms")


def process_breaker(address: str, token: str | None, deadline_s: float) -> PoolBreaker:
    """The breaker every connection of this process to `address` shares (see breaker.py)."""

    def make_probe() -> Probe:
        return lambda deadline, stop: probe_service(address, token, deadline)

    return shared_breaker(address, deadline_s, make_probe)


def _presence_reader(region: Region, hello: dict[str, Any]) -> PresenceReader | None:
    """The presence table `hello` names in `region`; None where the pool keeps none (or it does
    not verify: lookups then ask the service)."""
    buckets = int(hello.get("presence_buckets") or 0)
    if not buckets:
        return None
    try:
        return PresenceReader(region.view, int(hello["presence_offset"]), buckets)
    except (ValueError, TypeError, IndexError) as exc:
        logger.warning("pool %s: presence table not usable (%s); lookups ask the service", hello.get("pool"), exc)
        return None
