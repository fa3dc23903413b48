"""Ask a KV router which blocks of a prompt each worker holds, per tier - without routing it.

`python -m maru_dynamo.components.router_probe --block-size 128 [--endpoint dynamo.backend.generate]`
starts its own Dynamo `KvRouter` on the workers' endpoint (it learns the same KV events the
frontend's router does, and recovers existing state from the workers' local indexers), prints
`ready`, then answers each stdin line `{"token_ids": [...]}` (optionally with `"lora_name"`, the
adapter a request names, and `"cache_namespace"`, the tenant salt Dynamo's frontend takes from a
request's `nvext.cache_salt`) with one JSON line: Dynamo's
`get_overlap_scores` result (`workers`: rows with `worker_id`, `dp_rank`, `device_blocks`,
`host_pinned_blocks`, `disk_blocks`, ...; plus `probe_lookup_s`, the time the router call took).
Run it with the graph's environment (discovery,
NATS, DYN_EVENT_PLANE). A diagnostic for operators and the end-to-end tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time


async def _serve(args: argparse.Namespace) -> None:
    from dynamo.llm import KvRouter, KvRouterConfig
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(
        loop, os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"), os.environ.get("DYN_REQUEST_PLANE", "tcp")
    )
    endpoint = runtime.endpoint(args.endpoint)
    client = await endpoint.client()
    await asyncio.wait_for(client.wait_for_instances(), args.timeout)
    config = KvRouterConfig(router_event_threads=args.event_threads)
    router = KvRouter(endpoint=endpoint, block_size=args.block_size, kv_router_config=config)
    print("ready", flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            break
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            t0 = time.perf_counter()
            scores = await router.get_overlap_scores(
                list(req["token_ids"]), lora_name=req.get("lora_name"), cache_namespace=req.get("cache_namespace")
            )
            scores["probe_lookup_s"] = time.perf_counter() - t0  # the router call alone, no pipe/JSON
            print(json.dumps(scores, default=str), flush=True)
        except Exception as exc:  # keep answering
            print(json.dumps({"error": str(exc)}), flush=True)
    runtime.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="router_probe", description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", default="dynamo.backend.generate", help="namespace.component.endpoint")
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a worker")
    p.add_argument(
        "--event-threads", type=int, default=4, help="KV indexer threads (the frontend's --router-event-threads)"
    )
    asyncio.run(_serve(p.parse_args(argv)))


if __name__ == "__main__":
    main()
