"""MaruKVConnector in Dynamo's PD connector-protocol registry (pinned to ai-dynamo 1.6.1).

These tests fail when Dynamo's registry, or how its prefill/decode handlers use it, changes:
then `maru_dynamo.components.dynamo_pd` has to be revisited before the pin is moved.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
import types

import pytest

from maru_dynamo.components import dynamo_pd

PINNED = "1.6.1"


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch):
    """Dynamo's protocols module with a private copy of its registry (restored afterwards)."""
    mod = importlib.import_module("dynamo.vllm.kv_connector_protocols")
    monkeypatch.setattr(
        mod,
        "KV_CONNECTOR_PROTOCOLS",
        {k: v for k, v in mod.KV_CONNECTOR_PROTOCOLS.items() if k != dynamo_pd.CONNECTOR_NAME},
    )
    return mod


def _vllm_config(kv_connector: str, **extra: object):
    kv = types.SimpleNamespace(
        kv_connector=kv_connector, kv_role="kv_producer", engine_id="e0", kv_connector_extra_config={}, **extra
    )
    return types.SimpleNamespace(kv_transfer_config=kv)


def test_installed_dynamo_is_the_pinned_version() -> None:
    assert importlib.metadata.version("ai-dynamo") == PINNED
    assert importlib.metadata.version("ai-dynamo-runtime") == PINNED


def test_registry_api_is_the_one_we_wrote_against(registry) -> None:
    dynamo_pd.check_registry_api(registry)  # raises on any drift
    base = registry.KvConnectorProtocol
    assert set(base.__abstractmethods__) == {"prefill_request_kv_transfer_params", "decode_request_kv_transfer_params"}
    assert list(inspect.signature(base.decode_request_kv_transfer_params).parameters) == ["self", "prefill_response"]
    assert base.produces_kv_transfer_params is True
    assert isinstance(registry.KV_CONNECTOR_PROTOCOLS, dict)
    assert list(inspect.signature(registry.make_kv_connector_protocol).parameters) == ["vllm_config"]
    # A cache-mediated entry of Dynamo's own, the shape ours follows.
    assert registry.KV_CONNECTOR_PROTOCOLS["LMCacheMPConnector"].produces_kv_transfer_params is False


def test_registry_drift_is_reported_clearly() -> None:
    class Base:
        produces_kv_transfer_params = True

        def __init__(self, vllm_config, engine_id):  # a changed constructor
            pass

    fake = types.SimpleNamespace(KvConnectorProtocol=Base, KV_CONNECTOR_PROTOCOLS=[])
    with pytest.raises(dynamo_pd.DynamoPdApiError) as err:
        dynamo_pd.check_registry_api(fake)
    msg = str(err.value)
    assert "abstract methods" in msg and "__init__" in msg and "KV_CONNECTOR_PROTOCOLS" in msg
    assert "make_kv_connector_protocol" in msg and "1.6.1" in msg


def test_unregistered_maru_connector_is_refused_by_dynamo(registry) -> None:
    """Why the registration exists: Dynamo's PD path rejects unknown connectors per request."""
    with pytest.raises(ValueError, match="Unsupported kv_connector='MaruKVConnector' for PD"):
        registry.make_kv_connector_protocol(_vllm_config("MaruKVConnector"))


def test_registered_maru_is_cache_mediated(registry) -> None:
    cls = dynamo_pd.register_maru_pd_protocol()
    assert registry.KV_CONNECTOR_PROTOCOLS["MaruKVConnector"] is cls
    assert dynamo_pd.register_maru_pd_protocol() is cls  # idempotent
    assert list(registry.KV_CONNECTOR_PROTOCOLS).count("MaruKVConnector") == 1

    proto = registry.make_kv_connector_protocol(_vllm_config("MaruKVConnector"))
    assert isinstance(proto, cls) and isinstance(proto, registry.KvConnectorProtocol)
    assert cls.produces_kv_transfer_params is False
    assert proto.prefill_request_kv_transfer_params() == {}
    # Decode gets an empty (not None) params dict whatever the prefill engine returned.
    for engine_params in (None, {"do_remote_decode": True, "remote_block_ids": [1, 2]}):
        response = types.SimpleNamespace(kv_transfer_params=engine_params, prompt_token_ids=[1, 2, 3])
        assert proto.decode_request_kv_transfer_params(response) == {}
    # Fresh dicts each call: the handler may mutate what it gets.
    a, b = proto.prefill_request_kv_transfer_params(), proto.prefill_request_kv_transfer_params()
    assert a is not b


def test_wrapper_connectors_prefer_a_transport_child_over_maru(registry) -> None:
    cls = dynamo_pd.register_maru_pd_protocol()
    both = _vllm_config("MultiConnector")
    both.kv_transfer_config.kv_connector_extra_config = {
        "connectors": [{"kv_connector": "MaruKVConnector"}, {"kv_connector": "NixlConnector"}]
    }
    assert isinstance(registry.make_kv_connector_protocol(both), registry.NixlConnectorProtocol)
    alone = _vllm_config("MultiConnector")
    alone.kv_transfer_config.kv_connector_extra_config = {"connectors": [{"kv_connector": "MaruKVConnector"}]}
    assert isinstance(registry.make_kv_connector_protocol(alone), cls)


def test_handlers_resolve_through_the_registry_and_need_an_envelope() -> None:
    """The prefill handler resolves the protocol via this module's registry per request; decode
    params of `{}` still make a `disaggregated_params` envelope (None would make none, which the
    frontend rejects), and decode puts what it gets into the engine request's kv_transfer_params."""
    pytest.importorskip("maru_dynamo.components.text_only").install_text_only_stand_ins()
    handlers = importlib.import_module("dynamo.vllm.handlers")
    protocols = sys.modules["dynamo.vllm.kv_connector_protocols"]
    assert handlers.make_kv_connector_protocol is protocols.make_kv_connector_protocol
    assert protocols.make_kv_connector_protocol.__globals__ is vars(protocols)

    prefill = handlers.PrefillWorkerHandler
    src = inspect.getsource(prefill)
    assert "make_kv_connector_protocol(self.engine_client.vllm_config)" in src
    assert "prefill_request_kv_transfer_params()" in src
    assert "decode_request_kv_transfer_params(res)" in src
    build = prefill._build_disaggregated_params
    assert build(None, {}) == {"kv_transfer_params": {}}
    assert build(None, None) is None

    decode_src = inspect.getsource(handlers.DecodeWorkerHandler._generate_token_mode)
    assert 'prefill_result.get("disaggregated_params")' in decode_src
    assert 'disaggregated_params.get("kv_transfer_params")' in decode_src
    assert "_update_kv_transfer_params(sampling_params, kv_params)" in decode_src

    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1)
    handlers._update_kv_transfer_params(sp, {})
    assert sp.extra_args == {"kv_transfer_params": {}}


def test_maru_worker_registers_before_running_dynamo(monkeypatch: pytest.MonkeyPatch, registry) -> None:
    from maru_dynamo.components import dynamo_hooks, maru_worker

    seen = {}
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.setattr(dynamo_hooks, "install_pool_event_relay", lambda **kw: None)
    monkeypatch.setattr(
        maru_worker,
        "run_module_then_exit",
        lambda name, argv: seen.update(name=name, registered=dict(registry.KV_CONNECTOR_PROTOCOLS)),
    )
    monkeypatch.setattr(sys, "argv", ["maru_worker"])
    maru_worker.main(
        [
            "--maru-pool-address",
            "unix:///tmp/x.sock",
            "--maru-pool-name",
            "kv",
            "--model",
            "m",
            "--disaggregation-mode",
            "prefill",
        ]
    )
    assert seen["name"] == "dynamo.vllm"
    assert seen["registered"]["MaruKVConnector"] is dynamo_pd.maru_pd_protocol_class()
