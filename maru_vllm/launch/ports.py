"""Free loopback ports for the services of a local graph."""

from __future__ import annotations

import random
import socket


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return `count` distinct ports that were free on `host` a moment ago.

    All sockets are held open until every port is chosen, so the ports differ from each other.
    """
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_system_port(host: str = "127.0.0.1") -> int:
    """A port for `DYN_SYSTEM_PORT` (Dynamo's metrics server) that was free on `host` a moment ago.

    Dynamo 1.6.1 parses DYN_SYSTEM_PORT as an i16, so it must stay below 32768; the kernel's
    ephemeral ports lie above that, hence a random pick from a range below it.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768 for DYN_SYSTEM_PORT")
