"""Every engine start says, in one line, what it runs on and which copy path it took."""

from __future__ import annotations

import logging

import pytest

from maru_vllm.connector import startup


def test_a_supported_stack_is_one_info_line_naming_every_release_and_the_path(monkeypatch) -> None:
    monkeypatch.setattr(
        startup, "stack_versions", lambda: {"vLLM": "0.34.0", "LMCache": None, "torch": "2.13.0", "Dynamo": None}
    )
    level, line = startup.stack_line("torch path: CPU engine; object format pages")
    assert level == logging.INFO
    assert line == (
        "MaruKVConnector on vLLM 0.34.0, LMCache not installed, torch 2.13.0, Dynamo not installed; "
        "torch path: CPU engine; object format pages"
    )
    assert "\n" not in line


@pytest.mark.parametrize("vllm", ["0.35.0", "0.30.0"])
def test_an_unsupported_vllm_is_named_in_the_same_line_at_warning(monkeypatch, vllm: str) -> None:
    monkeypatch.setattr(
        startup, "stack_versions", lambda: {"vLLM": vllm, "LMCache": None, "torch": "2.13.0", "Dynamo": None}
    )
    level, line = startup.stack_line("torch path: CPU engine; object format pages")
    assert level == logging.WARNING
    assert f"vLLM {vllm} is not a supported release (0.31.0 - 0.34.0)" in line
    assert "\n" not in line


def test_the_copy_path_of_a_cpu_engine_says_why() -> None:
    assert startup.copy_path("cpu", True, "pages") == "torch path: CPU engine; object format pages"
