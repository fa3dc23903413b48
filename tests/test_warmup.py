"""The warm-up a Maru worker runs before it registers: its requests and its hook into dynamo.vllm.

The warm-up itself runs on a real engine in tests/e2e/test_worker_warmup_e2e.py.
"""

from __future__ import annotations

import pytest

from maru_dynamo.components.dynamo_hooks import install_warmup_before_registration
from maru_vllm.launch.warmup import WarmupOptions, warmup_phases


@pytest.fixture
def dynamo_main():  # type: ignore[no-untyped-def]
    """dynamo.vllm.main as the worker imports it (after the text-only stand-ins); its hook restored after."""
    from maru_dynamo.components.text_only import install_text_only_stand_ins

    install_text_only_stand_ins()
    import dynamo.vllm.main as dm

    found = dm.register_vllm_model
    # dynamo's own function, whatever hook an earlier test in this process left installed
    dm.register_vllm_model = getattr(found, "__wrapped__", found)
    yield dm
    dm.register_vllm_model = found


def sampled(sampling: dict) -> bool:
    """Reaches vLLM's lazily compiled random sampler: temperature > 0 and no per-request seed."""
    return sampling.get("temperature", 1.0) > 0 and "seed" not in sampling


def test_a_round_compiles_the_sampler_for_one_and_for_several_requests() -> None:
    phases = warmup_phases(WarmupOptions(concurrency=4), max_model_len=4096)
    alone, together = phases[0], phases[1]
    assert len(alone.requests) == 1 and sampled(alone.requests[0].sampling)
    assert len(together.requests) >= 2 and all(sampled(r.sampling) for r in together.requests)
    assert all(r.max_tokens >= 2 for r in together.requests)  # decode steps with a batch of several
    kinds = {tuple(sorted(r.sampling)) for p in phases for r in p.requests}
    assert ("logprobs", "temperature") in kinds and ("temperature", "top_k", "top_p") in kinds


@pytest.mark.parametrize(("chunk", "max_model_len"), [(256, 4096), (128, 4096), (256, 64)])
def test_prompts_are_shorter_than_a_chunk_and_fit_the_model(chunk: int, max_model_len: int) -> None:
    phases = warmup_phases(WarmupOptions(max_prompt_tokens=chunk - 1), max_model_len=max_model_len)
    for r in (r for p in phases for r in p.requests):
        assert 0 < r.prompt_tokens < chunk  # never a whole pool chunk: nothing is stored
        assert r.prompt_tokens + r.max_tokens <= max_model_len


def test_the_hook_wraps_dynamos_registration_once(dynamo_main) -> None:  # type: ignore[no-untyped-def]
    original = dynamo_main.register_vllm_model
    first = install_warmup_before_registration()
    assert dynamo_main.register_vllm_model is first and first.__wrapped__ is original  # type: ignore[attr-defined]
    second = install_warmup_before_registration()
    assert second.__wrapped__ is original  # type: ignore[attr-defined]  # not a wrapper of a wrapper


def test_the_hook_refuses_a_registration_function_of_another_shape(dynamo_main) -> None:  # type: ignore[no-untyped-def]
    async def other(model_input, generate_endpoint):  # type: ignore[no-untyped-def]
        return None

    dynamo_main.register_vllm_model = other
    with pytest.raises(RuntimeError, match=r"register_vllm_model is not what ai-dynamo 1.6.1 has"):
        install_warmup_before_registration()


def test_the_worker_option_turns_it_off_and_is_not_passed_to_dynamo() -> None:
    from maru_dynamo.components.maru_worker import build

    ours, rest = build(["--maru-pool-address", "unix:///tmp/p.sock", "--model", "m"])
    assert ours.maru_warmup is True
    ours, rest = build(["--maru-pool-address", "unix:///tmp/p.sock", "--no-maru-warmup", "--model", "m"])
    assert ours.maru_warmup is False and not any("warmup" in a for a in rest)


def test_the_warm_up_and_the_connector_take_one_chunk_size() -> None:
    """The warm-up stays under the chunk the connector really uses: the user's own
    `--kv-transfer-config` counts over `--maru-chunk-tokens`, and every default is one value."""
    import json

    from maru_dynamo.components.maru_worker import build
    from maru_dynamo.graphs.spec import PoolSpec
    from maru_vllm.connector.config import KEYS
    from maru_vllm.pool.chunk_codec import DEFAULT_CHUNK_TOKENS

    ours, rest = build(["--maru-pool-address", "unix:///tmp/p.sock", "--model", "m"])
    given = json.loads(rest[rest.index("--kv-transfer-config") + 1])
    assert given["kv_connector_extra_config"]["maru_kv_chunk_tokens"] == ours.maru_chunk_tokens == DEFAULT_CHUNK_TOKENS
    assert ours.warmup() == WarmupOptions() == WarmupOptions(max_prompt_tokens=DEFAULT_CHUNK_TOKENS - 1)
    assert KEYS["maru_kv_chunk_tokens"][0] == PoolSpec().chunk_tokens == DEFAULT_CHUNK_TOKENS

    theirs = {
        "kv_connector": "MaruKVConnector",
        "kv_connector_module_path": "maru_vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"maru_pool_address": "unix:///tmp/p.sock", "maru_kv_chunk_tokens": 128},
    }
    args = ["--maru-pool-address", "unix:///tmp/p.sock", "--maru-chunk-tokens", "512"]
    ours, rest = build([*args, "--kv-transfer-config", json.dumps(theirs)])
    assert ours.maru_chunk_tokens == 128 and ours.warmup() == WarmupOptions(max_prompt_tokens=127)
    assert (
        rest.count("--kv-transfer-config") == 1 and json.loads(rest[rest.index("--kv-transfer-config") + 1]) == theirs
    )
    del theirs["kv_connector_extra_config"]["maru_kv_chunk_tokens"]  # the connector's default then
    ours, _ = build([*args, f"--kv-transfer-config={json.dumps(theirs)}"])
    assert ours.maru_chunk_tokens == DEFAULT_CHUNK_TOKENS
    ours, _ = build([*args, "--kv-transfer-config", json.dumps({"kv_connector": "OtherConnector"})])
    assert ours.maru_chunk_tokens == 512  # not the Maru connector: the worker's own option
