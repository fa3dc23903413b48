"""Connection slots of the pool service: a cap on connections, and room kept for real clients.

Every accepted connection takes a slot. At most `max_connections` are open; peers that have
not completed `hello` may hold at most half of them (`max_pending`), and when they are all
taken the oldest such peer is dropped to admit the newcomer. Idle or slow unauthenticated
sockets therefore never lock out a client that completes its hello, and the service never
runs out of file descriptors (the default cap leaves FD_RESERVE of the open-file limit free).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass

from maru_vllm.pool import protocol as P
from maru_vllm.pool.address import peer_credentials
from maru_vllm.pool.errors import PoolError
from maru_vllm.pool.logthrottle import ThrottledLog

DEFAULT_MAX_CONNECTIONS = 1024
FD_RESERVE = 32  # descriptors kept for the region, listeners, metrics, NATS and logs


@dataclass(eq=False)
class Conn:
    """One accepted connection; `counted` while it holds a slot, `sid` once hello succeeded."""

    writer: asyncio.StreamWriter
    peer: str
    sid: int | None = None
    counted: bool = True


class ConnectionSlots:
    def __init__(self, max_connections: int | None, log: ThrottledLog) -> None:
        self.max_connections = connection_limit(max_connections)
        self.max_pending = max(1, self.max_connections // 2)
        self.open = 0
        self.pending: dict[Conn, None] = {}  # waiting for hello, oldest first
        self._log = log

    def admit(self, conn: Conn) -> bool:
        """Take a slot for `conn` (dropping the oldest peer still waiting for hello if need be),
        or refuse it with a `too_many_connections` reply when every slot holds a client."""
        if self.open >= self.max_connections and not self.pending:
            _turn_away(
                self._log,
                "conn-refused",
                conn,
                f"the pool has {self.open} connections, its limit (--max-connections "
                f"{self.max_connections}); try again later",
                "refused a connection from %s: %d connections open (--max-connections %d)",
                conn.peer,
                self.open,
                self.max_connections,
            )
            return False
        if self.open >= self.max_connections or len(self.pending) >= self.max_pending:
            oldest = next(iter(self.pending))
            self.release(oldest)
            _turn_away(
                self._log,
                "conn-dropped",
                oldest,
                f"dropped: more than {self.max_pending} connections were waiting for hello "
                f"(half of --max-connections {self.max_connections})",
                "dropped a connection from %s that had not sent hello, to admit %s (%d waiting)",
                oldest.peer,
                conn.peer,
                self.max_pending,
            )
        self.pending[conn] = None
        self.open += 1
        return True

    def authenticated(self, conn: Conn) -> None:
        self.pending.pop(conn, None)

    def release(self, conn: Conn) -> None:
        if conn.counted:
            conn.counted = False
            self.open -= 1
            self.pending.pop(conn, None)


def peer_name(writer: asyncio.StreamWriter) -> str:
    """host:port for TCP peers, pid and uid for unix-socket peers (for log lines)."""
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"{peer[0]}:{peer[1]}"
    try:
        pid, uid, _ = peer_credentials(writer.get_extra_info("socket"))
        return f"unix peer pid {pid} uid {uid}"
    except (OSError, AttributeError):
        return "unix peer"


def _turn_away(log: ThrottledLog, kind: str, conn: Conn, reply: str, why: str, *args: object) -> None:
    """Log (throttled) why `conn` goes, then tell it in a `too_many_connections` reply and close it."""
    log.log(logging.WARNING, kind, why, *args)
    conn.writer.write(P.encode_reply(P.error_reply(0, "too_many_connections", reply)))
    conn.writer.close()  # flushes the reply, then closes


def connection_limit(requested: int | None) -> int:
    """The cap: what was asked (raising the soft open-file limit if it must), or by default as
    many as the open-file limit leaves room for, at most DEFAULT_MAX_CONNECTIONS."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if requested is None:
        return max(4, min(DEFAULT_MAX_CONNECTIONS, soft - FD_RESERVE))
    need = requested + FD_RESERVE
    if need > soft:
        if hard != resource.RLIM_INFINITY and need > hard:
            raise PoolError(
                f"--max-connections {requested} needs {need} open files but the limit is {hard} "
                f"(ulimit -Hn); use at most {hard - FD_RESERVE}"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return requested
