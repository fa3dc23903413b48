"""The pool event relay in front of a worker's KV event publisher.

A `dynamo.vllm` worker builds one KV event publisher per DP rank, each reading vLLM's ZMQ
endpoint. `publisher_factory` stands in for the publisher class while the worker sets its
publishers up (the Maru worker's hook into `dynamo.vllm`, on the Dynamo side, puts it there);
for each publisher it

1. starts a `KvEventRelay` subscribed to the ZMQ endpoint the worker computed (vLLM's publisher
   for that DP rank, or the KVBM consolidator), following the pool's NATS events, and
2. builds the real publisher with `zmq_endpoint` = the relay's endpoint.

So the worker keeps computing endpoints, DP ranks and block sizes itself, and its publisher still
sees exactly one event source - now carrying vLLM's events and the pool's. If the relay cannot
start, the publisher is built on vLLM's endpoint as before (no pool awareness, an error in the
log); the engine is never affected. Nothing here imports Dynamo.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from maru_vllm.events.nats_source import PoolSourceConfig
from maru_vllm.events.pool_view import NamespaceFilter
from maru_vllm.events.relay import KvEventRelay, RelayThread
from maru_vllm.events.tier2_credit import Tier2CreditConfig
from maru_vllm.events.types import DEFAULT_MEDIUM

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolEventRelayOptions:
    source: PoolSourceConfig  # which pool to follow, and how (its snapshot namespace is set per relay)
    medium: str = DEFAULT_MEDIUM
    namespace: str | None = None
    namespace_prefix: str | None = None
    max_announced_chunks: int | None = None  # the relay's announce cap (None: every pool object)
    tier2_credit_max_chunks: int | None = None  # tier-2 credit at the disk tier, at most this many chunks (None: off)


@dataclasses.dataclass
class PoolRelays:
    """The relays of one worker; `relays` fills in as the worker sets up its publishers."""

    options: PoolEventRelayOptions
    relays: list[KvEventRelay] = dataclasses.field(default_factory=list)
    thread: RelayThread | None = None

    def stop_relays(self, timeout: float = 5.0) -> None:
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.stop(self.relays, timeout)
        self.relays.clear()


def relay_options(
    *,
    pool_name: str,
    nats_url: str | None = None,
    pool_address: str | None = None,
    pool_token: str | None = None,
    medium: str = DEFAULT_MEDIUM,
    namespace: str | None = None,
    namespace_prefix: str | None = None,
    probe_interval_s: float = 10.0,
    max_announced_chunks: int | None = None,
    tier2_credit_max_chunks: int | None = None,
) -> PoolEventRelayOptions:
    """The relay's options (see `maru_vllm.events` for each); ValueError for a cap below 1."""
    if max_announced_chunks is not None and max_announced_chunks < 1:
        raise ValueError(f"max_announced_chunks={max_announced_chunks}: must be >= 1 (or None: no cap)")
    if tier2_credit_max_chunks is not None and tier2_credit_max_chunks < 1:
        raise ValueError(f"tier2_credit_max_chunks={tier2_credit_max_chunks}: must be >= 1 (or None: off)")
    source = PoolSourceConfig(
        nats_url=nats_url or os.environ.get("NATS_SERVER") or "nats://127.0.0.1:4222",
        pool_name=pool_name,
        pool_address=pool_address,
        pool_token=pool_token,
        probe_interval_s=probe_interval_s,
    )
    return PoolEventRelayOptions(
        source, medium, namespace, namespace_prefix, max_announced_chunks, tier2_credit_max_chunks
    )


def namespace_filter(opts: PoolEventRelayOptions, model: str) -> NamespaceFilter:
    """Exact namespace when given; else the given prefix; else every namespace of `model`."""
    if opts.namespace:
        return NamespaceFilter.exactly(opts.namespace)
    if opts.namespace_prefix:
        return NamespaceFilter(prefixes=(opts.namespace_prefix,))
    return NamespaceFilter.for_model(model)


def publisher_factory(real_cls: Any, inst: PoolRelays, vllm_config: Any) -> Callable[..., Any]:
    """Builds `real_cls` (the worker's publisher class) reading a relay in front of vLLM's endpoint."""

    def make_publisher(*args: Any, **kwargs: Any) -> Any:
        upstream = kwargs.get("zmq_endpoint")
        if not upstream or args:
            return real_cls(*args, **kwargs)  # not the relay-mode call shape of 1.6.1
        try:
            relay = _start_relay(inst, vllm_config, upstream, kwargs.get("dp_rank", 0), kwargs.get("zmq_topic") or "")
        except Exception:
            logger.exception("pool event relay did not start; this worker announces vLLM's events only")
            return real_cls(*args, **kwargs)
        logger.info(
            "Dynamo KV publisher for dp_rank=%s reads the merged stream at %s (vLLM at %s)",
            kwargs.get("dp_rank", 0),
            relay.endpoint,
            upstream,
        )
        return real_cls(*args, **{**kwargs, "zmq_endpoint": relay.endpoint})

    return make_publisher


def _start_relay(inst: PoolRelays, vllm_config: Any, upstream: str, dp_rank: int, topic: str) -> KvEventRelay:
    opts = inst.options
    model = str(vllm_config.model_config.model)
    filt = namespace_filter(opts, model)
    block_size = int(vllm_config.cache_config.block_size)
    if inst.thread is None:
        inst.thread = RelayThread()
    pool_cfg = dataclasses.replace(opts.source, snapshot_namespace=filt.single_namespace)
    tier2 = None
    if opts.tier2_credit_max_chunks is not None:
        tier2 = Tier2CreditConfig(opts.source.nats_url, opts.tier2_credit_max_chunks)

    async def make() -> KvEventRelay:
        relay = KvEventRelay(
            upstream=upstream,
            pool=pool_cfg,
            namespaces=filt,
            block_size=block_size,
            medium=opts.medium,
            data_parallel_rank=dp_rank,
            topic=topic,
            max_announced_chunks=opts.max_announced_chunks,
            tier2=tier2,
        )
        await relay.start()
        return relay

    relay = inst.thread.call(make(), timeout=30)
    inst.relays.append(relay)
    return relay


def stop_at_exit(inst: PoolRelays) -> None:
    """For `atexit`: the relays stopped, whatever state they are in."""
    try:
        inst.stop_relays(timeout=2.0)
    except Exception as exc:  # the process is ending: nothing to do but say so
        logger.debug("pool event relay: stopping at exit: %s", exc)
