"""A worker's stand-in for the other role: its engine behind the other role's endpoint.

`Standby.start()` builds `dynamo.vllm`'s own handler of the other role (`PrefillWorkerHandler` on
a decode worker, `DecodeWorkerHandler` on a prefill worker) over this worker's engine, serves it
on the other role's `generate` endpoint (`prefill/generate`, `backend/generate`) and registers the
other role's model card for it.

Both stand-ins are **in discovery all along, and forward** (`relay.py`): a request one gets while
a worker of its role is live goes on to that worker and its answer comes back unchanged, so the
work still runs on a worker of the role, one hop later; when the one it tried does not answer the
next live one is tried, and only with none live or none answering does this engine serve it. A
decode stream that breaks because its worker died is finished from where it broke. Being listed
all along is what makes a lost role cost nothing: when a worker dies, the frontend retries its
requests at once and never on the worker it tried, so an instance of the role that is not that
worker must already be listed to take the retry - and the stand-in takes it whether or not this
worker has learnt of the death yet, since it finds out by trying.

`promote()`/`withdraw()` mark when the worker stands in (no worker of the role is live):
`maru_disagg_standing_in{standby_role}` is 1 meanwhile. Requests this engine served (or finished)
for the other role are counted in `maru_disagg_standby_requests_total{standby_role}`, forwarded
ones in `maru_disagg_forwarded_requests_total{standby_role}` (both on the worker's own
`/metrics`). The stand-in's card announces no KV events and no local indexer (it publishes none
for the other role's component), so the frontend routes to it by load.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from maru_dynamo.components.disagg.peers import _keep
from maru_dynamo.components.disagg.relay import Relay
from maru_dynamo.components.disagg.roles import COMPONENT, DECODE, GENERATE, PREFILL, endpoint_path

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
            "requests this worker's engine served or finished for the other role (no worker of that role answered)",
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
        self.register = register  # dynamo.vllm.main.register_vllm_model, unwrapped
        self.metrics = metrics
        self.config = _config_for(config, role)
        self.endpoint = runtime.endpoint(endpoint_path(config.namespace, role, GENERATE))
        self.promoted = False
        self.served = 0  # requests served (or finished) on this engine for the other role
        self.relay = Relay(role, frozenset, on_forwarded=metrics.forwarded.inc, on_local=self._served_here)

    async def start(self, instance_id: int, live_peers: Callable[[], frozenset[int]]) -> None:
        """Serve the stand-in endpoint, in discovery, with the role's card registered.
        `live_peers()`: the live workers of the role."""
        self.relay.live_peers = live_peers
        local = self._handler().generate

        async def serve(request: Any, context: Any) -> AsyncIterator[Any]:
            async for out in self.relay.serve(request, context, local):
                yield out

        self.relay.client = await self.endpoint.client()  # before it serves: what it gets goes on at once
        task = asyncio.ensure_future(self.endpoint.serve_endpoint(serve, graceful_shutdown=True))
        _keep(task, f"stand-in {COMPONENT[self.role]}.{GENERATE}")
        await _until(lambda: instance_id in self.relay.client.instance_ids(), REGISTER_WAIT_S, task)
        await self._register_card()

    def promote(self) -> None:
        """No worker of the role is live: this worker stands in (its engine serves what comes)."""
        if not self.promoted:
            self.promoted = True
            self.metrics.standing_in.set(1)

    def withdraw(self) -> None:
        """A worker of the role is live again: requests go on to it again."""
        if self.promoted:
            self.promoted = False
            self.metrics.standing_in.set(0)

    def _served_here(self) -> None:
        self.served += 1
        self.metrics.requests.inc()

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
