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
