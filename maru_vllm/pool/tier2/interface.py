"""The second tier's two seams: the remote store it writes to, and the pool it serves.

`Tier2Store` is the cluster-wide object store under every domain's pool (Mooncake Store,
`tier2.mooncake`). Its calls block on the network and may hang (a stopped master): the tier
(`tier2.tier.Tier2`) runs them on threads of its own, each under a deadline, behind a breaker,
never on the pool service's event loop. Failure semantics, per call:

* `put` returns True when the object is stored (or an object of that name already is: objects
  are write-once and named by their content's key), False when the store refused it (full, or
  its replica could not be placed); it raises `Tier2Error` when the store cannot be asked.
* `get` returns the object's bytes (a view valid until the next `get` of the same thread), or
  None where the store does not have it (never stored, evicted, lost with a restarted master);
  it raises `Tier2Error` when the store cannot be asked. `size`, when the caller knows it, saves
  asking for it. Bytes that come back are unverified: the caller checks them (`tier2.codec`).
* `exists` answers per name, with the same errors as `get`.
* `probe` returns when the store answers at all, else raises `Tier2Error`.
* `close` never raises.

`Tier2Host` is what the tier needs of the pool it sits under, implemented by
`tier2.host.IndexHost` over the service's index and region: a session of its own in which it
pins objects while it copies them out, and reserves, fills and commits objects it fetched. Every
`Tier2Host` method runs on the service's event loop (the index is not thread-safe); region views
it hands out stay valid while the object is pinned or reserved.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from maru_vllm.pool.errors import PoolError


class Tier2Error(PoolError):
    """The second tier could not be asked (unreachable, refused the call, or missed its deadline)."""


class Tier2Store(ABC):
    """A remote object store; see the module docstring for what each call promises."""

    @abstractmethod
    def put(self, name: str, data: memoryview) -> bool: ...

    @abstractmethod
    def get(self, name: str, size: int | None = None) -> bytes | memoryview | None: ...

    @abstractmethod
    def exists(self, names: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def probe(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


@dataclass(frozen=True)
class LocalObject:
    """A committed object of the pool, pinned for the tier: where its bytes are and what it carries."""

    ns: str
    key: bytes
    payload: memoryview  # read-only, valid while pinned
    checksum: int | None  # the payload checksum its header carries (None: its writer stored none)
    meta: bytes | None  # the metadata it was committed with (JSON or binary chunk metadata)
    parts: tuple[bytes, ...]  # its part keys, in order
    handle: object  # what `unpin` takes


@dataclass(frozen=True)
class Slot:
    """Space reserved for an object being fetched: fill `payload`, then `commit` or `abort`."""

    ns: str
    key: bytes
    payload: memoryview  # writable, valid until committed or aborted
    handle: object


class Tier2Host(Protocol):
    """The pool under the tier (runs on the service's loop; see the module docstring)."""

    def holds(self, ns: str, key: bytes) -> bool:
        """Whether the pool holds the object visible now."""

    def pin(self, ns: str, key: bytes) -> LocalObject | None:
        """Pin a visible object for reading; None when it is gone or cannot be pinned."""

    def unpin(self, obj: LocalObject) -> None:
        """Drop a pin `pin` took."""

    def hold(self, ns: str, key: bytes) -> object | None:
        """Pin a visible object (nothing is read; keeps a fetched object for its load)."""

    def unhold(self, handle: object) -> None:
        """Drop a pin `hold` took."""

    def reserve(self, ns: str, key: bytes, size: int) -> Slot | None:
        """Reserve space for an object the pool does not hold; None when it has no room."""

    def commit(self, slot: Slot, checksum: int, meta: bytes | None, parts: Sequence[bytes]) -> bool:
        """Write the object's header (with `checksum`) and make it visible; False when refused."""

    def abort(self, slot: Slot) -> None:
        """Give reserved space back."""

    def is_own(self, session: int) -> bool:
        """Whether `session` is the tier's own (objects it committed came from the tier)."""

    def hint(self, ns: str, key: bytes) -> None:
        """Tell lookups that the tier holds the object (the presence table's hint)."""

    def unhint(self, ns: str, key: bytes) -> None:
        """Withdraw that hint."""

    def hints(self) -> int:
        """How many hints lookups see now."""

    def keep_alive(self) -> None:
        """Keep the tier's session from expiring (called every fraction of a second)."""

    def close(self) -> None:
        """Drop the tier's session: its pins and reservations go with it."""
