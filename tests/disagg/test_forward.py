"""A decode worker's prefill stand-in passes requests on to live prefill workers (no processes).

`FakeClient` stands in for Dynamo's `Client` (what `direct()` returns is an async iterator of the
peer's answers, or raises as Dynamo does when the peer is gone); the real path runs in
tests/e2e/test_disagg_roles.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from maru_vllm.disagg.standby import Standby, StandbyMetrics

ANSWER = {"token_ids": [7], "disaggregated_params": {"kv_transfer_params": {}}}


class FakeClient:
    """Dynamo's Client as the stand-in uses it: `direct(request, instance_id, ...)`."""

    def __init__(self, behaviour: dict[int, str]) -> None:
        self.behaviour = behaviour  # peer -> "answers" | "refuses" | "breaks"
        self.asked: list[int] = []

    async def direct(self, request: Any, instance_id: int, annotated: bool = True, context: Any = None) -> Any:
        self.asked.append(instance_id)
        how = self.behaviour[instance_id]
        if how == "refuses":
            raise RuntimeError("CannotConnect: TCP connection to 127.0.0.1:1 failed")

        async def stream() -> AsyncIterator[dict[str, Any]]:
            yield ANSWER
            if how == "breaks":
                raise RuntimeError("Disconnected: stream ended before generation completed")

        return stream()


def stand_in(client: FakeClient, peers: frozenset[int]) -> Standby:
    s = Standby.__new__(Standby)
    s.role, s.forwards, s._client, s._next = "prefill", True, client, 0
    s._peers = lambda: peers
    s.metrics = StandbyMetrics("prefill")
    return s


async def collect(s: Standby) -> list[Any]:
    return [out async for out in s._forward({"token_ids": [1]}, None)]


def forwarded(s: Standby) -> float:
    return s.metrics.registry.get_sample_value("maru_disagg_forwarded_requests_total", {"standby_role": "prefill"})


def test_a_live_peer_answers_and_peers_take_turns() -> None:
    client = FakeClient({1: "answers", 2: "answers"})
    s = stand_in(client, frozenset({2, 1}))
    assert [asyncio.run(collect(s)) for _ in range(3)] == [[ANSWER]] * 3
    assert client.asked == [1, 2, 1] and forwarded(s) == 3


def test_a_peer_that_refuses_passes_the_request_to_the_next_live_one() -> None:
    client = FakeClient({1: "refuses", 2: "answers"})
    s = stand_in(client, frozenset({1, 2}))
    assert asyncio.run(collect(s)) == [ANSWER] and client.asked == [1, 2] and forwarded(s) == 1
    assert asyncio.run(collect(s)) == [ANSWER] and client.asked == [1, 2, 2]  # the next request starts at 2


def test_no_peer_or_only_peers_that_refuse_leave_the_request_to_this_worker() -> None:
    assert asyncio.run(collect(stand_in(FakeClient({}), frozenset()))) == []
    client = FakeClient({1: "refuses", 2: "refuses"})
    s = stand_in(client, frozenset({1, 2}))
    assert asyncio.run(collect(s)) == [] and client.asked == [1, 2] and forwarded(s) == 0


def test_a_peer_that_breaks_after_answering_is_an_error_not_a_second_answer() -> None:
    with pytest.raises(RuntimeError, match="Disconnected"):
        asyncio.run(collect(stand_in(FakeClient({1: "breaks"}), frozenset({1}))))
