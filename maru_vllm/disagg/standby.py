"""A worker's stand-in for the other role: its engine behind the other role's endpoint.

`Standby.start()` builds `dynamo.vllm`'s own handler of the other role (`PrefillWorkerHandler` on
a decode worker, `DecodeWorkerHandler` on a prefill worker) over this worker's engine, serves it
on the other role's `generate` endpoint (`prefill/generate`, `backend/generate`) and registers the
other role's model card for it. The two roles' stand-ins differ in how they reach discovery:

* **prefill stand-in (on a decode worker): always in discovery, forwarding.** A prefill request
  it gets while a prefill worker is live goes on to one of them (`live_peers()`, round robin) and
  its answer comes back unchanged - one message, one more hop - so the prefill still runs on a
  prefill worker. When the one it tried does not answer (it died a moment ago) the next live one
  is tried; only when none is live or none answers does it prefill on its own engine. Being in
  discovery all along is what makes a lost prefill role cost nothing: the frontend retries a
  failed prefill at once and never on the worker it tried, so a prefill endpoint must already be
  there to take the retry.
* **decode stand-in (on a prefill worker): out of discovery until promoted.** Forwarding decode
  streams would relay every token of a share of the requests through the prefill worker, so it
  stays out (`unregister_endpoint_instance` right after it is served) until `promote()` puts it
  into discovery (`register_endpoint_instance`); `withdraw()` takes it out again. A decode leg
  comes after a prefill leg, which gives a promotion the milliseconds it needs.

`promote()`/`withdraw()` mark when the worker stands in (no worker of the role is live):
`maru_disagg_standing_in{standby_role}` is 1 meanwhile. Requests served on this engine for the
other role are counted in `maru_disagg_standby_requests_total{standby_role}`, forwarded ones in
`maru_disagg_forwarded_requests_total{standby_role}` (both on the worker's own `/metrics`). The
stand-in's card announces no KV events and no local indexer (it publishes none for the other
role's component), so the frontend routes to it by load.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from maru_vllm.disagg.peers import _keep
from maru_vllm.disagg.roles import COMPONENT, DECODE, GENERATE, PREFILL, endpoint_path

logger = logging.getLogger(__name__)

METRIC_PREFIX = "maru_disagg_"
REGISTER_WAIT_S = 10.0


class StandbyMetrics:
    """The stand-in's Prometheus series, in a registry of their own (exported by Dynamo's
    system server through `register_engine_metrics_callback`)."""

    def __init__(self, standby_role: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{METRIC_PREFIX}standby_requests",
            "requests this worker's engine served for the other role (no worker of that role answered)",
            ["standby_role"],
            registry=self.registry,
        ).labels(standby_role)
        self.forwarded = Counter(
            f"{METRIC_PREFIX}forwarded_requests",
            "requests for the other role this worker's stand-in passed on to a worker of that role",
            ["standby_role"],
            registry=self.registry,
        ).labels(standby_role)
        self.standing_in = Gauge(
            f"{METRIC_PREFIX}standing_in",
            "1 while no worker of the other role is live and this worker serves that role",
            ["standby_role"],
            registry=self.registry,
        ).labels(standby_role)

    def export(self, endpoint: Any) -> None:
        """Add the series to the `/metrics` of the worker's system server (its `endpoint`)."""
        from dynamo.common.utils.prometheus import register_engine_metrics_callback

        register_engine_metrics_callback(
            endpoint=endpoint, registry=self.registry, metric_prefix_filters=[METRIC_PREFIX]
        )


class Standby:
    """This worker's engine serving the `role` it stands in for (see the module docstring)."""

    def __init__(
        self,
        *,
        runtime: Any,
        config: Any,
        engine_client: Any,
        vllm_config: Any,
        role: str,
        register: Callable[..., Awaitable[Any]],
        metrics: StandbyMetrics,
    ) -> None:
        self.runtime, self.engine_client, self.vllm_config = runtime, engine_client, vllm_config
        self.role = role  # the role stood in for
        self.forwards = role == PREFILL  # see the module docstring
        self.register = register  # dynamo.vllm.main.register_vllm_model, unwrapped
        self.metrics = metrics
        self.config = _config_for(config, role)
        self.endpoint = runtime.endpoint(endpoint_path(config.namespace, role, GENERATE))
        self.promoted = False
        self.served = 0  # requests served on this engine for the other role
        self._peers: Callable[[], frozenset[int]] = frozenset
        self._client: Any = None
        self._next = 0

    async def start(self, instance_id: int, live_peers: Callable[[], frozenset[int]]) -> None:
        """Serve the stand-in endpoint with the role's card registered: in discovery when it
        forwards, out of it otherwise. `live_peers()`: the live workers of the role."""
        self._peers = live_peers
        handler = self._handler()
        local = handler.generate

        async def serve(request: Any, context: Any) -> AsyncIterator[Any]:
            forwarded = False
            if self.forwards:
                async for out in self._forward(request, context):
                    forwarded = True
                    yield out
            if not forwarded:
                self.served += 1
                self.metrics.requests.inc()
                async for out in local(request, context):
                    yield out

        task = asyncio.ensure_future(self.endpoint.serve_endpoint(serve, graceful_shutdown=True))
        _keep(task, f"stand-in {COMPONENT[self.role]}.{GENERATE}")
        self._client = await self.endpoint.client()
        await _until(lambda: instance_id in self._client.instance_ids(), REGISTER_WAIT_S, task)
        if not self.forwards:
            await self.endpoint.unregister_endpoint_instance()
        await self._register_card()

    async def promote(self) -> None:
        """No worker of the role is live: this worker stands in (a decode stand-in enters discovery)."""
        if not self.promoted:
            if not self.forwards:
                await self.endpoint.register_endpoint_instance()
            self.promoted = True
            self.metrics.standing_in.set(1)

    async def withdraw(self) -> None:
        """A worker of the role is live again (a decode stand-in leaves discovery)."""
        if self.promoted:
            if not self.forwards:
                await self.endpoint.unregister_endpoint_instance()
            self.promoted = False
            self.metrics.standing_in.set(0)

    async def _forward(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """The answer of a live worker of the role: the live ones are tried in turn (round robin
        over requests) until one answers; nothing when none is live or none answered (the caller
        then serves the request itself). A worker that fails after it answered is an error."""
        peers = sorted(self._peers())
        if not peers:
            return
        first = self._next % len(peers)
        self._next += 1
        for peer in peers[first:] + peers[:first]:
            answered = False
            try:
                stream = await self._client.direct(request, peer, annotated=False, context=context)
                async for out in stream:
                    if not answered:
                        answered = True
                        self.metrics.forwarded.inc()
                    yield out
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # it died or stops: the next one, or this engine
                if answered:
                    raise
                logger.info("maru_worker: %s worker %x did not take a forwarded request (%s)", self.role, peer, exc)
            if answered:
                return

    def _handler(self) -> Any:
        """dynamo.vllm's handler of the stood-in role over this worker's engine."""
        from dynamo.vllm.handlers import DecodeWorkerHandler, PrefillWorkerHandler

        cls = PrefillWorkerHandler if self.role == PREFILL else DecodeWorkerHandler
        cfg, vc = self.config, self.vllm_config
        handler = cls(
            self.runtime,
            cfg,
            self.engine_client,
            vc.model_config.get_diff_sampling_param(),
            vc.model_config.max_model_len,
            model_config=vc.model_config,
            enable_multimodal=cfg.enable_multimodal,
            generate_endpoint=self.endpoint,
            use_vllm_tokenizer=cfg.use_vllm_tokenizer,
            shutdown_event=None,
            enable_frontend_decoding=cfg.frontend_decoding,
        )
        # The worker's own handler already watches the engine and logs its stats.
        monitor = getattr(handler, "engine_monitor", None)
        for name in ("_monitor_task", "_stats_task"):
            task = getattr(monitor, name, None)
            if isinstance(task, asyncio.Task):
                task.cancel()
        return handler

    async def _register_card(self) -> None:
        """The stood-in role's model card, as dynamo.vllm registers it for a worker of that role."""
        from dynamo.common.utils.endpoint_types import parse_endpoint_types
        from dynamo.llm import ModelInput, ModelType, WorkerType

        cfg = self.config
        if self.role == PREFILL:
            args: tuple[Any, ...] = (ModelInput.Tokens, ModelType.Prefill)
            worker_type, needs = WorkerType.Prefill, [[WorkerType.Decode]]
        else:
            model_input = ModelInput.Text if cfg.use_vllm_tokenizer else ModelInput.Tokens
            args = (model_input, parse_endpoint_types(cfg.endpoint_types))
            worker_type, needs = WorkerType.Decode, [[WorkerType.Prefill]]
        await self.register(
            *args, self.endpoint, cfg, self.engine_client, self.vllm_config, worker_type=worker_type, needs=needs
        )


def _config_for(config: Any, role: str) -> Any:
    """A copy of the worker's dynamo.vllm Config for serving `role`: its disaggregation mode and
    component, and no KV events or local indexer announced for that component."""
    from dynamo.vllm.constants import DisaggregationMode

    cfg = copy.copy(config)
    cfg.disaggregation_mode = DisaggregationMode.PREFILL if role == PREFILL else DisaggregationMode.DECODE
    cfg.component = COMPONENT[role]
    cfg.use_kv_events = False
    cfg.enable_local_indexer = False
    return cfg


async def _until(ready: Callable[[], bool], timeout_s: float, task: asyncio.Future[Any]) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if task.done():
            raise RuntimeError(
                f"the stand-in endpoint stopped serving: {task.exception() if not task.cancelled() else 'cancelled'}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"the stand-in endpoint did not register within {timeout_s:.0f} s")
        await asyncio.sleep(0.02)


__all__ = ["DECODE", "PREFILL", "Standby", "StandbyMetrics"]
