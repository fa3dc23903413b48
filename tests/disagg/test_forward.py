"""A stand-in passes requests on to the live workers of its role and takes over from one that dies
(`maru_dynamo.components.disagg.relay`, no processes).

`FakeClient` stands in for Dynamo's `Client` (what `direct()` returns is an async iterator of the
peer's answers, or raises as Dynamo does when the peer is gone), `local` for the stood-in role's
`dynamo.vllm` handler on this worker's engine; the real path runs in
tests/e2e/test_disagg_roles.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from maru_dynamo.components.disagg.relay import Relay, continuation

PREFILL_ANSWER = {"token_ids": [7], "disaggregated_params": {"kv_transfer_params": {}}}
PROMPT = [1, 2, 3]
DECODE_REQUEST = {
    "token_ids": PROMPT,
    "stop_conditions": {"max_tokens": 4, "min_tokens": 4, "ignore_eos": True},
    "sampling_options": {"temperature": 0.0},
    "prefill_result": {"disaggregated_params": {"kv_transfer_params": {}}},
}


def token(t: int, *, last: bool = False, usage: dict[str, int] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"index": 0, "token_ids": [t]}
    if last:
        out["finish_reason"] = "length"
    if usage is not None:
        out["completion_usage"] = usage
    return out


class FakeClient:
    """Dynamo's Client as the relay uses it: `direct(request, instance_id, ...)`."""

    def __init__(self, behaviour: dict[int, str], answers: list[dict[str, Any]] | None = None) -> None:
        # peer -> "answers" | "refuses" | "breaks" (after its first answer) | "ends" (after it, no error)
        self.behaviour = behaviour
        self.answers = answers or [PREFILL_ANSWER]
        self.asked: list[tuple[int, Any]] = []

    async def direct(self, request: Any, instance_id: int, annotated: bool = True, context: Any = None) -> Any:
        self.asked.append((instance_id, request))
        how = self.behaviour[instance_id]
        if how == "refuses":
            raise RuntimeError("CannotConnect: TCP connection to 127.0.0.1:1 failed")

        async def stream() -> AsyncIterator[dict[str, Any]]:
            for i, out in enumerate(self.answers):
                if i == 1 and how in ("breaks", "ends"):
                    if how == "breaks":
                        raise RuntimeError("Disconnected: stream ended before generation completed")
                    return
                yield out

        return stream()


class Counts:
    def __init__(self) -> None:
        self.forwarded = self.local = 0


def relay(role: str, client: FakeClient, peers: frozenset[int]) -> tuple[Relay, Counts]:
    counts = Counts()

    def forwarded() -> None:
        counts.forwarded += 1

    def local() -> None:
        counts.local += 1

    r = Relay(role, lambda: peers, on_forwarded=forwarded, on_local=local)
    r.client = client
    return r, counts


class Context:
    def __init__(self, stopped: bool = False) -> None:
        self.stopped = stopped

    def is_stopped(self) -> bool:
        return self.stopped


def collect(r: Relay, request: Any, context: Any = None, asked_locally: list[Any] | None = None) -> list[Any]:
    async def local(req: Any, ctx: Any) -> AsyncIterator[Any]:
        if asked_locally is not None:
            asked_locally.append(req)
        left = req.get("stop_conditions", {}).get("max_tokens", 1)
        for i in range(left):
            usage = {"prompt_tokens": len(req["token_ids"]), "completion_tokens": i + 1}
            yield token(100 + i, last=i == left - 1, usage=usage) if "stop_conditions" in req else {"local": True}

    async def run() -> list[Any]:
        return [out async for out in r.serve(request, context, local)]

    return asyncio.run(run())


def test_a_live_peer_answers_and_peers_take_turns() -> None:
    client = FakeClient({1: "answers", 2: "answers"})
    r, counts = relay("prefill", client, frozenset({2, 1}))
    assert [collect(r, {"token_ids": PROMPT}) for _ in range(3)] == [[PREFILL_ANSWER]] * 3
    assert [peer for peer, _ in client.asked] == [1, 2, 1] and (counts.forwarded, counts.local) == (3, 0)


def test_a_peer_that_refuses_passes_the_request_to_the_next_live_one() -> None:
    client = FakeClient({1: "refuses", 2: "answers"})
    r, counts = relay("prefill", client, frozenset({1, 2}))
    assert collect(r, {"token_ids": PROMPT}) == [PREFILL_ANSWER] and [p for p, _ in client.asked] == [1, 2]
    assert collect(r, {"token_ids": PROMPT}) == [PREFILL_ANSWER]
    assert [p for p, _ in client.asked] == [1, 2, 2]  # the next request starts at 2
    assert counts.forwarded == 2


def test_no_peer_or_only_peers_that_refuse_leave_the_request_to_this_worker() -> None:
    r, counts = relay("prefill", FakeClient({}), frozenset())
    assert collect(r, {"token_ids": PROMPT}) == [{"local": True}] and counts.local == 1
    client = FakeClient({1: "refuses", 2: "refuses"})
    r, counts = relay("prefill", client, frozenset({1, 2}))
    assert collect(r, {"token_ids": PROMPT}) == [{"local": True}]
    assert [p for p, _ in client.asked] == [1, 2] and (counts.forwarded, counts.local) == (0, 1)


def test_a_prefill_peer_that_breaks_after_answering_is_an_error_not_a_second_answer() -> None:
    client = FakeClient({1: "breaks"}, [PREFILL_ANSWER, PREFILL_ANSWER])
    with pytest.raises(RuntimeError, match="Disconnected"):
        collect(relay("prefill", client, frozenset({1}))[0], {"token_ids": PROMPT})


def test_a_decode_stream_is_passed_on_whole() -> None:
    answers = [token(10), token(11), token(12), token(13, last=True)]
    r, counts = relay("decode", FakeClient({1: "answers"}, answers), frozenset({1}))
    assert collect(r, DECODE_REQUEST) == answers and (counts.forwarded, counts.local) == (1, 0)


@pytest.mark.parametrize("how", ["breaks", "ends"])
def test_a_decode_stream_broken_by_a_dead_worker_is_finished_here_from_where_it_broke(how: str) -> None:
    answers = [token(10), token(11), token(12), token(13, last=True)]
    r, counts = relay("decode", FakeClient({1: how}, answers), frozenset({1}))
    asked: list[Any] = []
    out = collect(r, DECODE_REQUEST, Context(), asked)
    # One token came from the dead worker; this engine generated the other three for the prompt
    # plus that token, without the dead worker's hand-off.
    assert [t for o in out for t in o["token_ids"]] == [10, 100, 101, 102] and out[-1]["finish_reason"] == "length"
    assert asked == [
        {
            "token_ids": PROMPT + [10],
            "stop_conditions": {"max_tokens": 3, "min_tokens": 3, "ignore_eos": True},
            "sampling_options": {"temperature": 0.0},
        }
    ]
    # Its usage is the original request's: 3 prompt tokens, 4 completion tokens.
    assert out[-1]["completion_usage"] == {"prompt_tokens": 3, "completion_tokens": 4}
    assert (counts.forwarded, counts.local) == (1, 1)
    assert DECODE_REQUEST["token_ids"] == PROMPT  # the caller's request is left as it was


def test_a_broken_decode_stream_goes_on_at_the_next_live_worker_first() -> None:
    answers = [token(10), token(11, last=True)]
    client = FakeClient({1: "breaks", 2: "answers"}, answers)
    r, counts = relay("decode", client, frozenset({1, 2}))
    out = collect(r, {**DECODE_REQUEST, "stop_conditions": {"max_tokens": 2}})
    assert [t for o in out for t in o["token_ids"]] == [10, 10, 11]  # worker 2 answered the continuation
    assert client.asked[1] == (
        2,
        {"token_ids": PROMPT + [10], "stop_conditions": {"max_tokens": 1}, "sampling_options": {"temperature": 0.0}},
    )
    assert (counts.forwarded, counts.local) == (1, 0)


def test_a_decode_stream_is_not_continued_for_a_caller_that_has_gone_nor_with_several_choices() -> None:
    answers = [token(10), token(11, last=True)]
    r, counts = relay("decode", FakeClient({1: "ends"}, answers), frozenset({1}))
    assert collect(r, DECODE_REQUEST, Context(stopped=True)) == [token(10)] and counts.local == 0
    several = [{**token(10), "index": 1}, token(11, last=True)]
    r, counts = relay("decode", FakeClient({1: "breaks"}, several), frozenset({1}))
    with pytest.raises(RuntimeError, match="Disconnected"):
        collect(r, DECODE_REQUEST)
    assert counts.local == 0


def test_continuation() -> None:
    assert continuation(DECODE_REQUEST, []) is DECODE_REQUEST
    assert continuation(DECODE_REQUEST, [5, 6, 7, 8]) is None  # all sent: nothing left to generate
    more = continuation({"token_ids": PROMPT, "stop_conditions": {"min_tokens": 1}}, [5, 6])
    assert more == {"token_ids": PROMPT + [5, 6], "stop_conditions": {"min_tokens": 0}}
