"""The cluster's tier-2 keys over NATS: each pool tells the others what it put in the tier.

Every pool with a tier publishes, on `maru.tier2.keys`, batches of the objects it put in the
tier (`stored`) and of those it found missing or corrupt there (`gone`), and subscribes to the
same subject, so each pool's directory (`tier2.directory`) holds the cluster's tier-2 keys
without asking the tier. A pool that starts late asks `maru.tier2.directory` once; any pool
answers with its most recent keys (one message). Messages are msgpack `Tier2Announcement`s; a
message of another tier (another master address) or from this pool itself is ignored, and one
that does not decode is dropped with a debug line: announcements are hints, never trusted with
bytes (a fetch verifies what it reads).

A `stored` entry of a put carries the object's chunk metadata (`chunk_codec.ChunkMeta`: block
hashes, parent hash, token ids, block size, LoRA, rank) when it has some, so a worker's event
relay can announce another domain's tier-2 chunks to its router (`events.tier2_credit`); pools
ignore it. Entries without it (`gone`, directory answers, pools of an older version) still
decode, and an older reader ignores the trailing field.

Publishing never blocks the service: entries queue (at most `max_queue`, the oldest dropped)
and a background task sends them in batches of at most `BATCH` entries and `MAX_MESSAGE_BYTES`
encoded bytes (NATS refuses messages over its max payload, 1 MiB by default); an entry that alone
exceeds that goes without its metadata.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from maru_vllm.pool import chunk_codec
from maru_vllm.pool.chunk_codec import ChunkMeta
from maru_vllm.pool.messages import MAX_KEY, MAX_NAMESPACE, MessageError
from maru_vllm.pool.nats_link import NatsLink

logger = logging.getLogger(__name__)

KEYS_SUBJECT = "maru.tier2.keys"
DIRECTORY_SUBJECT = "maru.tier2.directory"
BATCH = 512  # entries per published message, at most
META_QUEUE = 4096  # queued entries past which new ones wait without their metadata (bounds the queue's memory)
MAX_MESSAGE_BYTES = 768 << 10  # encoded bytes per published message, at most (NATS's default max payload: 1 MiB)
DIRECTORY_REPLY = 8192  # entries in one directory answer (well under NATS's 1 MiB default payload)


class Tier2Entry(msgspec.Struct, array_like=True):
    """One object: namespace, key, payload bytes, bytes in the tier (encoded), and the chunk
    metadata it was committed with (None: not announced, or not a MaruKVConnector chunk)."""

    ns: Annotated[str, msgspec.Meta(max_length=MAX_NAMESPACE)]
    key: Annotated[bytes, msgspec.Meta(max_length=MAX_KEY)]
    size: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0
    tier_size: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0
    meta: ChunkMeta | None = None


def chunk_meta_of(meta: bytes | None) -> ChunkMeta | None:
    """The `ChunkMeta` of a pool object's stored metadata (binary or JSON); None when it has none
    or it is not MaruKVConnector chunk metadata."""
    if not meta:
        return None
    try:
        return chunk_codec.decode_chunk_meta(meta)
    except (MessageError, ValueError):
        return None


class Tier2Announcement(msgspec.Struct):
    tier: str  # the master address of the tier the entries are in
    pool: str
    incarnation: str
    stored: list[Tier2Entry] = []
    gone: list[Tier2Entry] = []


class DirectoryRequest(msgspec.Struct):
    tier: str


_encode = msgspec.msgpack.Encoder().encode
_decode_announcement = msgspec.msgpack.Decoder(Tier2Announcement).decode
_decode_request = msgspec.msgpack.Decoder(DirectoryRequest).decode
_HEADER_SLACK = 1024  # bytes of a message besides its entries (tier, pool, incarnation, array headers)


def decode_announcement(data: bytes) -> Tier2Announcement:
    """A message on `KEYS_SUBJECT`; msgspec.DecodeError / ValidationError when it is not one."""
    return _decode_announcement(data)


def take_batch(queue: collections.deque[Tier2Entry], budget: int) -> tuple[list[Tier2Entry], int]:
    """Entries from the front of `queue` whose encodings fit `budget` bytes, at most `BATCH`;
    (entries, bytes). An entry too large for any message (`MAX_MESSAGE_BYTES`) goes without its
    metadata; one that does not fit what is left of `budget` waits for the next batch."""
    out: list[Tier2Entry] = []
    used = 0
    while queue and len(out) < BATCH:
        size = len(_encode(queue[0]))
        if size > MAX_MESSAGE_BYTES - _HEADER_SLACK:
            big = queue[0]
            queue[0] = Tier2Entry(big.ns, big.key, big.size, big.tier_size)
            continue
        if used + size > budget:
            break
        out.append(queue.popleft())
        used += size
    return out, used


OnEntries = Callable[[list[Tier2Entry], list[Tier2Entry]], None]


class Tier2Announcer:
    """Publishes this pool's tier-2 puts, and hands the other pools' to `on_entries(stored, gone)`."""

    def __init__(
        self,
        url: str,
        tier: str,
        pool: str,
        incarnation: str,
        on_entries: OnEntries,
        recent: Callable[[int], list[Tier2Entry]],
        *,
        max_queue: int = 65536,
    ) -> None:
        self.tier, self.pool, self.incarnation = tier, pool, incarnation
        self._on_entries = on_entries
        self._recent = recent
        self._stored: collections.deque[Tier2Entry] = collections.deque(maxlen=max_queue)
        self._gone: collections.deque[Tier2Entry] = collections.deque(maxlen=max_queue)
        self._wake = asyncio.Event()
        self._stopping = False
        self._link = NatsLink(url, f"maru-tier2-{pool}", on_disconnect=self._on_disconnect, on_reconnect=self._noop)
        self.connected = False
        self.published = 0
        self.received = 0
        self.undecodable = 0

    def start(self) -> None:
        self._link.start(self._run(), name="maru-tier2-announce")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        await self._link.stop(1.0)

    def stored(self, entry: Tier2Entry) -> None:
        if entry.meta is not None and len(self._stored) >= META_QUEUE:  # NATS is slow or down: keys only
            entry = Tier2Entry(entry.ns, entry.key, entry.size, entry.tier_size)
        self._stored.append(entry)
        self._wake.set()

    def gone(self, entry: Tier2Entry) -> None:
        self._gone.append(entry)
        self._wake.set()

    async def _run(self) -> None:
        async def subscribe(nc: Any) -> None:
            await nc.subscribe(KEYS_SUBJECT, cb=self._on_message)
            await nc.subscribe(DIRECTORY_SUBJECT, cb=self._on_directory_request)
            await nc.flush(timeout=2)

        if not await self._link.connect(subscribe, what="follow tier-2 keys", stopping=lambda: self._stopping):
            return
        self.connected = True
        await self._ask_directory()
        while not self._stopping:
            if not self._stored and not self._gone:
                self._wake.clear()
                await self._wake.wait()
                continue
            gone, used = take_batch(self._gone, MAX_MESSAGE_BYTES - _HEADER_SLACK)
            stored, _ = take_batch(self._stored, max(0, MAX_MESSAGE_BYTES - _HEADER_SLACK - used))
            if not stored and not gone:
                continue  # cannot happen: an empty budget takes nothing, and the next round has all of it
            msg = Tier2Announcement(self.tier, self.pool, self.incarnation, stored, gone)
            try:
                await self._link.nc.publish(KEYS_SUBJECT, _encode(msg))
                self.published += len(msg.stored) + len(msg.gone)
            except Exception as exc:  # nats-py: disconnected or its buffer is full; hints may be lost
                logger.debug("tier-2 announcement not sent: %s", exc)
                await asyncio.sleep(0.2)

    async def _ask_directory(self) -> None:
        try:
            reply = await self._link.nc.request(DIRECTORY_SUBJECT, _encode(DirectoryRequest(self.tier)), timeout=2)
            msg = _decode_announcement(reply.data)
        except Exception as exc:  # no other pool yet (no responders / timeout), or a bad answer
            logger.debug("no tier-2 directory from the other pools: %s", exc)
            return
        if msg.tier == self.tier and msg.stored:
            self.received += len(msg.stored)
            self._on_entries(msg.stored, [])
            logger.info("learned %d tier-2 keys from pool %s", len(msg.stored), msg.pool)

    async def _on_message(self, msg: Any) -> None:
        try:
            ann = _decode_announcement(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.undecodable += 1
            logger.debug("dropped an undecodable tier-2 announcement: %s", exc)
            return
        if ann.tier != self.tier or (ann.pool == self.pool and ann.incarnation == self.incarnation):
            return
        self.received += len(ann.stored) + len(ann.gone)
        self._on_entries(ann.stored, ann.gone)

    async def _on_directory_request(self, msg: Any) -> None:
        try:
            req = _decode_request(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if req.tier != self.tier or not msg.reply:
            return
        entries = self._recent(DIRECTORY_REPLY)
        if not entries:
            return  # let a pool that knows some answer
        try:
            await msg.respond(_encode(Tier2Announcement(self.tier, self.pool, self.incarnation, entries)))
        except Exception as exc:  # the asker may be gone
            logger.debug("tier-2 directory reply failed: %s", exc)

    async def _on_disconnect(self) -> None:
        self.connected = False

    async def _noop(self) -> None:
        self.connected = True
