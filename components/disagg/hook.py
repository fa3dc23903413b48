"""Start a `RoleGuard` in a `dynamo.vllm` prefill or decode worker once it has registered.

The worker's hook into `dynamo.vllm` (`maru_dynamo.components.dynamo_hooks`, its `standby` step)
keeps the worker's `DistributedRuntime` and calls `start_role_guard` right after the worker's own
model card is registered as a prefill or decode worker: a `RoleGuard` starts in the worker's event
loop. Its endpoints join `dynamo.vllm.main.shutdown_endpoints`, the list Dynamo's SIGTERM handler
unregisters first, so a worker stopping on purpose leaves the other role's workers' view at once.

The stand-in's own card is registered with Dynamo's `register_vllm_model`, not the hooked one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from maru_dynamo.components.disagg.guard import RoleGuard
from maru_dynamo.components.disagg.peers import _keep
from maru_dynamo.components.disagg.roles import ROLES, other_role
from maru_dynamo.components.disagg.standby import Standby, StandbyMetrics

logger = logging.getLogger(__name__)


def start_role_guard(
    runtime: Any,
    arguments: dict[str, Any],
    register: Callable[..., Awaitable[Any]],
    shutdown_endpoints: list[Any],
    started: set[int],
) -> None:
    """After a worker registered (`arguments`: `register_vllm_model`'s, by name): a prefill or
    decode worker's own card starts its guard, once per endpoint (`started`), in a task."""
    config = arguments["config"]
    role = _role_of(config)
    endpoint = arguments["generate_endpoint"]
    if role is None or id(endpoint) in started or not _is_primary(config, role):
        return
    started.add(id(endpoint))
    # In a task: the worker goes on to serve its own endpoint meanwhile.
    task = asyncio.get_running_loop().create_task(_run_guard(runtime, role, arguments, register, shutdown_endpoints))
    _keep(task, "role guard")


def _role_of(config: Any) -> str | None:
    mode = getattr(getattr(config, "disaggregation_mode", None), "value", None)
    return mode if mode in ROLES else None


def _is_primary(config: Any, role: str) -> bool:
    """A worker's own registration (its component is its role's), not a stand-in's."""
    from maru_dynamo.components.disagg.roles import COMPONENT

    if config.component != COMPONENT[role]:
        logger.warning(
            "maru_worker: %s worker on component %r (not %r): no stand-in for the %s role",
            role,
            config.component,
            COMPONENT[role],
            other_role(role),
        )
        return False
    return True


async def _run_guard(
    runtime: Any,
    role: str,
    args: dict[str, Any],
    register: Callable[..., Awaitable[Any]],
    shutdown_endpoints: list[Any],
) -> None:
    config, endpoint = args["config"], args["generate_endpoint"]
    metrics = StandbyMetrics(other_role(role))
    standby = Standby(
        runtime=runtime,
        config=config,
        engine_client=args["engine_client"],
        vllm_config=args["vllm_config"],
        role=other_role(role),
        register=register,
        metrics=metrics,
    )
    guard = RoleGuard(
        standby,
        runtime=runtime,
        namespace=config.namespace,
        role=role,
        instance_id=endpoint.connection_id(),
        stopping=_shutdown_started,
    )
    try:
        metrics.export(endpoint)
        shutdown_endpoints.extend(await guard.start())
    except Exception as exc:  # the worker keeps serving its own role
        logger.error(
            "maru_worker: cannot stand by for the %s role (%s); serving the %s role only", other_role(role), exc, role
        )
        return
    await guard.run()


def _shutdown_started() -> bool:
    """Whether Dynamo's graceful shutdown of this worker has begun (its module's own flag)."""
    from dynamo.common.utils import graceful_shutdown

    flag = getattr(graceful_shutdown, "_shutdown_started", None)
    return bool(flag is not None and flag.is_set())
