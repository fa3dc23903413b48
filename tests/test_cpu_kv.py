"""A worker on a CPU install picks a KV space itself when the user sized none."""

from __future__ import annotations

import pytest

from maru_vllm.launch import cpu_kv
from maru_vllm.launch.stack import cpu_engines

GIB = 1 << 30


def test_a_size_the_user_gave_is_kept() -> None:
    assert cpu_kv.pick_kv_space_gib([], {"VLLM_CPU_KVCACHE_SPACE": "2"}, 16 * GIB) is None
    assert cpu_kv.pick_kv_space_gib(["--kv-cache-memory-bytes", "1000"], {}, 16 * GIB) is None
    assert cpu_kv.pick_kv_space_gib(["--gpu-memory-utilization=0.3"], {}, 16 * GIB) is None


def test_a_tenth_of_available_memory_between_1_and_8_gib() -> None:
    assert cpu_kv.pick_kv_space_gib([], {}, 16 * GIB) == 1  # this machine, with other engines running
    assert cpu_kv.pick_kv_space_gib(["--model", "m"], {"VLLM_CPU_KVCACHE_SPACE": ""}, 40 * GIB) == 4
    assert cpu_kv.pick_kv_space_gib([], {}, 500 * GIB) == 8


def test_too_little_memory_stops_with_one_line_saying_what_to_set() -> None:
    with pytest.raises(cpu_kv.NotEnoughMemory) as exc:
        cpu_kv.pick_kv_space_gib([], {}, 2 * GIB)
    msg = str(exc.value)
    assert "\n" not in msg and "2.0 GiB" in msg and "VLLM_CPU_KVCACHE_SPACE=" in msg


@pytest.mark.skipif(not cpu_engines(), reason="a CPU install only")
def test_the_worker_sets_the_environment_on_a_cpu_install() -> None:
    env: dict[str, str] = {}
    gib = cpu_kv.apply_default_kv_space(["--model", "m"], env)
    assert gib is not None and env == {"VLLM_CPU_KVCACHE_SPACE": str(gib)}
    env = {"VLLM_CPU_KVCACHE_SPACE": "3"}
    assert cpu_kv.apply_default_kv_space([], env) is None and env == {"VLLM_CPU_KVCACHE_SPACE": "3"}
