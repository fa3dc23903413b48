"""Pass-through command lines: is a flag given, with which value, and the defaults we add.

The Maru components add defaults to the arguments they hand to Dynamo and vLLM only where the
user gave none; both `--flag VALUE` and `--flag=VALUE` count as given.
"""

from __future__ import annotations

import json
from collections.abc import Sequence


def has_flag(argv: Sequence[str], *flags: str) -> bool:
    """True when any of `flags` is given as ``--flag VALUE`` or ``--flag=VALUE``."""
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of the first ``--flag VALUE`` / ``--flag=VALUE`` in `argv`, else None."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def kv_events_args(port: int) -> list[str]:
    """vLLM's `--kv-events-config` for a ZMQ publisher of KV events on `port`.

    vLLM binds its publisher itself, and only a wildcard bind delivers: with
    `tcp://127.0.0.1:N` it silently sends nothing.
    """
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    return ["--kv-events-config", json.dumps(config)]
