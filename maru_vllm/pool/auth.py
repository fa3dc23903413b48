"""The shared-secret token: how it is read from a file and how strong it must be.

One home for the rules both sides apply (the service at start, the CLI and the connector when
they read a token file), so a weak or exposed secret is refused with one line everywhere.
"""

from __future__ import annotations

import os
import stat

from maru_vllm.pool.errors import InvalidArgument

MIN_TOKEN_CHARS = 16
HOW_TO_MAKE = "head -c 32 /dev/urandom | base64 > FILE && chmod 600 FILE"


def check_token(token: str, where: str = "the token") -> str:
    """Refuse a token too short to resist guessing."""
    if len(token) < MIN_TOKEN_CHARS:
        raise InvalidArgument(
            f"{where} is {len(token)} characters long; use at least {MIN_TOKEN_CHARS} (e.g. {HOW_TO_MAKE})"
        )
    return token


def read_token_file(path: str) -> str:
    """The token in `path`; refuses an unreadable, empty, short, or group/world-readable file."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise InvalidArgument(f"cannot read token file {path!r}: {exc.strerror}") from exc
    if st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        raise InvalidArgument(
            f"token file {path!r} is readable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"chmod 600 {path}"
        )
    if not token:
        raise InvalidArgument(f"token file {path!r} is empty")
    return check_token(token, f"the token in {path!r}")
