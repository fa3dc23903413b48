"""Start a `RoleGuard` in the `dynamo.vllm` worker this process runs next (ai-dynamo 1.6.1).

Two module attributes of `dynamo.vllm.main` are wrapped, in this process only (no installed file
is edited), the same seam the warm-up and the event relay use:

* `create_runtime`: to keep the worker's `DistributedRuntime`;
* `register_vllm_model`: once the worker's own model card is registered as a prefill or decode
  worker, a `RoleGuard` starts in the worker's event loop. Its endpoints join
  `dynamo.vllm.main.shutdown_endpoints`, the list Dynamo's SIGTERM handler unregisters first, so a
  worker stopping on purpose leaves the other role's workers' view at once.

The stand-in's own card is registered with the unwrapped `register_vllm_model`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from maru_vllm.disagg.guard import RoleGuard
from maru_vllm.disagg.peers import _keep
from maru_vllm.disagg.roles import ROLES, other_role
from maru_vllm.disagg.standby import Standby, StandbyMetrics

logger = logging.getLogger(__name__)

REGISTER_PARAMS = ("model_input", "model_type", "generate_endpoint", "config", "engine_client", "vllm_config")


def install_role_standby() -> None:
    """Make the next `dynamo.vllm` prefill or decode worker of this process stand by for the other role.

    Raises RuntimeError when `dynamo.vllm.main` does not have the 1.6.1 seams.
    """
    import dynamo.vllm.main as dm

    current: Callable[..., Awaitable[Any]] = dm.register_vllm_model
    base = getattr(current, "__wrapped__", current)
    params = tuple(inspect.signature(base).parameters)
    if params[: len(REGISTER_PARAMS)] != REGISTER_PARAMS or "worker_type" not in params:
        raise RuntimeError(
            "dynamo.vllm.main.register_vllm_model is not what ai-dynamo 1.6.1 has "
            f"(parameters {list(params)}); the role stand-in cannot hook in"
        )
    if not callable(getattr(dm, "create_runtime", None)) or not isinstance(
        getattr(dm, "shutdown_endpoints", None), list
    ):
        raise RuntimeError("dynamo.vllm.main has no create_runtime / shutdown_endpoints (ai-dynamo 1.6.1 has both)")

    runtimes: list[Any] = []
    create_runtime = dm.create_runtime

    def create_runtime_kept(*args: Any, **kwargs: Any) -> Any:
        out = create_runtime(*args, **kwargs)
        runtimes.append(out[0] if isinstance(out, tuple) else out)
        return out

    started: set[int] = set()

    async def register_vllm_model(*args: Any, **kwargs: Any) -> Any:
        result = await current(*args, **kwargs)
        bound = inspect.signature(base).bind(*args, **kwargs)
        config = bound.arguments["config"]
        role = _role_of(config)
        endpoint = bound.arguments["generate_endpoint"]
        if role is not None and runtimes and id(endpoint) not in started and _is_primary(config, role):
            started.add(id(endpoint))
            # In a task: the worker goes on to serve its own endpoint meanwhile.
            task = asyncio.get_running_loop().create_task(
                _run_guard(runtimes[-1], role, bound.arguments, base, dm.shutdown_endpoints)
            )
            _keep(task, "role guard")
        return result

    register_vllm_model.__wrapped__ = base  # type: ignore[attr-defined]
    dm.create_runtime = create_runtime_kept
    dm.register_vllm_model = register_vllm_model


def _role_of(config: Any) -> str | None:
    mode = getattr(getattr(config, "disaggregation_mode", None), "value", None)
    return mode if mode in ROLES else None


def _is_primary(config: Any, role: str) -> bool:
    """A worker's own registration (its component is its role's), not a stand-in's."""
    from maru_vllm.disagg.roles import COMPONENT

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
