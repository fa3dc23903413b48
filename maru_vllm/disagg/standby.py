"""A worker's stand-in for the other role: its engine behind the other role's endpoint.

`Standby.start()` builds `dynamo.vllm`'s own handler of the other role (`PrefillWorkerHandler` on
a decode worker, `DecodeWorkerHandler` on a prefill worker) over this worker's engine, serves it
on the other role's `generate` endpoint (`prefill/generate`, `backend/generate`), takes the
instance out of discovery at once, and registers the other role's model card for it, so that the
frontend already knows the card when the instance appears. `promote()` puts the instance into
discovery (`register_endpoint_instance`), `withdraw()` takes it out again: requests it holds run to
their end, new ones go to the real workers. Both are cheap and idempotent.

The stand-in's card announces no KV events and no local indexer (it publishes none for the other
role's component), so the frontend routes to it by load. Requests it serves are counted in
`maru_disagg_standby_requests_total{standby_role}`; `maru_disagg_standby_promoted{standby_role}`
is 1 while it is in discovery (both on the worker's own `/metrics`).
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
            "requests this worker served for the other role while no worker of that role was live",
            ["standby_role"],
            registry=self.registry,
        ).labels(standby_role)
        self.promoted = Gauge(
            f"{METRIC_PREFIX}standby_promoted",
            "1 while this worker stands in for the other role (its stand-in endpoint is in discovery)",
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
        self.served = 0

    async def start(self, instance_id: int) -> None:
        """Serve the stand-in endpoint, out of discovery, with the role's card registered."""
        handler = self._handler()
        generate = handler.generate

        async def serve(request: Any, context: Any) -> AsyncIterator[Any]:
            self.served += 1
            self.metrics.requests.inc()
            async for out in generate(request, context):
                yield out

        task = asyncio.ensure_future(self.endpoint.serve_endpoint(serve, graceful_shutdown=True))
        _keep(task, f"stand-in {COMPONENT[self.role]}.{GENERATE}")
        client = await self.endpoint.client()
        await _until(lambda: instance_id in client.instance_ids(), REGISTER_WAIT_S, task)
        await self.endpoint.unregister_endpoint_instance()
        await self._register_card()

    async def promote(self) -> None:
        if not self.promoted:
            await self.endpoint.register_endpoint_instance()
            self.promoted = True
            self.metrics.promoted.set(1)

    async def withdraw(self) -> None:
        if self.promoted:
            await self.endpoint.unregister_endpoint_instance()
            self.promoted = False
            self.metrics.promoted.set(0)

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
