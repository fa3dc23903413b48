"""The connector's link to the pool: never raises, never waits long, logs once per outage.

Every connector hook runs inside vLLM's scheduler loop or model forward, where an exception
would take the engine down. So `PoolAccess` implements the connector's typed view of the pool
(`connector.pool_interface.ConnectorPool`) by running each operation on a `PoolClient` and
turning any pool failure into that operation's "no result" (a miss for lookups and loads, a
skipped store), logging a warning once when an outage starts and once when it ends, and
leaving reconnecting (with backoff) to the pool client.

Every request has a deadline (`maru_pool_deadline_ms`), and every `PoolAccess` of the process
for one pool address shares one circuit breaker (`pool.breaker`): the first request that misses
its deadline marks the pool down for all of them - scheduler lookups, loads, the store writer -
so a pool that is alive but not answering costs the engine one deadline, not one per request;
while it is down each operation answers its failure value at once, and once the breaker's probe
sees the pool answer, the next operation reconnects and pool caching resumes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

from vllm.logger import init_logger

from maru_vllm.connector.pool_interface import ConnectorPool
from maru_vllm.pool import PartPin, PoolClient, PoolError, ReadPin, Reservation
from maru_vllm.pool.chunk_codec import ChunkMeta
from maru_vllm.pool.connection import process_breaker

logger = init_logger(__name__)

T = TypeVar("T")
A = ParamSpec("A")


class PoolAccess(ConnectorPool):
    """`deadline_s`: how long any one request may wait for the pool. `connect_timeout_s`: connect
    (hello, map the region) at once, waiting up to that long, instead of in the first request; a
    failure there is left to the first request to report."""

    def __init__(
        self,
        address: str,
        token: str | None,
        deadline_s: float,
        checksum: bool,
        who: str,
        *,
        connect_timeout_s: float | None = None,
    ) -> None:
        self.address = address
        self.who = who
        # stores always carry a checksum, so any reader that requires one can vouch for them;
        # `checksum` decides whether this connector's loads require (and verify) one
        self._client = PoolClient(
            address,
            token,
            timeout=deadline_s,
            checksum=checksum,
            write_checksum=True,
            breaker=process_breaker(address, token, deadline_s),
            local_lookups=True,
        )
        self._lock = threading.Lock()
        self._down = False
        self.failures = 0
        # Since the last take_tier_fetch: the least key index from which a lookup found the lower
        # tier holding keys and asked for them (the connector's token sources: tier 2's tokens).
        self._tier_fetch_from: int | None = None
        if connect_timeout_s is not None:
            try:
                self._client.connect_now(connect_timeout_s)
            except PoolError as exc:
                logger.debug("Maru pool at %s: no connection at start-up (%s)", address, exc)

    @property
    def client(self) -> PoolClient:
        """The client itself, for tests and benchmarks that inspect the pool (not contained)."""
        return self._client

    @property
    def available(self) -> bool:
        return not self._down and not self._client.marked_down

    @property
    def region_view(self) -> memoryview | None:
        return self._client.region_view

    def lookup_prefix(self, keys: Sequence[bytes], namespace: str) -> int:
        return self._contained(self._client.lookup_prefix, keys, namespace) or 0

    def lookup_or_fetch(self, keys: Sequence[bytes], namespace: str, *, fetch: bool = True) -> tuple[int, int]:
        found = self._contained(self._client.lookup_tiers, keys, namespace)
        if found is None:
            return 0, 0
        present, lower = found
        if (
            lower
            and fetch
            and self._contained(self._client.promote, keys[present : present + lower], namespace) is None
        ):
            lower = 0
        if lower:
            self._tier_fetch_from = min(present, present if self._tier_fetch_from is None else self._tier_fetch_from)
        return present, lower

    def take_tier_fetch(self) -> int | None:
        """The least key index from which a lookup since the last call fetched keys from the lower
        tier (None: none did); resets it."""
        found, self._tier_fetch_from = self._tier_fetch_from, None
        return found

    def distrust_lookups(self, seconds: float) -> None:
        self._client.ask_service_for(seconds)

    def lookup_parts(self, keys: Sequence[bytes], namespace: str) -> list[int]:
        return self._contained(self._client.lookup_parts, keys, namespace) or []

    def acquire(
        self, keys: Sequence[bytes], namespace: str, *, verify_payload: bool = True
    ) -> list[ReadPin | None] | None:
        return self._contained(self._client.acquire, keys, namespace, verify_payload=verify_payload)

    def acquire_parts(
        self, keys: Sequence[bytes], namespace: str, *, verify_payload: bool = True
    ) -> list[PartPin | None] | None:
        return self._contained(self._client.acquire_parts, keys, namespace, verify_payload=verify_payload)

    def release(self, pins: Sequence[ReadPin | None], bad: Sequence[ReadPin] = (), *, wait: bool = True) -> None:
        self._contained(self._client.release, pins, bad, wait=wait)

    def reserve(self, items: Sequence[tuple[bytes, int]], namespace: str) -> list[Reservation | None] | None:
        return self._contained(self._client.reserve, items, namespace)

    def abort(self, reservations: Sequence[Reservation]) -> None:
        self._contained(self._client.abort, reservations)

    def commit(
        self, reservations: Sequence[Reservation], metas: Sequence[ChunkMeta], parts: Sequence[Sequence[bytes]]
    ) -> list[bool] | None:
        return self._contained(self._client.commit, reservations, metas, parts)

    def _contained(self, op: Callable[A, T], *args: A.args, **kwargs: A.kwargs) -> T | None:
        """`op(*args, **kwargs)` on the client; on any pool failure None (and the outage noted)."""
        try:
            result = op(*args, **kwargs)
        except PoolError as exc:
            self.failures += 1
            what = op.__name__
            with self._lock:
                if not self._down:
                    self._down = True
                    logger.warning(
                        "Maru pool at %s unavailable (%s during %s): serving without the pool cache until it is back",
                        self.address,
                        exc,
                        what,
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
