"""The worker's hooks into `dynamo.vllm`: one module holds them, in one declared order, and a
Dynamo of another release or another shape is refused at start-up in one line.

The stand-in `dynamo.vllm.main` modules here are named as such: plain modules with the
attributes the hooks wrap, shaped as ai-dynamo 1.6.1 has them (or not, on purpose).
"""

from __future__ import annotations

import ast
import asyncio
import types
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from maru_dynamo.components import dynamo_hooks
from maru_dynamo.components.dynamo_hooks import DynamoSeamError, WorkerHooks, install_worker_hooks
from maru_vllm.launch.lifecycle import WorkerLifecycle
from maru_vllm.launch.warmup import WarmupOptions

ROOT = Path(__file__).resolve().parents[1]


def _imports_of(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_one_module_imports_dynamo_vllm_main() -> None:
    importers = sorted(
        str(p.relative_to(ROOT))
        for folder in ("maru_vllm", "components", "graphs")
        for p in (ROOT / folder).rglob("*.py")
        if "dynamo.vllm.main" in _imports_of(p)
    )
    assert importers == ["components/dynamo_hooks.py"]


def stand_in_main(**replace: Any) -> types.ModuleType:
    """A stand-in `dynamo.vllm.main` with every seam the hooks wrap, in ai-dynamo 1.6.1's shape."""
    dm = types.ModuleType("stand-in dynamo.vllm.main")
    calls: list[str] = []

    def setup_kv_event_publisher(config: Any, generate_endpoint: Any, vllm_config: Any) -> list[Any]:
        return []

    async def register_vllm_model(
        model_input: Any,
        model_type: Any,
        generate_endpoint: Any,
        config: Any,
        engine_client: Any,
        vllm_config: Any,
        worker_type: Any = None,
    ) -> None:
        calls.append("dynamo registers")

    def install_signal_handlers(
        loop: Any, runtime: Any, endpoints: Any, shutdown_event: Any, grace_period_s: float = 5, drain_callback=None
    ) -> None:
        calls.append(f"signal handlers, grace {grace_period_s}")

    def create_runtime(*args: Any) -> tuple[str, str]:
        return ("runtime", "loop")

    dm.setup_kv_event_publisher = setup_kv_event_publisher  # type: ignore[attr-defined]
    dm.KvEventPublisher = type("KvEventPublisher", (), {})  # type: ignore[attr-defined]
    dm.register_vllm_model = register_vllm_model  # type: ignore[attr-defined]
    dm.install_signal_handlers = install_signal_handlers  # type: ignore[attr-defined]
    dm.create_runtime = create_runtime  # type: ignore[attr-defined]
    dm.shutdown_endpoints = []  # type: ignore[attr-defined]
    dm.calls = calls  # type: ignore[attr-defined]
    for name, value in replace.items():
        setattr(dm, name, value)
    return dm


def every_hook() -> WorkerHooks:
    return WorkerHooks(
        relay={"pool_name": "p", "nats_url": "nats://127.0.0.1:1"},
        lifecycle=WorkerLifecycle(grace_s=1),
        warmup=WarmupOptions(),
        standby=True,
    )


def test_the_hooks_run_in_their_declared_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from maru_dynamo.components.disagg import hook as disagg_hook

    dm = stand_in_main()
    calls = dm.calls

    async def warm(engine_client: Any, vllm_config: Any, opts: WarmupOptions) -> None:
        calls.append("warm-up")

    class Lifecycle(WorkerLifecycle):
        def registered(self, engine_client: Any, generate_endpoint: Any) -> None:
            calls.append("drain: engine recorded")

    monkeypatch.setattr(dynamo_hooks, "warm_up_before_registration", warm)
    monkeypatch.setattr(disagg_hook, "start_role_guard", lambda runtime, *a: calls.append(f"standby on {runtime}"))
    hooks = WorkerHooks(relay=None, lifecycle=Lifecycle(grace_s=1), warmup=WarmupOptions(), standby=True)
    assert hooks.names() == ("drain", "warm-up", "standby") and dynamo_hooks.ORDER[0] == "pool-events"
    install_worker_hooks(hooks, dm)
    install_worker_hooks(hooks, dm)  # again: each hook's step replaced, never a wrapper of a wrapper
    dm.create_runtime()
    dm.install_signal_handlers("loop", "runtime", [], "event")
    asyncio.run(dm.register_vllm_model("in", "type", "endpoint", "config", "engine", "vllm config"))
    assert calls == [
        "signal handlers, grace 0.0",  # the drain replaces Dynamo's fixed sleep
        "drain: engine recorded",
        "warm-up",
        "dynamo registers",
        "standby on runtime",
    ]
    assert list(dm.register_vllm_model._maru_steps) == ["drain", "warm-up", "standby"]


def test_a_dynamo_of_another_shape_is_refused_in_one_line_before_anything_is_replaced() -> None:
    async def moved(model_input: Any, generate_endpoint: Any) -> None:  # a registration of another shape
        return None

    dm = stand_in_main(register_vllm_model=moved)
    before = dict(vars(dm))
    with pytest.raises(DynamoSeamError) as err:
        install_worker_hooks(every_hook(), dm)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("dynamo.vllm.main.register_vllm_model is not what ai-dynamo 1.6.1 has")
    assert "parameters ['model_input', 'generate_endpoint']" in message and "the drain hook cannot go in" in message
    assert dict(vars(dm)) == before  # nothing replaced: the pool-events hook comes first but was not installed

    dm = stand_in_main(shutdown_endpoints=None)
    with pytest.raises(DynamoSeamError, match=r"^dynamo\.vllm\.main\.shutdown_endpoints is not .*missing.*standby"):
        install_worker_hooks(every_hook(), dm)
    dm = stand_in_main()
    del dm.setup_kv_event_publisher
    with pytest.raises(DynamoSeamError, match=r"setup_kv_event_publisher is not .* the pool-events hook cannot go in"):
        install_worker_hooks(every_hook(), dm)


def test_an_unknown_dynamo_release_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: "1.7.0" if d.startswith("ai-dynamo") else real(d))
    dm = stand_in_main()
    before = dict(vars(dm))
    with pytest.raises(dynamo_hooks.DynamoVersionError) as err:
        install_worker_hooks(every_hook(), dm)
    assert "\n" not in str(err.value) and "installed: ai-dynamo==1.7.0, ai-dynamo-runtime==1.7.0" in str(err.value)
    assert dict(vars(dm)) == before


def test_the_wrapped_parameters_are_the_declared_contracts() -> None:
    """The start-up check and the compatibility matrix read the same declarations."""
    assert dynamo_hooks.declared_params("register_vllm_model") == (
        "model_input",
        "model_type",
        "generate_endpoint",
        "config",
        "engine_client",
        "vllm_config",
    )
    assert dynamo_hooks.declared_params("install_signal_handlers") == (
        "loop",
        "runtime",
        "endpoints",
        "shutdown_event",
        "grace_period_s",
        "drain_callback",
    )
    assert dynamo_hooks.declared_params("setup_kv_event_publisher") == ("config", "generate_endpoint", "vllm_config")
