"""How a stand-in answers a request: a live worker of its role does the work, or this engine does.

Both stand-ins (`standby.py`) are in discovery all along, so the frontend gives them a share of
their role's requests while the role's workers are alive. `Relay.serve` passes each request on to
one of the live workers of the role (`live_peers()`, round robin over requests) and streams its
answer back unchanged: one more hop, the work still done by a worker of the role. When the worker
it tried does not answer (it died a moment ago), the next live one is tried; only with none live
or none answering does the request run on this worker's own engine (`local`). So a stand-in
never fails a request because a worker of its role died: it tries that worker and takes over.

A worker that dies while it answers:

* **prefill**: its answer is one message; a failure after it is passed on (an error, as from the
  worker itself);
* **decode**: the stream goes on from where it broke - the prompt plus the tokens already sent,
  that many fewer left to generate, without the prefill's hand-off (the engine loads the prompt's
  chunks from the pool or computes them) - on the next live worker, or on this engine. That is the
  continuation Dynamo's own migration makes; the stand-in makes it because the frontend never
  retries on a worker it has tried, and the stand-in is the one it tried. The continued stream's
  usage is counted as the original request's (the tokens already sent are completion tokens, not
  prompt tokens). A request with several choices (`n` > 1) is not continued: its stream ends with
  the error.

`continuation` is the one place that builds the continued request.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from maru_dynamo.components.disagg.roles import DECODE

logger = logging.getLogger(__name__)

Local = Callable[[Any, Any], AsyncIterator[Any]]


class Relay:
    """A stand-in's requests for `role`, passed on to its live workers (see the module docstring).

    `client`: Dynamo's `Client` of the role's `generate` endpoint (`direct(request, instance_id,
    annotated=False, context=...)`); `on_forwarded()` is called once per request a worker of the
    role answered, `on_local()` once per request this engine serves (or finishes)."""

    def __init__(
        self,
        role: str,
        live_peers: Callable[[], frozenset[int]],
        *,
        on_forwarded: Callable[[], None] = lambda: None,
        on_local: Callable[[], None] = lambda: None,
    ) -> None:
        self.role = role
        self.live_peers = live_peers
        self.on_forwarded, self.on_local = on_forwarded, on_local
        self.client: Any = None
        self._next = 0

    def order(self) -> list[int]:
        """The live workers of the role, starting one further each request (round robin)."""
        peers = sorted(self.live_peers())
        if not peers:
            return []
        first = self._next % len(peers)
        self._next += 1
        return peers[first:] + peers[:first]

    async def serve(self, request: Any, context: Any, local: Local) -> AsyncIterator[Any]:
        decode = self.role == DECODE
        sent: list[int] = []  # decode: the tokens the caller has had
        pending, offset = request, 0  # what the next worker is asked; len(sent) when it was built
        whole = isinstance(request, dict)  # and every answer a dict of choice 0: a broken stream can be continued
        forwarded = False
        for peer in self.order():
            answered = finished = False
            try:
                stream = await self.client.direct(pending, peer, annotated=False, context=context)
                async for out in stream:
                    answered = True
                    if not forwarded:
                        forwarded = True
                        self.on_forwarded()
                    if decode and isinstance(out, dict):
                        whole = whole and out.get("index") in (None, 0)
                        sent.extend(out.get("token_ids") or [])
                        finished = finished or bool(out.get("finish_reason"))
                    elif decode:
                        whole = False
                    yield as_original(out, offset)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # it died or stops: the next one, or this engine
                if answered and not (decode and whole):
                    raise
                logger.info(
                    "maru_worker: %s worker %x %s (%s)",
                    self.role,
                    peer,
                    "broke off a forwarded stream" if answered else "did not take a forwarded request",
                    exc,
                )
            else:
                if not decode and answered:
                    return
                if finished or _stopped(context):
                    return
                if answered and not whole:
                    raise RuntimeError(f"{self.role} worker {peer:x} ended a stream of several choices early")
            if _stopped(context):
                return
            if answered:
                pending, offset = continuation(request, sent), len(sent)
                if pending is None:  # every token was sent, only the end was not
                    yield {"index": 0, "token_ids": [], "finish_reason": "length"}
                    return
        self.on_local()
        async for out in local(pending, context):
            yield as_original(out, offset)


def continuation(request: dict[str, Any], sent: list[int]) -> dict[str, Any] | None:
    """The decode request that generates the rest of `request`'s stream after `sent` went out;
    None when nothing is left to generate."""
    if not sent:
        return request
    out = copy.copy(request)
    token_ids: Any = request.get("token_ids")
    if not isinstance(token_ids, list):  # Dynamo may hand them over packed
        from dynamo.common.utils.token_ids import token_ids_to_list

        token_ids = token_ids_to_list(token_ids)
    out["token_ids"] = [*token_ids, *sent]
    stop = dict(request.get("stop_conditions") or {})
    if stop.get("max_tokens") is not None:
        left = int(stop["max_tokens"]) - len(sent)
        if left <= 0:
            return None
        stop["max_tokens"] = left
    if stop.get("min_tokens"):
        stop["min_tokens"] = max(0, int(stop["min_tokens"]) - len(sent))
    out["stop_conditions"] = stop
    out.pop("prefill_result", None)  # its hand-off was for the prompt alone, on the worker that died
    return out


def as_original(out: Any, offset: int) -> Any:
    """An answer to a continuation as the original request's: `offset` tokens move from the
    prompt to the completion in its usage."""
    usage = out.get("completion_usage") if offset and isinstance(out, dict) else None
    if not isinstance(usage, dict):
        return out
    usage = dict(usage)
    if isinstance(usage.get("prompt_tokens"), int):
        usage["prompt_tokens"] -= offset
    if isinstance(usage.get("completion_tokens"), int):
        usage["completion_tokens"] += offset
    return {**out, "completion_usage": usage}


def _stopped(context: Any) -> bool:
    """Whether the caller has gone (cancelled the request)."""
    return context is not None and bool(context.is_stopped())
