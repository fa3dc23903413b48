"""A worker's liveness side without an engine, for tests/disagg/test_peers.py: `python -m
tests.disagg.peer_process ROLE` serves `maru_watch` (the real `serve_watch`) and a `generate`
endpoint on ROLE's component, prints `ready <instance id>`, and on SIGUSR1 unregisters `generate`
(what a worker stopping on purpose does first)."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import uvloop


async def main(role: str) -> None:
    from dynamo.runtime import DistributedRuntime

    from maru_dynamo.components.disagg.peers import serve_watch
    from maru_dynamo.components.disagg.roles import GENERATE, endpoint_path

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp")
    generate = runtime.endpoint(endpoint_path("dynamo", role, GENERATE))

    async def answer(request: Any, context: Any) -> Any:
        yield {"token_ids": [1], "finish_reason": "length"}

    serving = asyncio.ensure_future(generate.serve_endpoint(answer))
    await serve_watch(runtime, "dynamo", role, generate.connection_id())
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, stop.set)
    print(f"ready {generate.connection_id()}", flush=True)
    await stop.wait()
    await generate.unregister_endpoint_instance()
    print("unregistered", flush=True)
    await serving


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
