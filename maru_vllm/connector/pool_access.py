"""The connector's link to the pool: never raises, logs once per outage.

Every connector hook runs inside vLLM's scheduler loop or model forward, where an exception
would take the engine down. So each pool call goes through `PoolAccess.call`, which turns any
pool failure into "no result" (a miss for lookups and loads, a skipped store), logs a warning
once when an outage starts and once when it ends, and leaves reconnecting (with backoff) to the
pool client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from vllm.logger import init_logger

from maru_vllm.pool import PoolClient, PoolError

logger = init_logger(__name__)

T = TypeVar("T")


class PoolAccess:
    def __init__(self, address: str, token: str | None, timeout_s: float, checksum: bool, who: str) -> None:
        self.address = address
        self.who = who
        # stores always carry a checksum, so any reader that requires one can vouch for them;
        # `checksum` decides whether this connector's loads require (and verify) one
        self._client = PoolClient(address, token, timeout=timeout_s, checksum=checksum, write_checksum=True)
        self._lock = threading.Lock()
        self._down = False
        self.failures = 0

    @property
    def client(self) -> PoolClient:
        return self._client

    @property
    def available(self) -> bool:
        return not self._down

    def call(self, what: str, fn: Callable[[PoolClient], T]) -> T | None:
        """Run `fn(client)`; on any pool failure return None (and remember the outage)."""
        try:
            result = fn(self._client)
        except PoolError as exc:
            self.failures += 1
            with self._lock:
                if not self._down:
                    self._down = True
                    logger.warning(
                        "Maru pool at %s unavailable (%s during %s): serving without the pool cache "
                        "until it is back", self.address, exc, what,
                    )
                else:
                    logger.debug("Maru pool still unavailable during %s: %s", what, exc)
            return None
        if self._down:
            with self._lock:
                if self._down:
                    self._down = False
                    logger.warning("Maru pool at %s is back (%s); pool caching resumed", self.address, self.who)
        return result

    def close(self) -> None:
        try:
            self._client.close()
        except PoolError as exc:
            logger.debug("closing pool client: %s", exc)
