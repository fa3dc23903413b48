"""The pipe to Dynamo's publisher delivers what its own drain report queues: a removal withdrawn
again while the pipe is full again still reaches the publisher, with no later batch to push it."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from maru_vllm.events import vllm_format as vf
from maru_vllm.events.downstream import DownstreamPipe, Lost, SendStats


class ScriptedSocket:
    """Stand-in for the XPUB socket (a fake: the test decides when the peer has room). Takes
    `room` batches, then refuses with `zmq.Again` as a full `XPUB_NODROP` socket does."""

    def __init__(self) -> None:
        self.room = 0
        self.taken: list[tuple[int, bytes]] = []

    def send_multipart(self, frames: tuple[bytes, bytes, bytes], flags: int = 0) -> asyncio.Future[Any]:
        if self.room == 0:
            raise zmq.Again
        self.room -= 1
        self.taken.append((vf.decode_seq(frames[1]), frames[2]))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


async def _withdraw_again_while_full() -> tuple[ScriptedSocket, DownstreamPipe, list[Lost]]:
    reports: list[Lost] = []
    pipe: DownstreamPipe

    def on_drained(lost: Lost) -> None:
        reports.append(lost)
        if lost.removed:  # as the relay does: withdraw the dropped removals again
            pipe.send(b"withdraw " + b",".join(str(h).encode() for h in sorted(lost.removed)))

    sock = ScriptedSocket()
    pipe = DownstreamPipe(b"", SendStats(), max_unsent_bytes=100, on_drained=on_drained)
    pipe.socket = sock  # type: ignore[assignment]
    pipe.send(b"a" * 60, removed=[1])  # the pipe is full: kept
    pipe.send(b"b" * 60, removed=[2])  # past the backlog: dropped, block 2 remembered
    sock.room = 1  # room for "a" only: the withdrawal of 2 finds the pipe full again
    await asyncio.sleep(0.05)
    assert [p for _, p in sock.taken] == [b"a" * 60] and not pipe.drained
    sock.room = 10  # the publisher reads again, and nothing else is ever sent
    for _ in range(100):
        if pipe.drained:
            break
        await asyncio.sleep(0.01)
    return sock, pipe, reports


def test_a_removal_withdrawn_again_into_a_full_pipe_is_delivered_once_it_has_room() -> None:
    sock, pipe, reports = asyncio.run(_withdraw_again_while_full())
    assert [p for _, p in sock.taken] == [b"a" * 60, b"withdraw 2"]
    assert [s for s, _ in sock.taken] == [0, 1]  # numbered without a gap
    assert pipe.drained and pipe.unsent_bytes == 0
    assert reports[0].removed == {2} and pipe.stats.removals_lost == 1
