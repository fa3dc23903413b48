"""`Tier2Store` over Mooncake Store (`mooncake.store.MooncakeDistributedStore`).

The pool service is a Mooncake Store client: it contributes `segment_size` bytes of its memory
to the cluster's store (Mooncake places replicas in any client's segment) and reads and writes
objects through Mooncake's transfer engine (`protocol` tcp or rdma) under the master's
placement. Objects move through two registered staging buffers of this client, one for puts and
one for gets (`put_from` / `get_into`: no copies inside the binding); each buffer belongs to one
thread of the tier, so calls of one kind never share one.

Return codes are Mooncake's `ErrorCode`s (mooncake-store/include/types.h): an object that is not
there (never stored, evicted, lost with a restarted master) is a miss; a full store refuses a
put; an RPC or transfer failure means the store cannot be asked (`Tier2Error`). The connection
is made on first use and again after `close`, so a master that is not up when the pool starts
is reached once it is (the tier's probe calls `probe`, which connects).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maru_vllm.pool.tier2.interface import Tier2Error, Tier2Store

logger = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
DEFAULT_PROTOCOL = "tcp"
DEFAULT_SEGMENT_SIZE = 1 << 30
DEFAULT_LOCAL_BUFFER = 16 << 20
# Mooncake's ErrorCode values this module tells apart.
_OBJECT_ALREADY_EXISTS = -705
_MISSING = frozenset({-703, -704, -707, -710, -712})  # not ready, not found, lease expired, replica gone
_UNREACHABLE = frozenset({-1, -800, -900, -901})  # internal, transfer, RPC failed, RPC timeout
_PROBE = "maru1-probe"  # a one-byte object the probe puts (no pool object has this name)


@dataclass(frozen=True)
class MooncakeConfig:
    """Where the Mooncake master is and how this client joins the store."""

    master: str  # HOST:PORT of mooncake_master's RPC service
    metadata: str | None = None  # transfer-engine metadata URL; None: the master's HTTP server on port 8080
    protocol: str = DEFAULT_PROTOCOL
    segment_size: int = DEFAULT_SEGMENT_SIZE  # bytes this client contributes to the store
    local_buffer: int = DEFAULT_LOCAL_BUFFER
    host: str | None = None  # the address peers reach this client at; None: the one facing the master
    device: str = ""  # RDMA device names ("" picks them)

    @property
    def metadata_url(self) -> str:
        if self.metadata is not None:
            return self.metadata
        host = self.master.rsplit(":", 1)[0]
        return f"http://{host}:8080/metadata"


def validate_master(value: str) -> str:
    """HOST:PORT, else ValueError naming what is allowed."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid Mooncake master {value!r}: use HOST:PORT (the master's --rpc_port)")
    return value


def validate_metadata(value: str) -> str:
    if value != "P2PHANDSHAKE" and not value.startswith(("http://", "https://", "etcd://", "redis://")):
        raise ValueError(
            f"invalid Mooncake metadata {value!r}: use http://HOST:PORT/metadata (the master's built-in server),"
            " etcd://..., redis://... or P2PHANDSHAKE"
        )
    return value


def local_address_towards(master: str) -> str:
    """The address of this host on the route to the master (no packet is sent)."""
    host, _, port = master.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class _Staging:
    """An anonymous mapping registered with the store, grown on demand (one thread uses it)."""

    def __init__(self) -> None:
        self.map: mmap.mmap | None = None
        self.addr = 0
        self.size = 0

    def ensure(self, store: Any, size: int) -> None:
        if size <= self.size:
            return
        self.release(store)
        size = max(size, 1 << 20)
        size = 1 << (size - 1).bit_length()
        m = mmap.mmap(-1, size)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        rc = store.register_buffer(addr, size)
        if rc != 0:
            m.close()
            raise Tier2Error(f"Mooncake refused to register a {size}-byte staging buffer (error {rc})")
        self.map, self.addr, self.size = m, addr, size

    def release(self, store: Any) -> None:
        if self.map is None:
            return
        if store is not None:
            try:
                store.unregister_buffer(self.addr)
            except Exception as exc:  # the binding's own errors: the mapping goes anyway
                logger.debug("unregistering a staging buffer: %s", exc)
        self.addr = self.size = 0
        self.map = None  # unmapped when the last view of it goes


class MooncakeStore(Tier2Store):
    """One Mooncake Store client (see the module docstring)."""

    def __init__(self, cfg: MooncakeConfig) -> None:
        self.cfg = cfg
        self._store: Any = None
        self._connect_lock = threading.Lock()
        self._put_buf = _Staging()
        self._local = threading.local()  # each fetch thread's own get staging buffer
        self._get_bufs: list[_Staging] = []

    def _get_buf(self) -> _Staging:
        buf: _Staging | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = _Staging()
            self._get_bufs.append(buf)
        return buf

    def _connected(self) -> Any:
        store = self._store
        if store is not None:
            return store
        with self._connect_lock:
            if self._store is None:
                try:
                    from mooncake.store import MooncakeDistributedStore
                except ImportError as exc:
                    raise Tier2Error(
                        f"the Mooncake client is not installed ({exc}); install maru-dynamo[mooncake] (make setup)"
                    ) from exc
                store = MooncakeDistributedStore()
                cfg = self.cfg
                host = cfg.host or local_address_towards(cfg.master)
                rc = store.setup(
                    host, cfg.metadata_url, cfg.segment_size, cfg.local_buffer, cfg.protocol, cfg.device, cfg.master
                )
                if rc != 0:
                    try:
                        store.close()
                    except Exception as exc:  # a half set-up client; its error is not ours to report
                        logger.debug("closing a Mooncake client that failed set-up: %s", exc)
                    raise Tier2Error(f"cannot join the Mooncake store at {cfg.master} (setup error {rc})")
                logger.info(
                    "joined the Mooncake store at %s (%s, metadata %s) as %s with a %d MiB segment",
                    cfg.master,
                    cfg.protocol,
                    cfg.metadata_url,
                    host,
                    cfg.segment_size >> 20,
                )
                self._store = store
            return self._store

    def put(self, name: str, data: memoryview) -> bool:
        store = self._connected()
        n = len(data)
        self._put_buf.ensure(store, n)
        assert self._put_buf.map is not None
        self._put_buf.map[:n] = data
        rc = store.put_from(name, self._put_buf.addr, n)
        if rc == 0 or rc == _OBJECT_ALREADY_EXISTS:
            return True
        if rc in _UNREACHABLE:
            raise Tier2Error(f"Mooncake put failed (error {rc})")
        logger.debug("Mooncake refused %s (error %d)", name, rc)
        return False

    def get(self, name: str, size: int | None = None) -> memoryview | None:
        """The object's bytes in this thread's staging buffer; `size` (when known) sizes it."""
        store = self._connected()
        want = size if size is not None else store.get_size(name)
        if want is not None and want < 0:
            return self._miss_or_raise(int(want), "get_size")
        buf = self._get_buf()
        buf.ensure(store, max(int(want or 0), 1))
        rc = store.get_into(name, buf.addr, buf.size)
        if rc < 0:
            return self._miss_or_raise(rc, "get")
        assert buf.map is not None
        return memoryview(buf.map)[:rc]

    @staticmethod
    def _miss_or_raise(rc: int, what: str) -> None:
        if rc in _UNREACHABLE:
            raise Tier2Error(f"Mooncake {what} failed (error {rc})")
        if rc not in _MISSING:
            logger.debug("Mooncake %s: error %d, taken as a miss", what, rc)
        return

    def exists(self, names: Sequence[str]) -> list[bool]:
        store = self._connected()
        codes = store.batch_is_exist(list(names))
        if any(c in _UNREACHABLE or c < 0 for c in codes):
            raise Tier2Error("Mooncake is_exist failed")
        return [c == 1 for c in codes]

    def probe(self) -> None:
        """The master answers, and takes a put: a master that just restarted answers before the
        clients' segments are mounted on it again, and refuses puts until then."""
        store = self._connected()
        rc = store.is_exist(_PROBE)
        if rc < 0:
            raise Tier2Error(f"the Mooncake master at {self.cfg.master} does not answer (error {rc})")
        rc = store.put(_PROBE, b"\0")
        if rc not in (0, _OBJECT_ALREADY_EXISTS):
            raise Tier2Error(f"the Mooncake store at {self.cfg.master} does not take puts yet (error {rc})")

    def close(self) -> None:
        store, self._store = self._store, None
        self._put_buf.release(store)
        for buf in self._get_bufs:
            buf.release(store)
        if store is not None:
            try:
                store.close()
            except Exception as exc:  # closing is best effort
                logger.debug("closing the Mooncake client: %s", exc)
