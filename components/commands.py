"""The command lines that start the graph components on this machine.

The engine side's launch stack (`maru_vllm.launch.stack`) starts nats-server, the pool service,
vLLM's OpenAI server and Dynamo's frontend; the components of this package are started here:
the pool through its component entry point, the Maru worker and the plain `dynamo.vllm` worker.
Each runs with this interpreter, so it runs the venv's vLLM and Dynamo whatever is on PATH.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from maru_vllm.launch.argv import kv_events_args
from maru_vllm.launch.ports import free_port

POOL_COMPONENT = "maru_dynamo.components.pool"  # the pool service as a graph component (no `serve`)
POOL_COMPONENT_ENTRY = ("-m", POOL_COMPONENT)  # `entry` of `maru_vllm.launch.stack.pool_command`

MARU_WORKER_MODULE = "maru_dynamo.components.maru_worker"  # dynamo.vllm + MaruKVConnector + pool events


def maru_worker_command(
    model: str | Path, pool_address: str, pool_name: str, extra_args: Sequence[str] = ()
) -> list[str]:
    """A Maru worker component's command line: the engine on `model`, its KV in the pool
    `pool_name` served at `pool_address`, then `extra_args` (worker or vLLM flags)."""
    return [
        sys.executable,
        "-m",
        MARU_WORKER_MODULE,
        "--model",
        str(model),
        "--maru-pool-address",
        pool_address,
        "--maru-pool-name",
        pool_name,
        *extra_args,
    ]


VLLM_WORKER_MODULE = "maru_dynamo.components.vllm_worker"  # plain dynamo.vllm (text-only entry point)


def vllm_worker_command(model: str | Path, kv_events_port: int | None = None) -> list[str]:
    """A plain `dynamo.vllm` worker's command line on `model`, publishing KV events on its own port."""
    return [
        sys.executable,
        "-m",
        VLLM_WORKER_MODULE,
        "--model",
        str(model),
        *kv_events_args(kv_events_port or free_port()),
    ]
