"""Free ports for the services of a local graph.

A port is chosen here and bound seconds later by another process (a vLLM engine core binds its
KV-event publisher after ~10 s of imports). A port from the kernel's ephemeral range can be taken
in between as the local end of any outgoing connection (the frontend's, a test's HTTP polls), and
the late bind then fails with EADDRINUSE and kills the engine at startup. Ports come from below
the ephemeral range instead, where the kernel never hands one out on its own.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_EPHEMERAL = (32768, 60999)
SERVICE_PORTS_START = 10000
# Dynamo 1.6.1 parses DYN_SYSTEM_PORT as an i16: every port chosen here stays below this.
I16_PORT_LIMIT = 32768
MIN_SERVICE_PORTS = 1000


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux defaults elsewhere)."""
    try:
        low, high = (int(v) for v in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT_EPHEMERAL
    return low, high


def service_port_range() -> range:
    """Ports a service may be given: below the ephemeral range and below 32768."""
    end = min(ephemeral_port_range()[0], I16_PORT_LIMIT)
    if end - SERVICE_PORTS_START < MIN_SERVICE_PORTS:
        raise RuntimeError(
            f"no room for service ports below the ephemeral range {ephemeral_port_range()} "
            f"(need {MIN_SERVICE_PORTS} ports in [{SERVICE_PORTS_START}, {I16_PORT_LIMIT}))"
        )
    return range(SERVICE_PORTS_START, end)


def free_ports(count: int) -> list[int]:
    """`count` distinct ports, free on every address a moment ago, outside the ephemeral range.

    Each candidate is checked with a wildcard bind (a service binding `*:port` conflicts with a
    socket on any address); all are held until every port is chosen, so they differ.
    """
    candidates = service_port_range()
    rng = random.Random()
    sockets: list[socket.socket] = []
    try:
        for _ in range(50 * count + 200):
            if len(sockets) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("0.0.0.0", rng.choice(candidates)))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        if len(sockets) < count:
            raise RuntimeError(f"found only {len(sockets)} of {count} free ports in {candidates}")
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def free_system_port() -> int:
    """A port for `DYN_SYSTEM_PORT` (Dynamo's metrics server); like every port here, below 32768."""
    return free_port()
