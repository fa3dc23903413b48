"""Tests for maru_vllm.connector.kernels: fake module shapes and broken installs, and the installed 0.5.6.

Each supported release's real sources are exercised by test_lmcache_releases.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from maru_vllm.connector import kernels as kmod
from maru_vllm.connector.kernels import (
    REQUIRED_KERNELS,
    SOURCE_GEN_A,
    SOURCE_GEN_B,
    SOURCE_GEN_C,
    kernels_usable_for,
    probe_lmcache_kernels,
    resolve_fused_load,
    resolve_lmcache_kernels,
)

FAKES = Path(__file__).parent / "fakes"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_log_once(monkeypatch):
    """Each test sees the process as if nothing had been logged yet."""
    monkeypatch.setattr(kmod, "_logged", set())


def _is_lmcache(name: str) -> bool:
    return name == "lmcache" or name.startswith("lmcache.")


@pytest.fixture
def fake_lmcache(monkeypatch):
    """Install ``tests/connector/fakes/<name>`` as the ``lmcache`` package.

    Real ``lmcache.*`` modules are hidden meanwhile and put back afterwards.
    """

    def install(name: str):
        for mod in [m for m in sys.modules if _is_lmcache(m)]:
            monkeypatch.delitem(sys.modules, mod)
        pkg_dir = FAKES / name
        spec = importlib.util.spec_from_file_location(
            "lmcache", pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
        )
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "lmcache", module)
        spec.loader.exec_module(module)
        assert name == module.FAKE_NAME
        return module

    yield install
    # Runs before monkeypatch restores the real modules: drop the fakes' submodules.
    for mod in [m for m in sys.modules if _is_lmcache(m)]:
        if str(FAKES) in (getattr(sys.modules[mod], "__file__", None) or ""):
            del sys.modules[mod]


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == kmod.__name__]


@pytest.mark.parametrize(
    "fake, source, kernel_mod, enum_mod, binds_block_kernel",
    [
        ("lmcache_gen_a", SOURCE_GEN_A, "lmcache.c_ops", "lmcache.c_ops", False),
        ("lmcache_gen_b", SOURCE_GEN_B, "lmcache.c_ops", "lmcache.lmcache_native", False),
        ("lmcache_gen_c", SOURCE_GEN_C, "lmcache.cuda_ops", "lmcache.lmcache_native", True),
    ],
)
def test_each_generation_resolves_its_callables_and_enums(
    fake_lmcache, caplog, fake, source, kernel_mod, enum_mod, binds_block_kernel
):
    fake_lmcache(fake)
    caplog.set_level(logging.DEBUG, logger=kmod.__name__)
    k = resolve_lmcache_kernels(True)
    assert k is not None and k.source == source
    kernels_from, enums_from = sys.modules[kernel_mod], sys.modules[enum_mod]
    for name in REQUIRED_KERNELS:
        assert getattr(k, name) is getattr(kernels_from, name)
        assert getattr(k, name)()[:2] == (fake.removeprefix("lmcache_"), name)
    assert k.EngineKVFormat is enums_from.EngineKVFormat
    assert k.TransferDirection is enums_from.TransferDirection
    assert k.TransferDirection.D2H != k.TransferDirection.H2D
    # The fakes carry no LMCache Python (layout detection): a bound block kernel cannot be used.
    assert k.multi_layer_block_kv_transfer is None and k.copier_api is None
    probe = probe_lmcache_kernels()
    assert (probe.kernels_module, probe.enums_module) == (kernel_mod, enum_mod)
    resolve_lmcache_kernels(True)
    msgs = _messages(caplog)
    assert msgs[-1] == f"Using LMCache transfer kernels from {source}"
    if binds_block_kernel:
        assert len(msgs) == 2 and "block kernel cannot be used" in msgs[0] and "lmcache.utils" in msgs[0]
    else:
        assert len(msgs) == 1
    assert resolve_fused_load(True, k) is True
    assert resolve_fused_load(False, k) is False


@pytest.mark.parametrize(
    "fake, reason",
    [
        ("lmcache_no_enums", "lmcache.lmcache_native lacks enums ['EngineKVFormat', 'TransferDirection']"),
        (
            "lmcache_no_kernels",
            "lmcache.c_ops lacks kernels ['load_and_reshape_flash', 'reshape_and_cache_back_flash']",
        ),
        ("lmcache_cuda_ops_broken", "lmcache.cuda_ops: ImportError: libc10_cuda.so"),
    ],
)
def test_partial_modules_fall_back_with_a_single_log_message(fake_lmcache, caplog, fake, reason):
    fake_lmcache(fake)
    caplog.set_level(logging.DEBUG, logger=kmod.__name__)
    assert resolve_lmcache_kernels(True) is None
    assert resolve_lmcache_kernels(True) is None  # second call: no second message
    msgs = _messages(caplog)
    assert len(msgs) == 1, msgs
    assert "using the torch copy path" in msgs[0] and reason in msgs[0]


def test_fused_load_without_kernels_warns_once_and_is_off(caplog):
    caplog.set_level(logging.DEBUG, logger=kmod.__name__)
    assert resolve_fused_load(True, None) is False
    assert resolve_fused_load(True, None) is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Fused load requested" in warnings[0].getMessage()
    caplog.clear()
    assert resolve_fused_load(False, None) is False
    assert not caplog.records


def test_kernels_usable_only_on_cuda_tensors(fake_lmcache):
    fake_lmcache("lmcache_gen_c")
    k = resolve_lmcache_kernels(True)
    cpu = torch.zeros(2)
    assert kernels_usable_for(cpu) is False and k.usable_for(cpu) is False
    assert kernels_usable_for(torch.empty(2, device="meta")) is False  # not a CUDA tensor
    if torch.cuda.is_available():
        assert kernels_usable_for(torch.zeros(2, device="cuda")) is True


def test_no_lmcache_at_all_means_torch_path(monkeypatch, caplog):
    for mod in [m for m in sys.modules if m == "lmcache" or m.startswith("lmcache.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "lmcache", None)  # import lmcache -> ImportError
    caplog.set_level(logging.DEBUG, logger=kmod.__name__)
    assert resolve_lmcache_kernels(True) is None
    assert "lmcache: ModuleNotFoundError" in _messages(caplog)[0]


def test_real_lmcache_056_on_cpu_takes_torch_path_without_error(caplog):
    pytest.importorskip("lmcache.lmcache_native")
    caplog.set_level(logging.DEBUG, logger=kmod.__name__)
    probe = probe_lmcache_kernels()
    assert probe.enums_module == "lmcache.lmcache_native"
    native = sys.modules["lmcache.lmcache_native"]
    assert hasattr(native.TransferDirection, "H2D")
    assert any(p.startswith("lmcache.c_ops: ModuleNotFoundError") for p in probe.problems)
    k = resolve_lmcache_kernels(True)
    if torch.cuda.is_available():  # a CUDA host may really have lmcache.cuda_ops
        assert k is None or k.source == SOURCE_GEN_C
    else:
        assert k is None and probe.kernels is None
        assert any(p.startswith("lmcache.cuda_ops: ImportError") for p in probe.problems)
        assert len(_messages(caplog)) == 1
    assert kernels_usable_for(torch.zeros(1)) is False


def test_disabled_never_imports_lmcache():
    code = textwrap.dedent(
        """
        import sys
        from maru_vllm.connector.kernels import resolve_lmcache_kernels, resolve_fused_load
        assert resolve_lmcache_kernels(False) is None
        assert resolve_fused_load(True, resolve_lmcache_kernels(False)) is False
        print(sorted(m for m in sys.modules if m.split(".")[0] == "lmcache"))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    assert "Fused load requested" in out.stderr  # the warning went to the root logger


def test_summary_names_the_path_and_why_without_importing_lmcache_off_cuda() -> None:
    code = textwrap.dedent(
        """
        import sys
        from maru_vllm.connector.kernels import kernel_path_summary
        print(kernel_path_summary("cpu"))
        print(kernel_path_summary("cuda", use_lmcache_kernels=False))
        print(sorted(m for m in sys.modules if m.split(".")[0] == "lmcache"))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.splitlines() == [
        "torch path: CPU engine",
        "torch path: maru_use_lmcache_kernels is off",
        "[]",
    ], out.stderr


def test_summary_when_lmcache_is_not_installed(monkeypatch) -> None:
    for mod in [m for m in sys.modules if _is_lmcache(m)]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "lmcache", None)
    monkeypatch.setattr(kmod, "LMCACHE", dataclasses.replace(kmod.LMCACHE, dist="no-such-lmcache-dist"))
    assert kmod.kernel_path_summary("cuda") == "torch path: LMCache not installed"


def test_summary_of_the_installed_056_on_a_host_without_cuda() -> None:
    pytest.importorskip("lmcache.lmcache_native")
    if torch.cuda.is_available():
        pytest.skip("a CUDA host may load lmcache.cuda_ops")
    summary = kmod.kernel_path_summary("cuda")
    assert summary.startswith("torch path: LMCache 0.5.6 kernels unavailable (lmcache.cuda_ops: ImportError")
