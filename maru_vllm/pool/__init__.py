"""Maru KV pool: a shared-memory object pool that vLLM instances on one host (or CXL domain)
use to share KV-cache chunks.

Client side: `PoolClient` (synchronous, thread-safe). Service: `maru-dynamo pool serve` or
`python -m maru_vllm.pool serve`. See docs/pool.md.
"""

from maru_vllm.pool.client import PartPin, PoolClient, ReadPin, Reservation
from maru_vllm.pool.errors import InvalidArgument, PoolError, PoolProtocolError, PoolUnavailable
from maru_vllm.pool.events import events_subject, snapshot_subject

__all__ = [
    "InvalidArgument",
    "PoolClient",
    "PoolError",
    "PoolProtocolError",
    "PoolUnavailable",
    "PartPin",
    "ReadPin",
    "Reservation",
    "events_subject",
    "snapshot_subject",
]
