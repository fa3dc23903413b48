"""The cluster-wide second tier under a pool: Mooncake Store, written through, fetched on a hint.

`interface` declares the two seams (the store, the pool under the tier) and their failure
semantics; `codec` the objects' format and names in the store; `directory` which keys the tier
holds as this pool knows them; `announce` how pools tell each other over NATS; `mooncake` the
store over Mooncake; `host` the pool side over the service's index; `tier` the write-through,
fetches and outages. The service calls `start_tier2` (with its index, region view and object
check) when it is started with a tier, and then only `Tier2.on_event`, `Tier2.promote`, `Tier2.stats` and `Tier2.stop`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maru_vllm.pool.tier2.interface import Tier2Error, Tier2Host, Tier2Store
from maru_vllm.pool.tier2.mooncake import MooncakeConfig, MooncakeStore
from maru_vllm.pool.tier2.tier import Tier2, Tier2Config

if TYPE_CHECKING:
    from maru_vllm.pool.index import PoolIndex
    from maru_vllm.pool.presence import PresenceTable
    from maru_vllm.pool.records import Obj

__all__ = [
    "MooncakeConfig",
    "MooncakeStore",
    "Tier2",
    "Tier2Config",
    "Tier2Error",
    "Tier2Host",
    "Tier2Settings",
    "Tier2Store",
    "start_tier2",
]


@dataclass(frozen=True)
class Tier2Settings:
    """A pool's tier: the Mooncake store it joins and how the tier uses it."""

    mooncake: MooncakeConfig
    options: Tier2Config


async def start_tier2(
    settings: Tier2Settings,
    *,
    index: PoolIndex,
    view: memoryview,
    presence: PresenceTable | None,
    verify: Callable[[Obj], str | None],
    pool_name: str,
    incarnation: str,
    nats: str | None,
) -> Tier2:
    """The tier under a started pool's index and region view (see `tier2.tier`), running."""
    from dataclasses import replace

    from maru_vllm.pool.tier2.host import IndexHost

    host = IndexHost(index, view, presence, verify)
    options = replace(settings.options, nats=nats) if settings.options.nats is None else settings.options
    tier = Tier2(options, MooncakeStore(settings.mooncake), host, pool_name, incarnation)
    await tier.start()
    return tier
