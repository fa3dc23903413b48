"""The worker's pool-events hook: Dynamo version pin, the seam it patches, and the maru_worker CLI."""

from __future__ import annotations

import importlib.metadata
import json
import types
from typing import ClassVar

import pytest

from maru_dynamo.components import dynamo_hooks as dynamo_hook
from maru_vllm.events import publisher_relay
from maru_vllm.versions import DYNAMO


def test_installed_dynamo_is_the_pinned_version() -> None:
    assert importlib.metadata.version("ai-dynamo") == "1.6.1"
    assert importlib.metadata.version("ai-dynamo-runtime") == "1.6.1"
    assert dynamo_hook.check_dynamo_version() == DYNAMO.releases[-1] == "1.6.1"


def test_other_dynamo_versions_are_refused_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "1.7.0" if d == "ai-dynamo" else real(d))
    with pytest.raises(dynamo_hook.DynamoVersionError, match=r"ai-dynamo==1\.6\.1.*installed: ai-dynamo==1\.7\.0"):
        dynamo_hook.check_dynamo_version()
    with pytest.raises(dynamo_hook.DynamoVersionError):
        dynamo_hook.install_pool_event_relay(pool_name="p")


def test_hash_seed_check() -> None:
    from maru_vllm.launch.hash_seed import check_hash_seed

    check_hash_seed({})
    check_hash_seed({"PYTHONHASHSEED": "0"})
    with pytest.raises(RuntimeError, match=r"PYTHONHASHSEED='1'.*PYTHONHASHSEED=0"):
        check_hash_seed({"PYTHONHASHSEED": "1"})


def test_seam_exists_in_dynamo_1_6_1() -> None:
    """What the hook relies on: main() hands the module-level function to WorkerFactory, and that
    function constructs the module-level KvEventPublisher with zmq_endpoint/dp_rank keywords."""
    import inspect

    pytest.importorskip("maru_dynamo.components.text_only").install_text_only_stand_ins()
    import dynamo.vllm.main as dm

    assert list(inspect.signature(dm.setup_kv_event_publisher).parameters)[:3] == list(
        dynamo_hook.declared_params("setup_kv_event_publisher") or ()
    )
    src = inspect.getsource(dm)
    assert "setup_kv_event_publisher_fn=setup_kv_event_publisher" in src
    body = inspect.getsource(dm.setup_kv_event_publisher)
    assert "KvEventPublisher(" in body and "zmq_endpoint=zmq_endpoint" in body and "dp_rank=dp_rank" in body


class FakePublisher:
    made: ClassVar[list[dict]] = []

    def __init__(self, **kwargs):
        FakePublisher.made.append(kwargs)


def _fake_config(endpoint: str, model: str = "/m/tiny"):
    kv = types.SimpleNamespace(endpoint=endpoint, enable_kv_cache_events=True)
    config = types.SimpleNamespace(engine_args=types.SimpleNamespace(enable_prefix_caching=True, kv_events_config=kv))
    vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=model), cache_config=types.SimpleNamespace(block_size=16)
    )
    return config, vllm_config


def test_install_repoints_dynamos_publisher_at_the_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("dynamo.vllm.main")

    def setup_kv_event_publisher(
        config, generate_endpoint, vllm_config, consolidator_enabled=False, consolidator_port=5558
    ):
        ep = config.engine_args.kv_events_config.endpoint.replace("*", "127.0.0.1")
        return [
            fake.KvEventPublisher(
                endpoint=generate_endpoint, kv_block_size=16, zmq_endpoint=ep, zmq_topic="", dp_rank=0
            )
        ]

    fake.setup_kv_event_publisher = setup_kv_event_publisher
    fake.KvEventPublisher = FakePublisher
    monkeypatch.setitem(__import__("sys").modules, "dynamo.vllm.main", fake)
    import dynamo.vllm

    monkeypatch.setattr(dynamo.vllm, "main", fake, raising=False)
    FakePublisher.made.clear()
    inst = dynamo_hook.install_pool_event_relay(pool_name="p", nats_url="nats://127.0.0.1:1", probe_interval_s=60)
    try:
        assert fake.setup_kv_event_publisher is not setup_kv_event_publisher
        config, vllm_config = _fake_config("tcp://*:5999")
        pubs = fake.setup_kv_event_publisher(config, "EP", vllm_config)
        assert len(pubs) == 1 and fake.KvEventPublisher is FakePublisher  # swapped back after the call
        [made] = FakePublisher.made
        [relay] = inst.relays
        assert relay.upstream == "tcp://127.0.0.1:5999" and made["zmq_endpoint"] == relay.endpoint
        assert made["zmq_endpoint"].startswith("tcp://127.0.0.1:") and made["endpoint"] == "EP"
        assert relay.view.block_size == 16 and relay.view.namespaces.accepts("kv:tiny:abc")
        assert not relay.view.namespaces.accepts("kv:other:abc") and relay.medium == "CPU_PINNED"
        # installing again replaces the options, and wraps Dynamo's original, not our wrapper
        inst2 = dynamo_hook.install_pool_event_relay(
            pool_name="q", nats_url="nats://127.0.0.1:1", namespace="kv:tiny:exact", medium="CPU"
        )
        assert inst2.original is setup_kv_event_publisher
        fake.setup_kv_event_publisher(config, "EP", vllm_config)
        [relay2] = inst2.relays
        assert relay2.view.namespaces.single_namespace == "kv:tiny:exact" and relay2.medium == "CPU"
        inst2.uninstall()
        assert fake.setup_kv_event_publisher is setup_kv_event_publisher
    finally:
        inst.uninstall()
        dynamo_hook._installed = None


def test_relay_failure_falls_back_to_vllms_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a, **k):
        raise OSError("no relay today")

    monkeypatch.setattr(publisher_relay, "_start_relay", broken)
    FakePublisher.made.clear()
    make = publisher_relay.publisher_factory(FakePublisher, None, None)  # type: ignore[arg-type]
    make(endpoint="EP", zmq_endpoint="tcp://127.0.0.1:5", dp_rank=0)
    assert FakePublisher.made == [{"endpoint": "EP", "zmq_endpoint": "tcp://127.0.0.1:5", "dp_rank": 0}]


def test_maru_worker_fills_in_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    from maru_dynamo.components import maru_worker

    ours, rest = maru_worker.build(
        [
            "--model",
            "m",
            "--maru-pool-address",
            "unix:///tmp/p.sock",
            "--maru-pool-name",
            "kv",
            "--disaggregation-mode",
            "prefill",
        ]
    )
    assert ours.maru_pool_name == "kv" and ours.maru_event_medium == "CPU_PINNED" and ours.maru_chunk_tokens == 256
    assert ours.maru_standby and maru_worker.disaggregation_mode(rest) == "prefill"  # stands in for decode
    assert not maru_worker.build(["--maru-pool-address", "a", "--no-maru-standby"])[0].maru_standby
    assert rest[:4] == ["--model", "m", "--disaggregation-mode", "prefill"]
    kvt = json.loads(rest[rest.index("--kv-transfer-config") + 1])
    # Every role loads and stores (a worker may stand in for the other role); prefill stores inline.
    assert kvt["kv_connector"] == "MaruKVConnector" and kvt["kv_role"] == "kv_both"
    assert kvt["kv_connector_extra_config"] == {
        "maru_pool_address": "unix:///tmp/p.sock",
        "maru_kv_chunk_tokens": 256,
        "maru_store_inline": True,
    }
    kve = json.loads(rest[rest.index("--kv-events-config") + 1])
    assert kve["enable_kv_cache_events"] and kve["endpoint"].startswith("tcp://*:")

    _, rest = maru_worker.build(
        [
            "--maru-pool-address",
            "a",
            "--maru-pool-name",
            "kv",
            "--disaggregation-mode=decode",
            "--maru-chunk-tokens",
            "512",
        ]
    )
    kvt = json.loads(rest[rest.index("--kv-transfer-config") + 1])
    assert kvt["kv_role"] == "kv_both" and kvt["kv_connector_extra_config"]["maru_kv_chunk_tokens"] == 512
    assert "maru_store_inline" not in kvt["kv_connector_extra_config"]  # decode stores write-behind
    monkeypatch.delenv("DYN_VLLM_DISAGGREGATION_MODE", raising=False)
    _, rest = maru_worker.build(
        [
            "--maru-pool-address",
            "a",
            "--maru-pool-name",
            "kv",
            "--kv-events-config",
            "{}",
            "--kv-transfer-config",
            '{"x": 1}',
        ]
    )
    assert rest == ["--kv-events-config", "{}", "--kv-transfer-config", '{"x": 1}']
    _, rest = maru_worker.build(["--maru-pool-address", "a", "--maru-pool-name", "kv"])
    assert json.loads(rest[rest.index("--kv-transfer-config") + 1])["kv_role"] == "kv_both"


def test_maru_worker_refuses_a_foreign_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    from maru_dynamo.components import maru_worker

    monkeypatch.setenv("PYTHONHASHSEED", "42")
    with pytest.raises(SystemExit, match="PYTHONHASHSEED='42'"):
        maru_worker.main(["--maru-pool-address", "a", "--maru-pool-name", "kv"])
