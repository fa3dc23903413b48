"""Every message the pool exchanges, defined once as msgspec structs (the framing is `protocol`).

Both sides use these types: the service builds them, clients and subscribers decode them with
the typed decoders below, so a field cannot drift between writer and reader and a malformed
message fails with one line naming the field (`MessageError`):

* request arguments (`HelloArgs`, `KeysArgs`, ... ; `protocol.OP_ARGS` maps ops to them) and the
  limits they enforce;

* op results (`OP_RESULTS`): `HelloResult`, `Placement` rows of reserve/acquire, `SnapshotPage`;
* pool events (`PoolEventMsg`) on NATS `maru.<pool>.events`;
* snapshot pages (`SnapshotPage`), on the socket `snapshot` op and NATS `maru.<pool>.snapshot`;

Object metadata is stored as the bytes it was committed as and served unchanged: JSON (a dict
or a struct, e.g. `chunk_codec.ChunkMeta` from a client of a pool that predates binary metadata)
in `ObjectInfo.meta` / `PoolEventMsg.meta` as `msgspec.Raw`, or chunk metadata in its compact
binary form (`chunk_codec`, which owns the chunk contract) in `.bmeta` (base64 in JSON, raw bytes
in msgpack). A reader decodes either only when it cares (`chunk_codec.decode_chunk_meta` takes
both). A reader that predates `bmeta`
ignores it and sees an object without metadata, which it does not announce.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

NULL = msgspec.Raw(b"null")
#: How binary chunk metadata starts (`chunk_codec.MAGIC` without its format byte): JSON never does.
BINARY_META_PREFIX = b"MKC"

# -- limits and field types of requests -------------------------------------------------------
MAX_KEY = 256
MAX_NAMESPACE = 128
MAX_BATCH = 65536
MAX_META_BYTES = 16 * 1024
MAX_META_DEPTH = 32
MAX_PARTS = 256  # leading-part keys one object may declare (its part keys share MAX_META_BYTES)
MAX_SNAPSHOT_PAGE = 16384  # objects per snapshot page
SNAPSHOT_PAGE_BYTES = 4 * 1024 * 1024  # a page stops growing past this many bytes of object JSON

Key = Annotated[bytes, msgspec.Meta(max_length=MAX_KEY)]
Namespace = Annotated[str, msgspec.Meta(max_length=MAX_NAMESPACE)]
MAX_SNAPSHOT_PREFIXES = 64
Size = Annotated[int, msgspec.Meta(ge=0, le=1 << 50)]
Oid = Annotated[int, msgspec.Meta(ge=0)]


# -- per-op arguments -----------------------------------------------------------------------
class HelloArgs(msgspec.Struct, forbid_unknown_fields=False):
    token: str | None = None
    client: Annotated[str, msgspec.Meta(max_length=256)] = ""
    pid: int = 0


class EmptyArgs(msgspec.Struct):
    pass


class KeysArgs(msgspec.Struct):
    keys: Annotated[list[Key], msgspec.Meta(max_length=MAX_BATCH)]
    ns: Namespace = "default"


class ReserveArgs(msgspec.Struct):
    items: Annotated[list[tuple[Key, Size]], msgspec.Meta(max_length=MAX_BATCH)]
    ns: Namespace = "default"


PartKeys = Annotated[list[Key], msgspec.Meta(max_length=MAX_PARTS)]


class CommitArgs(msgspec.Struct):
    oids: Annotated[list[Oid], msgspec.Meta(max_length=MAX_BATCH)]
    # per object: a JSON-shaped dict, binary chunk metadata (`chunk_codec`), or None
    metas: list[dict[str, Any] | bytes | None] | None = None
    # Per object, keys naming its leading parts: parts[i][j] names the first j + 1 units.
    parts: list[PartKeys | None] | None = None


class OidsArgs(msgspec.Struct):
    oids: Annotated[list[Oid], msgspec.Meta(max_length=MAX_BATCH)]
    bad: Annotated[list[Oid], msgspec.Meta(max_length=MAX_BATCH)] = []


class RemoveArgs(msgspec.Struct):
    ns: Namespace
    keys: Annotated[list[Key], msgspec.Meta(max_length=MAX_BATCH)] | None = None  # None: whole namespace


class SnapshotArgs(msgspec.Struct):
    ns: Namespace | None = None
    after: Annotated[int, msgspec.Meta(ge=0)] = 0  # cursor: `next` of the previous page (0: first page)
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_SNAPSHOT_PAGE)] = MAX_SNAPSHOT_PAGE
    # how the page comes back: a SnapshotPage as JSON, or a PackedSnapshotPage as msgpack
    # (binary metadata without base64); a pool that predates the field answers JSON
    encoding: Literal["json", "msgpack"] = "json"
    # > 0: list only the `recent` most recently used objects (of `ns`), as they stand when the
    # page is served (PoolIndex.snapshot_page); a pool that predates the field lists them all
    recent: Annotated[int, msgspec.Meta(ge=0)] = 0
    # only objects whose namespace starts with one of these (what a relay follows: its model's
    # namespaces); `recent` counts only those. A pool that predates the field lists every namespace
    prefixes: Annotated[list[Namespace], msgspec.Meta(max_length=MAX_SNAPSHOT_PREFIXES)] | None = None


class MessageError(ValueError):
    """A reply, event, snapshot page or chunk metadata that does not have the documented shape."""


# -- op results -------------------------------------------------------------------------------
class HelloResult(msgspec.Struct):
    """What `hello` tells a new session: who the pool is and where its region lives."""

    session: int
    pool: str
    incarnation: str
    region_uuid: str
    region_path: str
    region_size: int
    data_offset: int
    backend: str
    lease_s: float
    protocol: int
    # the binary chunk metadata layout (`chunk_codec.FORMAT`) this pool accepts at commit; 0: none
    chunk_meta_format: int = 0
    # where the presence table (`pool.presence`) is in the region; 0 buckets: the pool has none
    presence_offset: int = 0
    presence_buckets: int = 0


class Placement(msgspec.Struct, array_like=True):
    """Where one reserved or pinned object's payload is: `[oid, payload offset, size]`."""

    oid: int
    offset: int
    size: int


class PartPlacement(msgspec.Struct, array_like=True):
    """An object pinned by a part key: `[oid, payload offset, size, the object's own key, units]`
    (`units`: how many leading units of the object the part key names)."""

    oid: int
    offset: int
    size: int
    key: bytes
    units: int


class ObjectInfo(msgspec.Struct):
    """One committed object as snapshots list it: `meta` is the committer's JSON (raw), or
    `bmeta` its binary chunk metadata (`chunk_codec`; `meta` is then null)."""

    namespace: str
    key: str  # hex
    size: int
    meta: msgspec.Raw = NULL
    bmeta: bytes | None = None


class PackedObject(msgspec.Struct, array_like=True):
    """An `ObjectInfo` in a msgpack page: `meta` is the stored metadata bytes (JSON text or
    binary chunk metadata, told apart by `chunk_codec.is_binary`), None when there is none."""

    namespace: str
    key: str  # hex
    size: int
    meta: bytes | None


class SnapshotPage(msgspec.Struct):
    """One page of the object set. `seq` is the event seq when this page was taken; `next` is the
    cursor to ask for the following page (None: this was the last page).

    Paging (why a multi-page snapshot is still exact): a reader keeps the `seq` of its FIRST page
    and afterwards applies every event with a larger seq. An object stored or removed while the
    pages were read is then either in a page and re-stored by its event (stores are idempotent)
    or absent and added by it; a removal of an object a page no longer shows is a no-op.
    `total`: how many objects the pool held when the page was taken (all namespaces; a size hint).
    """

    pool: str
    incarnation: str
    seq: int
    objects: list[ObjectInfo]
    next: int | None = None
    total: int | None = None


class PackedSnapshotPage(msgspec.Struct):
    """A `SnapshotPage` as the socket `snapshot` op sends it with `encoding="msgpack"`."""

    pool: str
    incarnation: str
    seq: int
    objects: list[PackedObject]
    next: int | None = None
    total: int | None = None


class ErrorMsg(msgspec.Struct):
    """A NATS snapshot request the pool cannot answer (e.g. a page above the NATS max payload)."""

    error: str
    message: str


# -- events -----------------------------------------------------------------------------------
EventType = Literal["stored", "removed"]


class PoolEventMsg(msgspec.Struct):
    """`{"type": "stored"|"removed", "seq", "incarnation", "pool", "namespace", "key", "size",
    "meta", "ts"}` on `maru.<pool>.events`; `seq` is gap-free per incarnation."""

    type: EventType
    seq: int
    incarnation: str
    pool: str
    namespace: str
    key: str  # hex
    size: int
    meta: msgspec.Raw = NULL
    ts: float = 0.0
    bmeta: bytes | None = None  # binary chunk metadata (base64 in JSON); `meta` is then null


# -- encoders / decoders ----------------------------------------------------------------------
json_encoder = msgspec.json.Encoder()
_event_decoder = msgspec.json.Decoder(PoolEventMsg)
_page_decoder = msgspec.json.Decoder(SnapshotPage)
_error_decoder = msgspec.json.Decoder(ErrorMsg)
_packed_page_decoder = msgspec.msgpack.Decoder(PackedSnapshotPage)
msgpack_encoder = msgspec.msgpack.Encoder()

#: What each op's reply `result` decodes to (the client validates every reply with these).
OP_RESULTS: dict[str, Any] = {
    "hello": HelloResult,
    "ping": str,
    "lookup": list[bool],
    "lookup_prefix": int,
    "reserve": list[Placement | None],
    "commit": list[bool],
    "abort": int,
    "acquire": list[Placement | None],
    "lookup_parts": list[int],
    "acquire_parts": list[PartPlacement | None],
    "release": int,
    "stats": dict[str, int | float | str | bool | None],
    "snapshot": bytes,  # one SnapshotPage as JSON or PackedSnapshotPage as msgpack (decode_snapshot_page)
    "remove": int,
    "promote": int,
}
_result_decoders = {op: msgspec.msgpack.Decoder(t) for op, t in OP_RESULTS.items()}


def _what(exc: Exception) -> str:
    return str(exc).splitlines()[0]


def decode_result(op: str, raw: msgspec.Raw | bytes) -> Any:
    try:
        return _result_decoders[op].decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(f"malformed {op!r} reply from the pool: {_what(exc)}") from None


def encode_event(ev: PoolEventMsg) -> bytes:
    return json_encoder.encode(ev)


def decode_event(data: bytes) -> PoolEventMsg:
    try:
        return _event_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(f"malformed pool event: {_what(exc)}") from None


def decode_snapshot_page(data: bytes) -> SnapshotPage:
    """A snapshot page (JSON, or a msgpack `PackedSnapshotPage`); an `ErrorMsg` answer raises
    MessageError with the pool's reason."""
    if data[:1] != b"{":
        return _unpack_page(data)
    try:
        return _page_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        try:
            err = _error_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise MessageError(f"malformed pool snapshot page: {_what(exc)}") from None
        raise MessageError(f"pool answered the snapshot request with {err.error}: {err.message}") from None


def _unpack_page(data: bytes) -> SnapshotPage:
    try:
        p = _packed_page_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(f"malformed pool snapshot page: {_what(exc)}") from None
    objects = [
        ObjectInfo(o.namespace, o.key, o.size, NULL, o.meta)
        if o.meta is not None and o.meta[:3] == BINARY_META_PREFIX
        else ObjectInfo(o.namespace, o.key, o.size, NULL if o.meta is None else msgspec.Raw(o.meta))
        for o in p.objects
    ]
    return SnapshotPage(p.pool, p.incarnation, p.seq, objects, p.next, p.total)


def encode_meta_json(meta: Any) -> bytes:
    """The JSON the pool stores for a committed object's metadata."""
    return json_encoder.encode(meta)
