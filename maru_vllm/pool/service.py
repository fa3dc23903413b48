"""The pool service: an asyncio server that owns the region and the metadata index.

It handles metadata only - clients write and read payload bytes directly in the shared region.
Each connection is one session; when the connection closes (the client exited or was killed)
its reservations and pins are released at once, and a lease (refreshed by any request,
including the client's idle pings) releases a session whose peer went silent without closing.

Peers are untrusted until `hello`: an unauthenticated connection gets one small frame
(MAX_HELLO_FRAME) within `hello_timeout_s`, and anything but a valid hello closes it. Connections
are capped (`max_connections`, derived from the open-file limit by default); peers still waiting
for hello may hold at most half the slots, and the oldest of them makes room for a newcomer, so
idle sockets can never lock real clients out. Failed authentications are spaced out
service-wide, and repeated errors reach the log a few lines at a time (`logthrottle`).

Size: the service is one asyncio server whose op handlers, session expiry, heartbeats and
startup (region, recovery, tier) share one loop and one state; the index, the snapshot pages,
the tier and the metrics live in their own modules.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO, cast

import msgspec

from maru_vllm.pool import chunk_codec
from maru_vllm.pool import messages as M
from maru_vllm.pool import protocol as P
from maru_vllm.pool.address import Address, default_listen, parse_address
from maru_vllm.pool.allocator import Allocator
from maru_vllm.pool.auth import check_token
from maru_vllm.pool.catalog import Catalog
from maru_vllm.pool.connections import Conn, ConnectionSlots, peer_name
from maru_vllm.pool.errors import PoolError
from maru_vllm.pool.events import EventPublisher
from maru_vllm.pool.index import DEFAULT_MAX_OBJECTS, DEFAULT_METADATA_BUDGET, PoolIndex
from maru_vllm.pool.layout import Layout
from maru_vllm.pool.logthrottle import AuthThrottle, ThrottledLog
from maru_vllm.pool.metrics import PoolMetrics
from maru_vllm.pool.objects import key_digest, validate
from maru_vllm.pool.presence import BEAT_S, PresenceTable, table_bytes
from maru_vllm.pool.records import MetaIO, Obj, SessionLimits
from maru_vllm.pool.recovery import RecoveryReport, recover
from maru_vllm.pool.region import Recover, Region
from maru_vllm.pool.snapshot_pages import DEFAULT_MAX_PAGES, SharedPages
from maru_vllm.pool.tier2 import Tier2, Tier2Settings, start_tier2

logger = logging.getLogger(__name__)

READY_LINE = "maru-pool serving on {address}"
DEFAULT_MAX_PINS_PER_OBJECT = 1024


@dataclass
class ServiceConfig:
    name: str
    size: int
    backend: str = "shm"
    path: str | None = None
    listen: list[str] = field(default_factory=list)
    nats: str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    token: str | None = None
    keep_region: bool = False
    lease_s: float = 30.0
    group: int | None = None
    force: bool = False  # replace a region path that holds something other than a Maru region
    hello_timeout_s: float = 10.0
    max_connections: int | None = None  # None: min(1024, open-file limit - connections.FD_RESERVE)
    session_reserve_limit: int | None = None  # bytes; None: half the region
    session_pin_limit: int | None = None  # bytes; None: half the region
    max_pins_per_object: int = DEFAULT_MAX_PINS_PER_OBJECT
    max_objects: int = DEFAULT_MAX_OBJECTS
    metadata_budget: int = DEFAULT_METADATA_BUDGET
    # buckets of the presence table (`pool.presence`); None: sized from the region; 0: none
    presence_buckets: int | None = None
    # encoded snapshot pages kept for readers of the unchanged pool (`pool.snapshot_pages`); 0: none
    shared_snapshot_pages: int = DEFAULT_MAX_PAGES
    # the cluster-wide second tier under this pool (`pool.tier2`); None: none
    tier2: Tier2Settings | None = None
    # a region left at the path: recover its objects when it can be ("auto"), always ("require":
    # refuse to start otherwise), or never (start an empty one); see region.py and recovery.py
    recover: Recover = "auto"


class PoolService:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.addresses: list[Address] = [parse_address(a) for a in cfg.listen] or [default_listen(cfg.name)]
        if any(a.kind == "tcp" for a in self.addresses) and not cfg.token:
            raise PoolError("a tcp listen address needs a shared-secret token (--token-file)")
        if cfg.token is not None:
            check_token(cfg.token)
        self._log = ThrottledLog(logger)
        self.slots = ConnectionSlots(cfg.max_connections, self._log)
        self._auth = AuthThrottle()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.region: Region | None = None
        self.index: PoolIndex | None = None
        self.presence: PresenceTable | None = None
        self.catalog: Catalog | None = None
        self.recovery: RecoveryReport | None = None  # what the warm restart found, if this start was one
        self.metrics = PoolMetrics(cfg.name, self._stats_from_any_thread)
        self.publisher: EventPublisher | None = None
        self.seq = 0
        self._shared_pages = SharedPages(max_pages=cfg.shared_snapshot_pages)
        self._pages_encoded = 0
        self.started = time.time()
        self._servers: list[asyncio.AbstractServer] = []
        self._conns: dict[int, asyncio.StreamWriter] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.metrics_port: int | None = None
        self.tier2: Tier2 | None = None
        self._serving = False  # start() completed

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> list[str]:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(self._loop_exception)
        if self.cfg.presence_buckets and table_bytes(self.cfg.presence_buckets) > self.cfg.size // 2:
            raise PoolError(
                f"a presence table of {self.cfg.presence_buckets} buckets ({table_bytes(self.cfg.presence_buckets)}"
                f" bytes) takes more than half the region ({self.cfg.size} bytes); use fewer --presence-buckets,"
                " or 0 for none"
            )
        for a in self.addresses:
            if a.kind == "unix":
                _refuse_live_socket(a.path)
        cfg = self.cfg
        self.region = Region.create(
            cfg.name,
            cfg.size,
            backend=cfg.backend,
            path=cfg.path,
            group=cfg.group,
            force=cfg.force,
            layout=lambda size: Layout.decide(size, cfg.max_objects, cfg.presence_buckets),
            recover=cfg.recover,
        )
        try:
            self._build_index()
        except BaseException:
            await self.stop()
            raise
        if self.cfg.nats:
            self.publisher = EventPublisher(self.cfg.nats, self.cfg.name, self._snapshot_page)
            self.publisher.start()
        if self.cfg.tier2 is not None:
            assert self.index is not None and self.region is not None
            self.tier2 = await start_tier2(
                self.cfg.tier2,
                index=self.index,
                view=self.region.view,
                presence=self.presence,
                verify=self._verify,
                pool_name=self.cfg.name,
                incarnation=self.region.info.incarnation,
                nats=self.cfg.nats,
            )
        served = []
        try:
            for a in self.addresses:
                try:
                    if a.kind == "unix":
                        srv = await asyncio.start_unix_server(self._handle, path=a.path, limit=P.MAX_FRAME)
                        os.chmod(a.path, 0o660 if self.cfg.group is not None else 0o600)
                        if self.cfg.group is not None:
                            os.chown(a.path, -1, self.cfg.group)
                        served.append(str(a))
                    else:
                        srv = await asyncio.start_server(self._handle, host=a.host, port=a.port, limit=P.MAX_FRAME)
                        port = srv.sockets[0].getsockname()[1]
                        served.append(str(Address("tcp", host=a.host, port=port)))
                except OSError as exc:
                    raise PoolError(f"cannot listen on {a}: {exc.strerror or exc}") from exc
                self._servers.append(srv)
            if self.cfg.metrics_port is not None:
                try:
                    self.metrics_port = self.metrics.serve(self.cfg.metrics_port, self.cfg.metrics_host)
                except OSError as exc:
                    where = f"{self.cfg.metrics_host}:{self.cfg.metrics_port}"
                    raise PoolError(f"cannot serve metrics on {where}: {exc.strerror or exc}") from exc
        except BaseException:
            await self.stop()
            raise
        self._spawn(self._lease_sweeper())
        if self.presence is not None:
            self._spawn(self._presence_beat(self.presence))
        self._serving = True
        return served

    def _build_index(self) -> None:
        """The presence table, catalog, allocator and index over the region's layout; on a
        recovered region, refilled from what it holds (recovery.py) before anyone can connect."""
        assert self.region is not None and self.region.layout is not None
        region, lay, cfg = self.region, self.region.layout, self.cfg
        half = region.size // 2
        limits = SessionLimits(
            reserve_bytes=cfg.session_reserve_limit if cfg.session_reserve_limit is not None else half,
            pin_bytes=cfg.session_pin_limit if cfg.session_pin_limit is not None else half,
            pins_per_object=cfg.max_pins_per_object,
        )
        if lay.presence_buckets:  # readers ask the service until the table is filled and beats
            self.presence = PresenceTable(region.view, lay.presence_offset, lay.presence_buckets, live=False)
        if lay.catalog_slots:
            self.catalog = Catalog(region.view, lay.catalog_offset, lay.catalog_slots)
            if region.previous is None:
                self.catalog.clear()
        allocator = Allocator(lay.heap_bytes)
        self.index = PoolIndex(
            allocator,
            lay.heap_offset,
            self._on_event,
            limits,
            max_objects=cfg.max_objects,
            metadata_budget=cfg.metadata_budget,
            meta_io=MetaIO(region.view),
            presence=self.presence,
            catalog=self.catalog,
            on_oid_floor=region.set_oid_floor,
        )
        previous = region.previous
        if previous is not None and self.catalog is not None:
            self.recovery = recover(
                region.view, lay.heap_offset, lay.heap_bytes, self.catalog, allocator, self.index, previous.oid_floor
            )
            self.recovery.clean_stop = previous.clean
            logger.info("pool %s: %s", cfg.name, self.recovery.line())
        if self.presence is not None:
            self.presence.beat()

    async def stop(self) -> None:
        if self.presence is not None:
            self.presence.close()  # readers ask the service from now on, and find it gone
        for srv in self._servers:
            srv.close()
        for w in list(self._conns.values()):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        if self.tier2 is not None:  # before the region goes: no tier thread touches it after this
            await self.tier2.stop()
        if self.publisher is not None:
            await self.publisher.close()
        for a in self.addresses:
            if a.kind == "unix":
                try:
                    os.unlink(a.path)
                except FileNotFoundError:
                    pass
        if self.region is not None:
            # a recovered region whose service could not start (a port in use) keeps its objects
            recovered_only = not self._serving and self.region.previous is not None
            self.region.close(unlink=not (self.cfg.keep_region or recovered_only))
            self.region = None

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _presence_beat(self, table: PresenceTable) -> None:
        while True:
            table.beat()
            await asyncio.sleep(BEAT_S)

    async def _lease_sweeper(self) -> None:
        period = max(0.05, min(1.0, self.cfg.lease_s / 4))
        while True:
            await asyncio.sleep(period)
            assert self.index is not None
            for sid in self.index.expired_sessions(self.cfg.lease_s):
                res, pins = self.index.close_session(sid)
                self.index.counters["sessions_expired"] += 1
                logger.warning("session %d lease expired: released %d reservations, %d pins", sid, res, pins)
                w = self._conns.pop(sid, None)
                if w is not None:
                    w.transport.abort()

    # -- connections ------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.index is not None
        conn = Conn(writer, peer_name(writer))
        if not self.slots.admit(conn):
            return
        try:
            while True:
                if conn.sid is None:
                    try:
                        async with asyncio.timeout(self.cfg.hello_timeout_s):
                            body = await self._read_frame(reader, writer, P.MAX_HELLO_FRAME, "before hello")
                    except TimeoutError:
                        self._log.log(
                            logging.WARNING,
                            "hello-timeout",
                            "closed a connection from %s: no hello within %.1f s",
                            conn.peer,
                            self.cfg.hello_timeout_s,
                        )
                        break
                else:
                    body = await self._read_frame(reader, writer, P.MAX_FRAME, "")
                if body is None:
                    break
                t0 = time.perf_counter()
                reply, keep, op = self._dispatch(body, conn.sid)
                if op == "hello" and reply.ok and conn.sid is None:
                    conn.sid = reply.result.session
                    self._conns[conn.sid] = writer
                    self.slots.authenticated(conn)
                elif conn.sid is None and not reply.ok:
                    await self._refused_before_hello(conn, reply)
                data = P.encode_reply(reply)
                if len(data) - P.LEN.size > P.MAX_FRAME:  # never send a frame the peer must refuse
                    data = P.encode_reply(
                        P.error_reply(
                            reply.id,
                            "too_large",
                            f"the {op} reply of {len(data)} bytes exceeds the {P.MAX_FRAME}-byte frame limit",
                        )
                    )
                writer.write(data)
                if writer.transport.get_write_buffer_size() > (1 << 20):
                    await writer.drain()
                self.metrics.observe(op, time.perf_counter() - t0)
                if not keep:
                    await writer.drain()
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.slots.release(conn)
            if conn.sid is not None:
                self._conns.pop(conn.sid, None)
                res, pins = self.index.close_session(conn.sid)
                if res or pins:
                    logger.info("client %s gone: released %d reservations and %d pins", conn.peer, res, pins)
            writer.transport.abort()

    async def _read_frame(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int, when: str
    ) -> bytes | None:
        """The next frame's body, or None after refusing an oversized one (the stream is then untrusted)."""
        n = P.LEN.unpack(await reader.readexactly(4))[0]
        if n > limit:
            msg = f"frame of {n} bytes exceeds {limit}" + (f", the most accepted {when}" if when else "")
            writer.write(P.encode_reply(P.error_reply(0, "too_large", msg)))
            await writer.drain()
            return None
        return await reader.readexactly(n)

    async def _refused_before_hello(self, conn: Conn, reply: P.Reply) -> None:
        """Log (throttled) why an unauthenticated peer is being closed; space out wrong tokens."""
        code = reply.error.code if reply.error else "?"
        if code == "auth_failed":
            delay = self._auth.delay_for_failure()
            self._log.log(
                logging.WARNING,
                "auth-failed",
                "authentication failed from %s (%d failures so far)",
                conn.peer,
                self._auth.failures,
            )
            await asyncio.sleep(delay)
        else:
            self._log.log(
                logging.WARNING,
                f"pre-hello-{code}",
                "closed a connection from %s before hello: %s: %s",
                conn.peer,
                code,
                reply.error.message if reply.error else "",
            )

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's own errors (e.g. accept() out of descriptors) go through the throttled log."""
        exc = context.get("exception")
        self._log.log(
            logging.ERROR,
            f"loop-{context.get('message')}",
            "%s%s",
            context.get("message"),
            f": {type(exc).__name__}: {exc}" if exc else "",
        )

    def _dispatch(self, body: bytes, sid: int | None) -> tuple[P.Reply, bool, str]:
        """(reply, keep the connection open, op label for metrics)."""
        assert self.index is not None
        try:
            req = P.decode_request(body)
        except P.FrameError as exc:
            return P.error_reply(0, exc.code, str(exc)), sid is not None, "invalid"
        if req.v != P.PROTOCOL_VERSION:
            msg = f"protocol version {req.v} is not supported; this service speaks version {P.PROTOCOL_VERSION}"
            return P.error_reply(req.id, "bad_version", msg), sid is not None, "invalid"
        op = req.op if req.op in P.OP_ARGS else "invalid"
        try:
            args = P.decode_args(req.op, req.args)
            if sid is None:
                if req.op != "hello":
                    return P.error_reply(req.id, "auth_required", "the first request must be hello"), False, op
                reply, keep = self._hello(req.id, cast(P.HelloArgs, args))  # decode_args("hello") made it
                return reply, keep, op
            if sid not in self.index.sessions:
                return P.error_reply(req.id, "session_expired", "session lease expired; reconnect"), False, op
            if req.op == "hello":
                return P.error_reply(req.id, "bad_request", "hello was already done on this connection"), True, op
            self.index.touch_session(sid)
            result = getattr(self, f"_op_{req.op}")(sid, args)
            return P.Reply(P.PROTOCOL_VERSION, req.id, True, result), True, op
        except P.FrameError as exc:
            if sid is None:  # nothing but a valid hello is accepted before authentication
                return P.error_reply(req.id, exc.code, str(exc)), False, op
            return P.error_reply(req.id, exc.code, str(exc)), True, op
        except Exception as exc:  # a bug must not take the service down; the client gets it
            self._log.log(logging.ERROR, f"op-failed-{op}", "op %r failed", req.op, exc_info=True)
            return P.error_reply(req.id, "internal", f"{req.op} failed: {type(exc).__name__}: {exc}"), True, op

    def _hello(self, req_id: int, args: P.HelloArgs) -> tuple[P.Reply, bool]:
        assert self.index is not None and self.region is not None
        if self.cfg.token is not None:
            if args.token is None:
                return P.error_reply(req_id, "auth_required", "this pool requires a token"), False
            if not hmac.compare_digest(args.token.encode(), self.cfg.token.encode()):
                return P.error_reply(req_id, "auth_failed", "invalid token"), False
        sid = self.index.open_session(f"{args.client}:{args.pid}")
        info = self.region.info
        return P.Reply(
            P.PROTOCOL_VERSION,
            req_id,
            True,
            M.HelloResult(
                session=sid,
                pool=self.cfg.name,
                incarnation=info.incarnation,
                region_uuid=info.region_uuid,
                region_path=info.path,
                region_size=info.size,
                data_offset=info.data_offset,
                backend=info.backend,
                lease_s=self.cfg.lease_s,
                protocol=P.PROTOCOL_VERSION,
                chunk_meta_format=chunk_codec.FORMAT,
                presence_offset=self.presence.offset if self.presence is not None else 0,
                presence_buckets=self.presence.buckets if self.presence is not None else 0,
            ),
        ), True

    # -- ops --------------------------------------------------------------------------------
    @property
    def _live_index(self) -> PoolIndex:
        """The index; ops run only on connections, which start() accepts after it made the index."""
        assert self.index is not None
        return self.index

    def _op_ping(self, sid: int, args: P.EmptyArgs) -> str:
        return "pong"

    def _op_lookup(self, sid: int, args: P.KeysArgs) -> list[bool]:
        return self._live_index.lookup(args.ns, args.keys)

    def _op_lookup_prefix(self, sid: int, args: P.KeysArgs) -> int:
        return self._live_index.lookup_prefix(args.ns, args.keys)

    def _op_reserve(self, sid: int, args: P.ReserveArgs) -> list[M.Placement | None]:
        objs = self._live_index.reserve(sid, args.ns, args.items)
        return [None if o is None else M.Placement(o.oid, o.payload_offset, o.size) for o in objs]

    def _op_commit(self, sid: int, args: P.CommitArgs) -> list[bool]:
        metas = args.metas if args.metas is not None else [None] * len(args.oids)
        if len(metas) != len(args.oids):
            raise P.FrameError("bad_request", f"commit has {len(args.oids)} oids but {len(metas)} metas")
        parts = args.parts if args.parts is not None else [None] * len(args.oids)
        if len(parts) != len(args.oids):
            raise P.FrameError("bad_request", f"commit has {len(args.oids)} oids but {len(parts)} part lists")
        encoded: list[bytes | None] = []
        for m, p in zip(metas, parts):
            if isinstance(m, bytes):
                problem = chunk_codec.problem(m)
                if problem is not None:
                    raise P.FrameError("bad_request", f"meta: {problem}")
                size = len(m) + sum(map(len, p or ()))
                if size > P.MAX_META_BYTES:
                    raise P.FrameError(
                        "bad_request",
                        f"meta and part keys of {size} bytes exceed {P.MAX_META_BYTES} bytes per object",
                    )
                encoded.append(m)
                continue
            try:
                e = None if m is None else M.encode_meta_json(m)
            except RecursionError:  # what the frame decoder just managed, a few frames higher up
                raise P.FrameError("bad_request", f"meta nests deeper than {P.MAX_META_DEPTH} levels") from None
            # nesting depth <= number of lists/objects <= number of opening brackets in the JSON
            # (some may sit in strings): most metas are vouched for by two C-speed counts
            if (
                e is not None
                and e.count(b"[") + e.count(b"{") > P.MAX_META_DEPTH
                and P.nesting_depth(m) > P.MAX_META_DEPTH
            ):
                raise P.FrameError("bad_request", f"meta nests deeper than {P.MAX_META_DEPTH} levels")
            size = (len(e) if e is not None else 0) + sum(map(len, p or ()))
            if size > P.MAX_META_BYTES:
                raise P.FrameError(
                    "bad_request",
                    f"meta (as JSON) and part keys of {size} bytes exceed {P.MAX_META_BYTES} bytes per object",
                )
            encoded.append(e)
        return self._live_index.commit(sid, args.oids, encoded, self._verify, parts)

    def _op_abort(self, sid: int, args: P.OidsArgs) -> int:
        return self._live_index.abort(sid, args.oids)

    def _op_acquire(self, sid: int, args: P.KeysArgs) -> list[M.Placement | None]:
        objs = self._live_index.acquire(sid, args.ns, args.keys)
        return [None if o is None else M.Placement(o.oid, o.payload_offset, o.size) for o in objs]

    def _op_lookup_parts(self, sid: int, args: P.KeysArgs) -> list[int]:
        return self._live_index.lookup_parts(args.ns, args.keys)

    def _op_acquire_parts(self, sid: int, args: P.KeysArgs) -> list[M.PartPlacement | None]:
        found = self._live_index.acquire_parts(sid, args.ns, args.keys)
        return [
            None if f is None else M.PartPlacement(f[0].oid, f[0].payload_offset, f[0].size, f[0].key, f[1])
            for f in found
        ]

    def _op_release(self, sid: int, args: P.OidsArgs) -> int:
        return self._live_index.release(sid, args.oids, args.bad)

    def _op_remove(self, sid: int, args: P.RemoveArgs) -> int:
        return self._live_index.remove(args.ns, args.keys)

    def _op_promote(self, sid: int, args: P.KeysArgs) -> int:
        return self.tier2.promote(args.ns, args.keys) if self.tier2 is not None else 0

    def _op_stats(self, sid: int, args: P.EmptyArgs) -> dict[str, Any]:
        return self._stats()

    def _op_snapshot(self, sid: int, args: P.SnapshotArgs) -> bytes:
        # pages of the most recently used also move with reads (no events): never shared
        shared = args.recent == 0 and self._shared_pages.max_pages > 0
        key = (args.encoding, args.ns, args.after, args.limit, tuple(args.prefixes or ()))
        if shared and (page := self._shared_pages.get(key, self.seq)) is not None:
            return page
        if args.encoding == "msgpack":
            page = M.msgpack_encoder.encode(
                self._packed_page(args.ns, args.after, args.limit, P.SNAPSHOT_PAGE_BYTES, args.recent, args.prefixes)
            )
        else:
            page = M.json_encoder.encode(
                self._snapshot_page(args.ns, args.after, args.limit, P.SNAPSHOT_PAGE_BYTES, args.recent, args.prefixes)
            )
        self._pages_encoded += 1
        if shared:
            self._shared_pages.put(key, self.seq, page)
        return page

    # -- helpers ----------------------------------------------------------------------------
    def _verify(self, obj: Obj) -> str | None:
        """Check the header the writer wrote (not the payload checksum: the service never
        reads payload bytes; readers check the checksum)."""
        assert self.region is not None
        v = self.region.view
        hdr = v[obj.header_offset : obj.payload_offset]
        payload = v[obj.payload_offset : obj.payload_offset + obj.size]
        return validate(hdr, payload, obj.oid, obj.size, key_digest(obj.ns, obj.key), check_crc=False)

    def _on_event(self, kind: M.EventType, obj: Obj) -> None:
        self.seq += 1
        if self.tier2 is not None:
            self.tier2.on_event(kind, obj.ns, obj.key, obj.session)
        if self.publisher is None or self.region is None:
            return
        assert self.index is not None
        meta = self.index.meta_of(obj)
        binary = meta is not None and chunk_codec.is_binary(meta)
        self.publisher.emit(
            M.encode_event(
                M.PoolEventMsg(
                    type=kind,
                    seq=self.seq,
                    incarnation=self.region.info.incarnation,
                    pool=self.cfg.name,
                    namespace=obj.ns,
                    key=obj.key.hex(),
                    size=obj.size,
                    meta=M.NULL if meta is None or binary else msgspec.Raw(meta),
                    ts=time.time(),
                    bmeta=meta if binary else None,
                )
            )
        )

    def _snapshot_page(
        self,
        ns: str | None,
        after: int,
        limit: int,
        max_bytes: int,
        recent: int = 0,
        prefixes: list[str] | None = None,
    ) -> M.SnapshotPage:
        assert self.index is not None and self.region is not None
        objs, nxt = self.index.snapshot_page(ns, after, limit, max_bytes, recent=recent, prefixes=prefixes)
        return M.SnapshotPage(
            self.cfg.name,
            self.region.info.incarnation,
            self.seq,
            [o.info(self.index.meta_of(o)) for o in objs],
            nxt,
            len(self.index.objects),
        )

    def _packed_page(
        self,
        ns: str | None,
        after: int,
        limit: int,
        max_bytes: int,
        recent: int = 0,
        prefixes: list[str] | None = None,
    ) -> M.PackedSnapshotPage:
        assert self.index is not None and self.region is not None
        objs, nxt = self.index.snapshot_page(ns, after, limit, max_bytes, recent=recent, prefixes=prefixes)
        return M.PackedSnapshotPage(
            self.cfg.name,
            self.region.info.incarnation,
            self.seq,
            [M.PackedObject(o.ns, o.key.hex(), o.size, self.index.meta_of(o)) for o in objs],
            nxt,
            len(self.index.objects),
        )

    def _stats_from_any_thread(self) -> dict[str, Any]:
        """`_stats`, computed on the event loop (the index is not thread-safe; scrapes run on
        the metrics server's thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return {}
        try:
            if asyncio.get_running_loop() is loop:
                return self._stats()
        except RuntimeError:
            pass
        fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()

        def compute() -> None:
            try:
                fut.set_result(self._stats())
            except Exception as exc:  # handed to the scraping thread
                fut.set_exception(exc)

        try:
            loop.call_soon_threadsafe(compute)
        except RuntimeError:  # the loop is closing
            return {}
        return fut.result(timeout=10)

    def _stats(self) -> dict[str, Any]:
        if self.index is None or self.region is None:
            return {}
        st = self.index.stats()
        lim = self.index.limits
        st.update(
            session_reserve_limit=lim.reserve_bytes,
            session_pin_limit=lim.pin_bytes,
            max_pins_per_object=lim.pins_per_object,
            connections=self.slots.open,
            connections_waiting_for_hello=len(self.slots.pending),
            max_connections=self.slots.max_connections,
            auth_failures=self._auth.failures,
            presence_entries=self.presence.entries if self.presence is not None else 0,
            presence_spilled=self.presence.spilled_entries if self.presence is not None else 0,
            presence_slots=self.presence.buckets * 8 if self.presence is not None else 0,
            snapshot_pages_shared=self._shared_pages.hits,
            snapshot_pages_encoded=self._pages_encoded,
            catalog_slots=self.catalog.slots if self.catalog is not None else 0,
            catalog_used=self.catalog.used if self.catalog is not None else 0,
            catalog_full=self.catalog.full_refusals if self.catalog is not None else 0,
        )
        rec, previous = self.recovery, self.region.previous
        st.update(
            recovered_objects=rec.recovered if rec is not None else 0,
            recovery_dropped=rec.dropped_total if rec is not None else 0,
            recovery_seconds=round(rec.seconds, 3) if rec is not None else 0.0,
            last_stop=None if previous is None else ("clean" if previous.clean else "unclean"),
        )
        pub = self.publisher
        st.update(
            pool=self.cfg.name,
            incarnation=self.region.info.incarnation,
            region_path=self.region.info.path,
            backend=self.region.info.backend,
            region_size=self.region.size,
            uptime_s=time.time() - self.started,
            event_seq=self.seq,
            nats=self.cfg.nats,
            nats_connected=bool(pub and pub.connected),
            event_queue=pub.pending if pub else 0,
            events_published=pub.published if pub else 0,
            events_dropped=pub.dropped if pub else 0,
        )
        if self.tier2 is not None:
            st.update(self.tier2.stats())
        return st


def _refuse_live_socket(path: str) -> None:
    if not os.path.exists(path):
        return
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1)
        s.connect(path)
    except OSError:
        return  # stale socket file; asyncio replaces it
    finally:
        s.close()
    raise PoolError(f"another pool service is already listening on {path}")


def announce_ready(addresses: list[str], stream: TextIO) -> None:
    """Write one ready line per served address, each in a single ``write``.

    A launcher usually sends stdout and stderr to one log file, and with
    ``PYTHONUNBUFFERED`` ``print`` writes the text and its newline separately:
    a log record from another thread could land between them and break the
    line the launcher waits for.
    """
    for address in addresses:
        stream.write(READY_LINE.format(address=address) + "\n")
        stream.flush()


async def serve(cfg: ServiceConfig, *, print_ready: bool = True) -> int:
    """Run until SIGINT/SIGTERM; the CLI entry point."""
    svc = PoolService(cfg)
    served = await svc.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    logger.info("pool %s: event loop %s", cfg.name, type(loop).__module__.split(".")[0])
    if print_ready:
        announce_ready(served, sys.stdout)
        if svc.metrics_port is not None:
            logger.info("metrics port %d", svc.metrics_port)
    await stop.wait()
    logger.info("stopping pool %s", cfg.name)
    await svc.stop()
    return 0
