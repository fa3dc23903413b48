"""vLLM refuses sleep mode with MaruKVConnector, on the releases that let a connector say so.

From vLLM 0.33 on, `KVConnectorBase_V1.supports_sleep_mode()` says whether a connector follows the
KV cache remap of a sleep (the default is yes); `VllmConfig` refuses `enable_sleep_mode` with a
connector that says no. MaruKVConnector keeps its registered staging region for the engine's life,
so it says no, and an engine started with `--enable-sleep-mode` stops at its configuration instead
of corrupting what it loads later. The scheduler level of `make compat` runs this on every
release.

Sleep mode itself is CUDA-only (`ModelConfig` refuses it on a CPU platform), so the model
configuration is built without it and sleep mode is turned on before `VllmConfig` validates the
whole engine configuration, which is where the connector's answer is asked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm
from vllm.config import ModelConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from maru_vllm.connector import MaruKVConnector
from tests.connector.sched_harness import make_vllm_config

HAS_API = hasattr(KVConnectorBase_V1, "supports_sleep_mode")
needs_api = pytest.mark.skipif(
    not HAS_API,
    reason=f"vLLM {vllm.__version__} never asks a connector about sleep mode "
    "(no KVConnectorBase_V1.supports_sleep_mode)",
)


@needs_api
def test_the_connector_says_it_does_not_follow_sleep_mode(tiny_model: Path) -> None:
    config = make_vllm_config(tiny_model, "unix:///nonexistent/maru.sock")
    assert MaruKVConnector.supports_sleep_mode(config.kv_transfer_config) is False


@needs_api
def test_vllm_refuses_sleep_mode_with_the_connector(tiny_model: Path) -> None:
    model_config = ModelConfig(model=str(tiny_model), max_model_len=4096, dtype="bfloat16", seed=0)
    model_config.enable_sleep_mode = True
    with pytest.raises(ValueError) as excinfo:
        make_vllm_config(tiny_model, "unix:///nonexistent/maru.sock", model_config=model_config)
    assert "MaruKVConnector does not support sleep mode" in str(excinfo.value)


def test_without_sleep_mode_the_same_configuration_is_accepted(tiny_model: Path) -> None:
    config = make_vllm_config(tiny_model, "unix:///nonexistent/maru.sock")
    assert config.kv_transfer_config is not None
    assert config.kv_transfer_config.kv_connector == "MaruKVConnector"
    assert not config.model_config.enable_sleep_mode
