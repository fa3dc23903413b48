"""Pool addresses: ``unix:///path.sock`` (or a bare path) and ``tcp://host:port``.

The default socket lives in ``$XDG_RUNTIME_DIR`` or, without one, in a private directory
``/tmp/maru-<uid>`` (mode 0700, owned by the user): a shared directory like /tmp would let
another local user create the socket first and receive the clients' token.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from maru_vllm.pool.errors import InvalidArgument, PoolError

UNIX_PATH_MAX = 107
FALLBACK_RUNTIME_BASE = Path("/tmp")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Address:
    kind: str  # "unix" | "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


def parse_address(text: str) -> Address:
    """Parse an address; errors name the bad value and the allowed forms."""
    allowed = "use unix:///path/to.sock, a bare /path/to.sock, or tcp://host:port"
    if not text:
        raise InvalidArgument(f"invalid address {text!r}: {allowed}")
    if text.startswith("tcp://"):
        rest = text[len("tcp://") :]
        host, sep, port_s = rest.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
            raise InvalidArgument(f"invalid address {text!r}: {allowed} (port 0-65535)")
        return Address("tcp", host=host, port=int(port_s))
    if text.startswith("unix://"):
        path = text[len("unix://") :]
    elif "://" in text:
        raise InvalidArgument(f"invalid address {text!r}: unknown scheme; {allowed}")
    else:
        path = text
    if not path.startswith("/"):
        raise InvalidArgument(f"invalid address {text!r}: the socket path must be absolute; {allowed}")
    if len(path.encode()) > UNIX_PATH_MAX:
        raise InvalidArgument(f"invalid address {text!r}: unix socket paths are limited to {UNIX_PATH_MAX} bytes")
    return Address("unix", path=path)


def default_listen(name: str) -> Address:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and Path(base).is_dir():
        return Address("unix", path=str(Path(base) / f"maru-{name}.sock"))
    return Address("unix", path=str(private_runtime_dir() / f"maru-{name}.sock"))


def private_runtime_dir() -> Path:
    """``FALLBACK_RUNTIME_BASE/maru-<uid>``, created 0700; refused if someone else made it."""
    uid = os.geteuid()
    d = FALLBACK_RUNTIME_BASE / f"maru-{uid}"
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise PoolError(f"cannot create the socket directory {d}: {exc.strerror}") from exc
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) & 0o077:
        raise PoolError(
            f"refusing socket directory {d}: it must be a directory owned by uid {uid} with mode 0700 "
            f"(found {'a directory' if stat.S_ISDIR(st.st_mode) else 'not a directory'}, owner uid {st.st_uid}, "
            f"mode {stat.S_IMODE(st.st_mode):04o}); remove it, or pass --listen / set XDG_RUNTIME_DIR"
        )
    return d


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected unix socket (SO_PEERCRED)."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
