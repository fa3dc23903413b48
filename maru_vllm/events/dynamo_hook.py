"""Wire the pool's blocks into the KV events a `dynamo.vllm` worker publishes.

Mechanism: `dynamo.vllm.main` hands its module-level `setup_kv_event_publisher` to
`WorkerFactory` (Dynamo's own dependency-injection seam for the KV publisher) when `main()`
runs. `install_pool_event_relay` replaces that module attribute - in this process, before
`dynamo.vllm` runs; no installed file is edited - with a wrapper that calls Dynamo's original
function and, only while it runs, swaps the `KvEventPublisher` class it constructs for a
factory that

1. starts a `KvEventRelay` subscribed to the ZMQ endpoint Dynamo computed (vLLM's publisher
   for that DP rank, or the KVBM consolidator), following the pool's NATS events, and
2. builds Dynamo's real `KvEventPublisher` with `zmq_endpoint` = the relay's endpoint.

So Dynamo keeps computing endpoints, DP ranks and block sizes itself, and its publisher still
sees exactly one event source per worker - now carrying vLLM's events and the pool's. If the
relay cannot start, the publisher is built on vLLM's endpoint as before (no pool awareness,
an error in the log); the engine is never affected.

The shape of the seam is pinned to ai-dynamo 1.6.1 (`check_dynamo_version`).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.metadata
import inspect
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

REQUIRED_DYNAMO_VERSION = "1.6.1"
_SETUP_PARAMS = ("config", "generate_endpoint", "vllm_config")


class DynamoVersionError(RuntimeError):
    """The installed Dynamo is not the version this hook was written and tested against."""


def check_dynamo_version() -> str:
    """Return the installed ai-dynamo version; raise `DynamoVersionError` unless it is 1.6.1."""
    found: dict[str, str | None] = {}
    for dist in ("ai-dynamo", "ai-dynamo-runtime"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    wrong = {d: v for d, v in found.items() if v != REQUIRED_DYNAMO_VERSION}
    if wrong:
        raise DynamoVersionError(
            "maru_vllm.events hooks into dynamo.vllm's KV event publisher set-up, which it supports "
            f"only in ai-dynamo=={REQUIRED_DYNAMO_VERSION} and ai-dynamo-runtime=={REQUIRED_DYNAMO_VERSION}; "
            f"installed: {', '.join(f'{d}=={v}' if v else f'{d} (missing)' for d, v in found.items())}. "
            f"Install the pinned versions (pip install 'maru-dynamo[dynamo]')."
        )
    return REQUIRED_DYNAMO_VERSION  # what found["ai-dynamo"] is once nothing is wrong


@dataclasses.dataclass(frozen=True)
class PoolEventRelayOptions:
    source: PoolSourceConfig  # which pool to follow, and how (its snapshot namespace is set per relay)
    medium: str = DEFAULT_MEDIUM
    namespace: str | None = None
    namespace_prefix: str | None = None
    max_announced_chunks: int | None = None  # the relay's announce cap (None: every pool object)
    tier2_credit_max_chunks: int | None = None  # tier-2 credit at the disk tier, at most this many chunks (None: off)


@dataclasses.dataclass
class RelayInstallation:
    """What `install_pool_event_relay` did; `relays` fills in when Dynamo sets up its publishers."""

    options: PoolEventRelayOptions
    original: Callable[..., Any]
    module: Any
    relays: list[KvEventRelay] = dataclasses.field(default_factory=list)
    thread: RelayThread | None = None
    wrapper: Callable[..., Any] | None = None

    def uninstall(self) -> None:
        """Put Dynamo's original set-up function back and stop the relays."""
        if getattr(self.module, "setup_kv_event_publisher", None) is self.wrapper:
            self.module.setup_kv_event_publisher = self.original
        self.stop_relays()

    def stop_relays(self, timeout: float = 5.0) -> None:
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.stop(self.relays, timeout)
        self.relays.clear()


_installed: RelayInstallation | None = None


def install_pool_event_relay(
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
) -> RelayInstallation:
    """Make the `dynamo.vllm` worker that runs next in this process announce the pool's blocks.

    Call it before running `dynamo.vllm` (e.g. `runpy.run_module("dynamo.vllm", ...)`) in the
    same process. See the module docstring for the mechanism and `maru_vllm.events` for the
    meaning of each argument. Raises `DynamoVersionError` for any Dynamo but 1.6.1, and
    RuntimeError when the seam is not where 1.6.1 has it, ValueError for a cap below 1. Calling
    it again replaces the options. `tier2_credit_max_chunks`: announce the cluster's tier-2 chunks
    at the disk tier, at most that many (`events.tier2_credit`; None: not).
    """
    global _installed
    check_dynamo_version()
    if max_announced_chunks is not None and max_announced_chunks < 1:
        raise ValueError(f"max_announced_chunks={max_announced_chunks}: must be >= 1 (or None: no cap)")
    if tier2_credit_max_chunks is not None and tier2_credit_max_chunks < 1:
        raise ValueError(f"tier2_credit_max_chunks={tier2_credit_max_chunks}: must be >= 1 (or None: off)")
    nats_url = nats_url or os.environ.get("NATS_SERVER") or "nats://127.0.0.1:4222"
    source = PoolSourceConfig(
        nats_url=nats_url,
        pool_name=pool_name,
        pool_address=pool_address,
        pool_token=pool_token,
        probe_interval_s=probe_interval_s,
    )
    opts = PoolEventRelayOptions(
        source, medium, namespace, namespace_prefix, max_announced_chunks, tier2_credit_max_chunks
    )
    import dynamo.vllm.main as dm

    original = dm.setup_kv_event_publisher
    if _installed is not None and original is _installed.wrapper:
        original = _installed.original
    params = list(inspect.signature(original).parameters)
    if tuple(params[:3]) != _SETUP_PARAMS or not hasattr(dm, "KvEventPublisher"):
        raise RuntimeError(
            "dynamo.vllm.main.setup_kv_event_publisher / KvEventPublisher are not what ai-dynamo "
            f"{REQUIRED_DYNAMO_VERSION} has (parameters {params}); the pool event relay cannot hook in"
        )
    inst = RelayInstallation(opts, original, dm)

    def setup_kv_event_publisher(
        config: Any, generate_endpoint: Any, vllm_config: Any, *args: Any, **kwargs: Any
    ) -> Any:
        real_cls = dm.KvEventPublisher
        # A factory stands in for the class while Dynamo sets up its publisher (undone below).
        dm.KvEventPublisher = _publisher_factory(real_cls, inst, vllm_config)  # type: ignore[misc, assignment]
        try:
            return original(config, generate_endpoint, vllm_config, *args, **kwargs)
        finally:
            dm.KvEventPublisher = real_cls  # type: ignore[misc]  # the class back (mypy: assigning to a type)

    setup_kv_event_publisher.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps sets it
    inst.wrapper = setup_kv_event_publisher
    dm.setup_kv_event_publisher = setup_kv_event_publisher
    if _installed is not None:
        _installed.stop_relays()
    _installed = inst
    atexit.register(_stop_at_exit, inst)
    logger.info(
        "pool event relay installed: pool %r via %s, medium %s%s",
        pool_name,
        nats_url,
        medium,
        f", tier-2 credit at DISK (at most {tier2_credit_max_chunks} chunks)" if tier2_credit_max_chunks else "",
    )
    return inst


def namespace_filter(opts: PoolEventRelayOptions, model: str) -> NamespaceFilter:
    """Exact namespace when given; else the given prefix; else every namespace of `model`."""
    if opts.namespace:
        return NamespaceFilter.exactly(opts.namespace)
    if opts.namespace_prefix:
        return NamespaceFilter(prefixes=(opts.namespace_prefix,))
    return NamespaceFilter.for_model(model)


def _publisher_factory(real_cls: Any, inst: RelayInstallation, vllm_config: Any) -> Callable[..., Any]:
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


def _start_relay(inst: RelayInstallation, vllm_config: Any, upstream: str, dp_rank: int, topic: str) -> KvEventRelay:
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


def _stop_at_exit(inst: RelayInstallation) -> None:
    try:
        inst.stop_relays(timeout=2.0)
    except Exception:
        pass
