"""The connector's view of the pool: the operations its scheduler and worker sides use.

Every method here runs inside vLLM's scheduler loop, model forward or the store writer
thread, where an exception would take the engine down. So the contract of each method is
that it never raises for a pool failure (service down, restarted, protocol error): it
answers with the failure value its docstring names - a miss for lookups, None for a load or
store batch that could not be done, nothing for an unpin or abort - and the caller degrades
to plain serving (recompute, skip the store). Argument errors the caller could have avoided
(`InvalidArgument`, e.g. a key too long) are pool failures too, contained the same way.

Keys are chunk keys (`connector.chunks.chunk_key`), each naming one rank's slice of a chunk;
`namespace` is the connector's namespace (`connector.namespace`). The pins and reservations
are the pool client's types: their memory stays valid until released / committed / aborted
through this same interface.

`connector.pool_access.PoolAccess` implements it over a `PoolClient`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from maru_vllm.pool.chunk_codec import ChunkMeta
from maru_vllm.pool.client import PartPin, ReadPin, Reservation


class ConnectorPool(ABC):
    """The pool operations the connector uses; see the module docstring for the failure contract."""

    @property
    @abstractmethod
    def available(self) -> bool:
        """False from the first failed call of an outage until a call succeeds again."""

    @property
    @abstractmethod
    def region_view(self) -> memoryview | None:
        """The current mapping of the whole region (None before the first connect), to register it
        with a GPU for DMA; a pool restart maps a new region."""

    # -- scheduler side: what is there ----------------------------------------------------------
    @abstractmethod
    def lookup_prefix(self, keys: Sequence[bytes], namespace: str) -> int:
        """How many of `keys`, from the first on, the pool holds committed.

        Returns:
            the length of that present prefix; 0 when the pool cannot be asked.
        """

    @abstractmethod
    def lookup_or_fetch(self, keys: Sequence[bytes], namespace: str, *, fetch: bool = True) -> tuple[int, int]:
        """Like `lookup_prefix`, and also how many keys right after the present prefix the pool's
        lower tier holds; with `fetch`, ask the pool to bring those in (without waiting: they
        show as present in a later lookup, or stop showing as held below once a fetch fails).

        Returns:
            (the present prefix's length, how many keys after it the lower tier holds); (0, 0)
            when the pool cannot be asked; the second is 0 when the fetch could not be asked for.
        """

    @abstractmethod
    def lookup_parts(self, keys: Sequence[bytes], namespace: str) -> list[int]:
        """For each part key, how many leading units of a committed object it names (0 where no
        object names it).

        Returns:
            one count per key; an empty list when the pool cannot be asked.
        """

    @abstractmethod
    def distrust_lookups(self, seconds: float) -> None:
        """A load that the lookups promised failed: for `seconds`, ask the pool service itself
        instead of the pool's presence table (whose heartbeat may still vouch for a service that
        hangs), so a pool outage reaches the scheduler's own link."""

    # -- worker side: loads ---------------------------------------------------------------------
    @abstractmethod
    def acquire(
        self, keys: Sequence[bytes], namespace: str, *, verify_payload: bool = True
    ) -> list[ReadPin | None] | None:
        """Pin objects for reading; a missing or invalid one is None. With
        `verify_payload=False` only headers are checked and the caller verifies each payload.

        Returns:
            one pin or None per key; None for the whole batch when the pool cannot be asked.
        """

    @abstractmethod
    def acquire_parts(
        self, keys: Sequence[bytes], namespace: str, *, verify_payload: bool = True
    ) -> list[PartPin | None] | None:
        """Pin, for each part key, the latest committed object naming it (`.units` is what the part
        names); `verify_payload` as in `acquire`.

        Returns:
            one pin or None per key; None for the whole batch when the pool cannot be asked.
        """

    @abstractmethod
    def release(self, pins: Sequence[ReadPin | None], bad: Sequence[ReadPin] = (), *, wait: bool = True) -> None:
        """Unpin (None entries are skipped); pins in `bad` failed the reader's payload check and
        the pool drops them. `wait=False` does not wait for the reply. A failure leaves the pins
        to the pool (a lost session's pins go with it)."""

    # -- worker side: stores --------------------------------------------------------------------
    @abstractmethod
    def reserve(self, items: Sequence[tuple[bytes, int]], namespace: str) -> list[Reservation | None] | None:
        """Reserve space for each (key, payload size).

        Returns:
            one reservation per item, None where the key is already there or no space could be
            freed; None for the whole batch when the pool cannot be asked.
        """

    @abstractmethod
    def abort(self, reservations: Sequence[Reservation]) -> None:
        """Give reserved space back without publishing it. A failure leaves it to the pool."""

    @abstractmethod
    def commit(
        self, reservations: Sequence[Reservation], metas: Sequence[ChunkMeta], parts: Sequence[Sequence[bytes]]
    ) -> list[bool] | None:
        """Publish written reservations with their chunk metadata; `parts[i][j]` is a key naming
        the first j + 1 blocks of chunk i.

        Returns:
            per reservation whether it is now in the pool; None when the pool cannot be asked.
        """

    @abstractmethod
    def close(self) -> None:
        """Drop the connection; never raises."""
