"""The cluster's tier-2 chunks as router credit at Dynamo's disk tier (opt-in, per worker).

A pool with a second tier (`pool.tier2`) announces each object it puts there on NATS
(`maru.tier2.keys`), with the object's chunk metadata. With tier-2 credit on
(`--maru-tier2-credit`), a worker's relay follows those announcements (`Tier2Follower`) and keeps
a second, capped view of them (`Tier2CreditView`): the tier-2 chunks of this worker's namespaces
and block size, announced to Dynamo at the disk tier (`DISK`, weighed by the router's
`--router-disk-cache-hit-weight`), so the router credits every worker with what any domain put
in the tier.

* A chunk is withdrawn when a pool announces it `gone` (missing or corrupt in the tier, or
  dropped after the tier's master restarted: the pools check their keys against a restarted
  master and announce what it lost) and when the cap makes room.
* It is announced whether or not this worker's pool holds it too. Dynamo's router scores each
  block of a prompt once, at the best tier that continues the prefix (device, then host, then
  disk: a chunk the pool announces at the host tier gains nothing at disk), and it keeps a
  block's tiers apart: a removal at the host tier leaves the block's disk-tier store, which
  then credits it again (`tests/e2e/test_pool_routing_events.py` checks both on Dynamo 1.6.1).
  So a chunk the pool evicts while the tier still holds it keeps its disk credit.
* Memory is bounded: at most `max_chunks` chunks (each with its token ids, which a
  re-announcement needs: ~1.6 KiB per 256-token chunk); past that the least recently
  announced chunk is withdrawn, counted (`cap_dropped`) and logged once per 10^4.
* It starts empty: a worker that starts late credits what the pools put from then on (the
  pools' directory answers carry keys only).
* Entries without metadata (a pool of an older version, a chunk that is not MaruKVConnector's)
  are ignored.

Not thread-safe: the relay drives it from its event loop.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.pool_view import NamespaceFilter, stored_runs
from maru_vllm.events.types import (
    DEFAULT_TIER2_CREDIT_CHUNKS,
    TIER2_MEDIUM,
    Announcement,
    BlocksRemoved,
    ExternalHash,
    ObjectId,
    PoolChunk,
)
from maru_vllm.pool.nats_link import NatsLink
from maru_vllm.pool.tier2.announce import KEYS_SUBJECT, Tier2Entry, decode_announcement

logger = logging.getLogger(__name__)

_LOG_EVERY = 10_000


@dataclasses.dataclass(frozen=True)
class Tier2CreditConfig:
    """Tier-2 credit for one worker: where the pools announce, how many chunks at most, at which medium."""

    nats_url: str
    max_chunks: int = DEFAULT_TIER2_CREDIT_CHUNKS
    medium: str = TIER2_MEDIUM

    def __post_init__(self) -> None:
        if self.max_chunks < 1:
            raise ValueError(f"tier-2 credit max_chunks={self.max_chunks}: must be >= 1")


class Tier2CreditView:
    """The tier-2 chunks one worker announces at the disk tier (see module docstring)."""

    def __init__(
        self, namespaces: NamespaceFilter, block_size: int | None, max_chunks: int, int_hashes: bool | None = None
    ) -> None:
        if max_chunks < 1:
            raise ValueError(f"max_chunks={max_chunks}: must be >= 1")
        self.namespaces = namespaces
        self.block_size = block_size
        self.max_chunks = max_chunks
        self.int_hashes = vf.int_block_hashes() if int_hashes is None else int_hashes
        self._chunks: collections.OrderedDict[ObjectId, PoolChunk] = collections.OrderedDict()  # oldest first
        self._blocks: collections.Counter[ExternalHash] = collections.Counter()  # announced blocks, over chunks
        self.cap_dropped = 0  # chunks withdrawn to stay within max_chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, oid: ObjectId) -> bool:
        return oid in self._chunks

    @property
    def block_count(self) -> int:
        return len(self._blocks)

    def stored(self, entries: Iterable[Tier2Entry]) -> list[Announcement]:
        """Announce the chunks of `entries` that are this worker's (its namespaces, its block size)."""
        out: list[Announcement] = []
        for e in entries:
            if e.meta is None or not self.namespaces.accepts(e.ns):
                continue
            oid = (e.ns, e.key.hex())
            if oid in self._chunks:
                self._chunks.move_to_end(oid)
                continue
            chunk = PoolChunk.from_meta(e.meta, self.int_hashes)
            if chunk is None or (self.block_size is not None and chunk.block_size != self.block_size):
                continue
            self._chunks[oid] = chunk
            fresh = [self._blocks[h] == 0 for h in chunk.block_hashes]
            self._blocks.update(chunk.block_hashes)
            out.extend(stored_runs(chunk, fresh))
            while len(self._chunks) > self.max_chunks:
                _, old = self._chunks.popitem(last=False)
                out.extend(self._uncount(old))
                self.cap_dropped += 1
                if self.cap_dropped % _LOG_EVERY == 1:
                    logger.warning(
                        "tier-2 credit: %d chunks (--maru-tier2-credit-max-chunks) reached; the least recently "
                        "announced are withdrawn (%d so far)",
                        self.max_chunks,
                        self.cap_dropped,
                    )
        return out

    def gone(self, entries: Iterable[Tier2Entry]) -> list[Announcement]:
        """Withdraw the chunks a pool found missing or corrupt in the tier."""
        out: list[Announcement] = []
        for e in entries:
            out.extend(self.withdraw((e.ns, e.key.hex())))
        return out

    def withdraw(self, oid: ObjectId) -> list[Announcement]:
        """Withdraw one chunk (gone from the tier)."""
        chunk = self._chunks.pop(oid, None)
        return self._uncount(chunk) if chunk is not None else []

    def clear(self) -> list[Announcement]:
        """Withdraw everything."""
        gone = tuple(self._blocks)
        self._chunks.clear()
        self._blocks.clear()
        return [BlocksRemoved(gone)] if gone else []

    def reannounce(self) -> list[Announcement]:
        """Every announced block withdrawn, then stored again (a subscriber that joined late,
        batches the publisher lost): Dynamo's publisher counts stores per block."""
        if not self._blocks:
            return []
        out: list[Announcement] = [BlocksRemoved(tuple(self._blocks))]
        seen: set[ExternalHash] = set()
        for chunk in self._chunks.values():
            fresh = [h not in seen for h in chunk.block_hashes]
            seen.update(chunk.block_hashes)
            out.extend(stored_runs(chunk, fresh))
        return out

    def _uncount(self, chunk: PoolChunk) -> list[Announcement]:
        gone = []
        for h in chunk.block_hashes:
            self._blocks[h] -= 1
            if self._blocks[h] <= 0:
                del self._blocks[h]
                gone.append(h)
        return [BlocksRemoved(tuple(gone))] if gone else []


OnEntries = Callable[[list[Tier2Entry], list[Tier2Entry]], None]


class Tier2Follower:
    """Follows `maru.tier2.keys` and hands every announcement's (stored, gone) to `on_entries`,
    on the loop it was started on. Undecodable messages are counted and dropped."""

    def __init__(self, url: str, name: str, on_entries: OnEntries) -> None:
        self._on_entries = on_entries
        self._stopping = False
        self._link = NatsLink(url, name, on_disconnect=self._noop, on_reconnect=self._noop)
        self.received = 0
        self.undecodable = 0

    def start(self) -> None:
        self._link.start(self._run(), name="maru-tier2-credit")

    async def stop(self) -> None:
        self._stopping = True
        await self._link.stop(1.0)

    async def _run(self) -> None:
        async def subscribe(nc: Any) -> None:
            await nc.subscribe(KEYS_SUBJECT, cb=self._on_message)
            await nc.flush(timeout=2)

        await self._link.connect(subscribe, what="follow tier-2 keys", stopping=lambda: self._stopping)

    async def _on_message(self, msg: Any) -> None:
        try:
            ann = decode_announcement(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.undecodable += 1
            logger.debug("dropped an undecodable tier-2 announcement: %s", exc)
            return
        self.received += len(ann.stored) + len(ann.gone)
        try:
            self._on_entries(ann.stored, ann.gone)
        except Exception:  # the relay must keep following
            logger.exception("tier-2 credit: announcement not applied")

    async def _noop(self) -> None:
        return None


class Tier2Credit:
    """A relay's tier-2 credit: the follower, the view, and what goes to the relay's stream
    (`announce(announcements)` sends them at `cfg.medium`)."""

    def __init__(
        self,
        cfg: Tier2CreditConfig,
        namespaces: NamespaceFilter,
        block_size: int | None,
        announce: Callable[[list[Announcement]], None],
        name: str = "maru-tier2-credit",
    ) -> None:
        self.cfg = cfg
        self.view = Tier2CreditView(namespaces, block_size, cfg.max_chunks)
        self._announce = announce
        self.follower = Tier2Follower(cfg.nats_url, name, self.on_entries)

    def start(self) -> None:
        self.follower.start()

    async def stop(self) -> None:
        await self.follower.stop()

    def on_entries(self, stored: list[Tier2Entry], gone: list[Tier2Entry]) -> None:
        out = self.view.gone(gone) + self.view.stored(stored)
        if out:
            self._announce(out)

    def reannounce(self) -> None:
        out = self.view.reannounce()
        if out:
            self._announce(out)
