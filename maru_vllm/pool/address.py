"""Pool addresses: ``unix:///path.sock`` (or a bare path) and ``tcp://host:port``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from maru_vllm.pool.errors import InvalidArgument

UNIX_PATH_MAX = 107


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
        rest = text[len("tcp://"):]
        host, sep, port_s = rest.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
            raise InvalidArgument(f"invalid address {text!r}: {allowed} (port 0-65535)")
        return Address("tcp", host=host, port=int(port_s))
    if text.startswith("unix://"):
        path = text[len("unix://"):]
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
    return Address("unix", path=f"/tmp/maru-{name}.sock")
