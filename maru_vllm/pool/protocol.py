"""Wire protocol between pool clients and the service (control plane only; no payloads).

Framing: a 4-byte big-endian length, then a msgpack body (msgspec). A request is the array
``[version, id, op, args]``; a reply is ``[version, id, ok, result, error]``. Each op's args are
a typed struct decoded and validated by msgspec (lengths, non-negative sizes), so a bad request
becomes a clean error reply and the connection keeps working. Frames above MAX_FRAME are
refused and that connection is closed (its byte stream can no longer be trusted).

Versioning: ``PROTOCOL_VERSION`` is checked on every request; a different version gets a
``bad_version`` error naming the versions the service speaks.

Before ``hello`` a peer is unauthenticated: its first frame may be at most MAX_HELLO_FRAME
bytes, and anything but a valid hello closes the connection. Bodies nested deeper than the
decoder can follow are a ``bad_frame``/``bad_request`` error, never an uncaught RecursionError;
chunk metadata may nest at most MAX_META_DEPTH levels (subscribers parse it again).
Every message - each op's arguments and result type, every event, snapshot page and chunk
metadata - is defined once in `maru_vllm.pool.messages`; this module is the framing around
them; the client decodes every reply's result with that type. The service never sends a reply
above MAX_FRAME (it answers ``too_large`` instead), and a client that gets
a frame it cannot trust drops the connection and reconnects.
"""

from __future__ import annotations

import struct
from typing import Any, TypeVar

import msgspec

from maru_vllm.pool.messages import (  # noqa: F401 - the request side of the wire, re-exported
    MAX_BATCH,
    MAX_KEY,
    MAX_META_BYTES,
    MAX_META_DEPTH,
    MAX_NAMESPACE,
    MAX_PARTS,
    MAX_SNAPSHOT_PAGE,
    SNAPSHOT_PAGE_BYTES,
    CommitArgs,
    EmptyArgs,
    HelloArgs,
    Key,
    KeysArgs,
    Namespace,
    Oid,
    OidsArgs,
    PartKeys,
    RemoveArgs,
    ReserveArgs,
    Size,
    SnapshotArgs,
)

PROTOCOL_VERSION = 1
MAX_FRAME = 16 * 1024 * 1024
MAX_HELLO_FRAME = 64 * 1024  # a hello is a token, a client name and a pid
LEN = struct.Struct(">I")

T = TypeVar("T")


class Request(msgspec.Struct, array_like=True):
    v: int
    id: int
    op: str
    args: msgspec.Raw = msgspec.Raw(b"\x80")  # empty map


class ErrorInfo(msgspec.Struct, array_like=True):
    code: str
    message: str


class Reply(msgspec.Struct, array_like=True):
    v: int
    id: int
    ok: bool
    result: Any = None
    error: ErrorInfo | None = None


class RawReply(msgspec.Struct, array_like=True):
    """A reply as the client first decodes it: `result` stays raw until the op's type decodes it."""

    v: int
    id: int
    ok: bool
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # nil
    error: ErrorInfo | None = None


OP_ARGS: dict[str, type[msgspec.Struct]] = {
    "hello": HelloArgs,
    "ping": EmptyArgs,
    "lookup": KeysArgs,
    "lookup_prefix": KeysArgs,
    "reserve": ReserveArgs,
    "commit": CommitArgs,
    "abort": OidsArgs,
    "acquire": KeysArgs,
    "lookup_parts": KeysArgs,
    "acquire_parts": KeysArgs,
    "release": OidsArgs,
    "stats": EmptyArgs,
    "snapshot": SnapshotArgs,
    "remove": RemoveArgs,
    "promote": KeysArgs,
}

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(RawReply)
_arg_decoders = {op: msgspec.msgpack.Decoder(t) for op, t in OP_ARGS.items()}


class FrameError(Exception):
    """A frame or body that cannot be decoded; carries the error code for the reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(body: bytes) -> bytes:
    return LEN.pack(len(body)) + body


def encode_request(req_id: int, op: str, args: dict[str, Any] | None = None) -> bytes:
    body = _encoder.encode((PROTOCOL_VERSION, req_id, op, args or {}))
    return frame(body)


def encode_reply(reply: Reply) -> bytes:
    return frame(_encoder.encode(reply))


def error_reply(req_id: int, code: str, message: str) -> Reply:
    return Reply(PROTOCOL_VERSION, req_id, False, None, ErrorInfo(code, message))


_TOO_DEEP = "nested too deeply to decode"


def _decode(decoder: msgspec.msgpack.Decoder[T], data: bytes | msgspec.Raw, code: str, what: str) -> T:
    """`decoder.decode(data)`, or a FrameError with `code` that says `what` is wrong and why."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(code, f"{what}: {exc}") from exc
    except RecursionError as exc:
        raise FrameError(code, f"{what}: {_TOO_DEEP}") from exc


def decode_request(body: bytes) -> Request:
    return _decode(_request_decoder, body, "bad_frame", "malformed request frame")


def decode_args(op: str, raw: msgspec.Raw) -> msgspec.Struct:
    dec = _arg_decoders.get(op)
    if dec is None:
        raise FrameError("unknown_op", f"unknown op {op!r}; known ops: {', '.join(sorted(OP_ARGS))}")
    return _decode(dec, raw, "bad_request", f"invalid arguments for {op!r}")


def decode_reply(body: bytes) -> RawReply:
    return _decode(_reply_decoder, body, "bad_frame", "malformed reply frame")


def nesting_depth(value: Any, limit: int = MAX_META_DEPTH) -> int:
    """How deeply `value` nests lists/dicts, counting no further than `limit` + 1 (iterative).

    Level by level; a container whose children are all scalars (a list of token ids) is
    recognised by one C-level pass over their types, so only containers are visited in Python."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return depth
        deeper: list[Any] = []
        for v in level:
            children = v.values() if type(v) is dict else v
            if not _CONTAINERS.isdisjoint(map(type, children)):
                deeper.extend(c for c in children if type(c) in _CONTAINERS)
        level = deeper
    return depth


_CONTAINERS = frozenset({list, tuple, dict})
