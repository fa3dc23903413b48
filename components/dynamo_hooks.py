"""Every hook of the Maru worker into `dynamo.vllm`, in one module, installed in one declared order.

`dynamo.vllm` runs its worker from module attributes of `dynamo.vllm.main`. The Maru worker
replaces some of them in its own process (no installed file is edited) before it runs
`dynamo.vllm`; no other module of this project touches `dynamo.vllm.main`. The hooks, in the
order `ORDER` declares and `install_worker_hooks` installs them:

1. `pool-events` - `setup_kv_event_publisher`: while it runs, `KvEventPublisher` is a factory
   that puts the pool event relay in front of each publisher (`maru_vllm.events.publisher_relay`);
2. `drain` - `install_signal_handlers`: Dynamo's own SIGTERM handler, given the worker's drain
   (`maru_vllm.launch.lifecycle`) as its drain callback and no fixed sleep; and, before each
   registration, the engine and the instance id are recorded;
3. `warm-up` - before each registration, the engine serves its warm-up requests
   (`maru_vllm.launch.warmup`): registered means warm;
4. `standby` - `create_runtime` (the runtime kept) and, after the worker's own registration, a
   prefill or decode worker's role guard starts (`maru_dynamo.components.disagg.hook`).

`register_vllm_model` is wrapped once, whatever hooks are in: the wrapper runs the hooks' steps
in `ORDER` around Dynamo's own function (`__wrapped__`), so installing a hook again replaces its
step and never wraps a wrapper.

Before anything is replaced the installed Dynamo is checked: its release against
`maru_vllm.versions.DYNAMO`, and the leading parameters of every function a hook wraps against
the declarations in `maru_vllm.upstream_contracts` (the compatibility matrix checks the same ones
in each release's sources). A mismatch is refused in one line that names what moved.
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable
from importlib import metadata
from types import ModuleType
from typing import Any

from maru_vllm.events.publisher_relay import PoolRelays, publisher_factory, relay_options
from maru_vllm.launch.lifecycle import WorkerLifecycle
from maru_vllm.launch.warmup import WarmupOptions, warm_up_before_registration
from maru_vllm.upstream_contracts import DYNAMO_CONTRACTS
from maru_vllm.versions import DYNAMO

logger = logging.getLogger(__name__)

MAIN = "dynamo.vllm.main"
ORDER = ("pool-events", "drain", "warm-up", "standby")
# What each hook replaces or reads in dynamo.vllm.main.
SEAMS: dict[str, tuple[str, ...]] = {
    "pool-events": ("setup_kv_event_publisher", "KvEventPublisher"),
    "drain": ("install_signal_handlers", "register_vllm_model"),
    "warm-up": ("register_vllm_model",),
    "standby": ("register_vllm_model", "create_runtime", "shutdown_endpoints"),
}
# Where a dynamo.vllm.main attribute is declared when the module only imports it.
_DECLARED_IN = {"install_signal_handlers": "dynamo.common.utils.graceful_shutdown"}
_STEPS = "_maru_steps"  # on our register_vllm_model wrapper: its steps by hook name


class DynamoSeamError(RuntimeError):
    """The installed Dynamo is not one whose `dynamo.vllm` the worker's hooks were written for."""


class DynamoVersionError(DynamoSeamError):
    """The installed ai-dynamo release is not a supported one."""


def check_dynamo_version() -> str:
    """The installed ai-dynamo release; `DynamoVersionError` in one line unless it is supported."""
    found: dict[str, str | None] = {}
    for dist in ("ai-dynamo", "ai-dynamo-runtime"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    if all(v is not None and DYNAMO.covers(v) for v in found.values()):
        return str(found["ai-dynamo"])
    wanted = " or ".join(DYNAMO.releases)
    raise DynamoVersionError(
        f"the Maru worker hooks into dynamo.vllm as only ai-dynamo=={wanted} and ai-dynamo-runtime=={wanted} "
        f"have it; installed: {', '.join(f'{d}=={v}' if v else f'{d} (missing)' for d, v in found.items())}. "
        "Install a supported release (pip install 'maru-dynamo[dynamo]')."
    )


def declared_params(name: str) -> tuple[str, ...] | None:
    """The leading parameters `maru_vllm.upstream_contracts` declares for `dynamo.vllm.main.<name>`."""
    module = _DECLARED_IN.get(name, MAIN)
    for contract in DYNAMO_CONTRACTS:
        if contract.module != module or contract.qualname:
            continue
        for attr in contract.attrs:
            if attr.split("(", 1)[0] == name and "(" in attr:
                inside = attr.split("(", 1)[1].rstrip(")")
                return tuple(p.strip() for p in inside.split(",") if p.strip() and p.strip() != "*")
    return None


def check_seams(dm: Any, hooks: tuple[str, ...]) -> None:
    """Every attribute the `hooks` wrap is in `dm`, with the declared leading parameters.

    Raises `DynamoSeamError` in one line naming the first that moved or changed.
    """
    releases = "/".join(DYNAMO.releases)
    for hook in hooks:
        for name in SEAMS[hook]:
            found = getattr(dm, name, None)
            if name == "shutdown_endpoints":
                ok = isinstance(found, list)
            elif name == "KvEventPublisher" or name == "create_runtime":
                ok = callable(found)
            else:
                ok = callable(found) and _params_match(_unwrapped(found), name, hook)
            if not ok:
                raise DynamoSeamError(
                    f"{MAIN}.{name} is not what ai-dynamo {releases} has ({_shape(found)}; declared: "
                    f"{_declared_shape(name)}); the {hook} hook cannot go in: install a supported Dynamo"
                )


def _unwrapped(func: Any) -> Any:
    return func.__wrapped__ if hasattr(func, _STEPS) or hasattr(func, "_maru_hook") else func


def _params_match(func: Any, name: str, hook: str) -> bool:
    want = declared_params(name)
    params = tuple(inspect.signature(func).parameters)
    if want is not None and params[: len(want)] != want:
        return False
    return not (hook == "standby" and name == "register_vllm_model" and "worker_type" not in params)


def _shape(found: Any) -> str:
    if found is None:
        return "missing"
    if not callable(found):
        return f"a {type(found).__name__}"
    try:
        return f"parameters {list(inspect.signature(_unwrapped(found)).parameters)}"
    except (TypeError, ValueError):
        return "no signature"


def _declared_shape(name: str) -> str:
    want = declared_params(name)
    return f"({', '.join(want)}, ...)" if want is not None else "present"


def _main_module(dm: ModuleType | None) -> Any:
    if dm is not None:
        return dm
    import dynamo.vllm.main as main

    return main


@dataclasses.dataclass(frozen=True)
class Step:
    """One hook's part of the registration: `before` Dynamo registers, `after` it registered."""

    before: Callable[[dict[str, Any]], Awaitable[None]] | None = None
    after: Callable[[dict[str, Any], Callable[..., Awaitable[Any]]], None] | None = None


def hook_registration(dm: Any, hook: str, step: Step) -> Callable[..., Awaitable[Any]]:
    """(Re)wrap `dm.register_vllm_model` with `step` for `hook`; the other hooks' steps stay."""
    check_seams(dm, (hook,))
    current = dm.register_vllm_model
    steps: dict[str, Step] = dict(getattr(current, _STEPS, {}))
    original = _unwrapped(current)
    steps[hook] = step
    ordered = [steps[name] for name in ORDER if name in steps]
    sig = inspect.signature(original)

    async def register_vllm_model(*args: Any, **kwargs: Any) -> Any:
        arguments = dict(sig.bind(*args, **kwargs).arguments)
        for s in ordered:
            if s.before is not None:
                await s.before(arguments)
        result = await original(*args, **kwargs)
        for s in ordered:
            if s.after is not None:
                s.after(arguments, original)
        return result

    register_vllm_model.__wrapped__ = original  # type: ignore[attr-defined]
    register_vllm_model.__signature__ = sig  # type: ignore[attr-defined]
    setattr(register_vllm_model, _STEPS, steps)
    dm.register_vllm_model = register_vllm_model
    return register_vllm_model


def _wrap(dm: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
    """Replace `dm.<name>` by `make(Dynamo's own)`, marked, so a second install wraps Dynamo's own."""
    original = _unwrapped(getattr(dm, name))
    wrapper = make(original)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper._maru_hook = name  # type: ignore[attr-defined]
    setattr(dm, name, wrapper)


# -- the hooks ---------------------------------------------------------------------------------


@dataclasses.dataclass
class RelayInstallation(PoolRelays):
    """What `install_pool_event_relay` did; `relays` fills in when Dynamo sets up its publishers."""

    original: Callable[..., Any] | None = None
    module: Any = None
    wrapper: Callable[..., Any] | None = None

    def uninstall(self) -> None:
        """Put Dynamo's original set-up function back and stop the relays."""
        if getattr(self.module, "setup_kv_event_publisher", None) is self.wrapper:
            self.module.setup_kv_event_publisher = self.original
        self.stop_relays()


_installed: RelayInstallation | None = None


def install_pool_event_relay(*, dm: ModuleType | None = None, **options: Any) -> RelayInstallation:
    """`pool-events`: the next `dynamo.vllm` worker of this process announces the pool's blocks.

    `options`: `maru_vllm.events.publisher_relay.relay_options`'s (ValueError for a cap below 1).
    Calling it again replaces the options.
    """
    global _installed
    check_dynamo_version()
    opts = relay_options(**options)
    main = _main_module(dm)
    check_seams(main, ("pool-events",))
    inst = RelayInstallation(opts, original=_unwrapped(main.setup_kv_event_publisher), module=main)
    original = inst.original
    assert original is not None

    def make(_: Any) -> Callable[..., Any]:
        def setup_kv_event_publisher(
            config: Any, generate_endpoint: Any, vllm_config: Any, *args: Any, **kwargs: Any
        ) -> Any:
            real_cls = main.KvEventPublisher
            # A factory stands in for the class while Dynamo sets up its publisher (undone below).
            main.KvEventPublisher = publisher_factory(real_cls, inst, vllm_config)
            try:
                return original(config, generate_endpoint, vllm_config, *args, **kwargs)
            finally:
                main.KvEventPublisher = real_cls

        return setup_kv_event_publisher

    _wrap(main, "setup_kv_event_publisher", make)
    inst.wrapper = main.setup_kv_event_publisher
    if _installed is not None:
        _installed.stop_relays()
    _installed = inst
    atexit.register(_stop_at_exit, inst)
    source = opts.source
    logger.info(
        "pool event relay installed: pool %r via %s, medium %s%s",
        source.pool_name,
        source.nats_url,
        opts.medium,
        f", tier-2 credit at DISK (at most {opts.tier2_credit_max_chunks} chunks)"
        if opts.tier2_credit_max_chunks
        else "",
    )
    return inst


def _stop_at_exit(inst: RelayInstallation) -> None:
    from maru_vllm.events.publisher_relay import stop_at_exit

    stop_at_exit(inst)


def install_worker_lifecycle(lifecycle: WorkerLifecycle, dm: ModuleType | None = None) -> WorkerLifecycle:
    """`drain`: the next `dynamo.vllm` worker drains before it migrates, and records its instance."""
    main = _main_module(dm)
    check_seams(main, ("drain",))
    signal_sig = inspect.signature(_unwrapped(main.install_signal_handlers))

    def make(install_signals: Any) -> Callable[..., Any]:
        def install_signal_handlers(*args: Any, **kwargs: Any) -> Any:
            bound = signal_sig.bind(*args, **kwargs)
            theirs: Callable[[], Awaitable[None]] | None = bound.arguments.get("drain_callback")

            async def drain() -> None:
                await lifecycle.drain()
                if theirs is not None:
                    await theirs()

            bound.arguments["grace_period_s"] = 0.0
            bound.arguments["drain_callback"] = drain
            return install_signals(*bound.args, **bound.kwargs)

        return install_signal_handlers

    async def registered(arguments: dict[str, Any]) -> None:
        lifecycle.registered(arguments["engine_client"], arguments["generate_endpoint"])

    _wrap(main, "install_signal_handlers", make)
    hook_registration(main, "drain", Step(before=registered))
    return lifecycle


def install_warmup_before_registration(
    opts: WarmupOptions | None = None, dm: ModuleType | None = None
) -> Callable[..., Awaitable[Any]]:
    """`warm-up`: the next `dynamo.vllm` worker warms its engine up before it registers.

    Returns the registration wrapper (Dynamo's own function is its `__wrapped__`).
    """
    options = opts or WarmupOptions()
    done: set[int] = set()  # one warm-up per engine (a worker may register several model cards)

    async def warm(arguments: dict[str, Any]) -> None:
        engine_client = arguments["engine_client"]
        if id(engine_client) not in done:
            done.add(id(engine_client))
            await warm_up_before_registration(engine_client, arguments["vllm_config"], options)

    return hook_registration(_main_module(dm), "warm-up", Step(before=warm))


def install_role_standby(dm: ModuleType | None = None) -> None:
    """`standby`: the next `dynamo.vllm` prefill or decode worker stands by for the other role."""
    from maru_dynamo.components.disagg.hook import start_role_guard

    main = _main_module(dm)
    check_seams(main, ("standby",))
    runtimes: list[Any] = []
    started: set[int] = set()

    def make(create_runtime: Any) -> Callable[..., Any]:
        def create_runtime_kept(*args: Any, **kwargs: Any) -> Any:
            out = create_runtime(*args, **kwargs)
            runtimes.append(out[0] if isinstance(out, tuple) else out)
            return out

        return create_runtime_kept

    def after(arguments: dict[str, Any], register: Callable[..., Awaitable[Any]]) -> None:
        if runtimes:
            start_role_guard(runtimes[-1], arguments, register, main.shutdown_endpoints, started)

    _wrap(main, "create_runtime", make)
    hook_registration(main, "standby", Step(after=after))


@dataclasses.dataclass(frozen=True)
class WorkerHooks:
    """Which hooks a worker wants, with what each needs (None / False: not that hook)."""

    relay: dict[str, Any] | None = None  # `relay_options` keywords
    lifecycle: WorkerLifecycle | None = None
    warmup: WarmupOptions | None = None
    standby: bool = False

    def names(self) -> tuple[str, ...]:
        wanted = {
            "pool-events": self.relay is not None,
            "drain": self.lifecycle is not None,
            "warm-up": self.warmup is not None,
            "standby": self.standby,
        }
        return tuple(name for name in ORDER if wanted[name])


def install_worker_hooks(hooks: WorkerHooks, dm: ModuleType | None = None) -> None:
    """Check the installed Dynamo for every hook in `hooks`, then install them in `ORDER`.

    Raises `DynamoSeamError` (one line) before anything is replaced when a seam moved.
    """
    check_dynamo_version()
    main = _main_module(dm)
    check_seams(main, hooks.names())
    for name in hooks.names():
        if name == "pool-events":
            install_pool_event_relay(dm=main, **(hooks.relay or {}))
        elif name == "drain":
            assert hooks.lifecycle is not None
            install_worker_lifecycle(hooks.lifecycle, main)
        elif name == "warm-up":
            install_warmup_before_registration(hooks.warmup, main)
        else:
            install_role_standby(main)
