"""The kernel resolver and the block copier's LMCache calls against every supported LMCache release.

Each release runs in its own interpreter with that release's real Python sources first on
`sys.path` (its sdist, fetched by name and cached: `scripts/compat/sources.py`), so its
`importlib.metadata` version is the release's. Only what cannot run here is replaced: the
compiled CUDA extension (`lmcache.c_ops` up to 0.5.3, `lmcache.cuda_ops` from 0.5.4) becomes a
FAKE module built from that release's own pybind binding file - every `m.def("...")` name as an
op that fails like CUDA on a host without a GPU, its enums with the members and values of the
release's C++ headers, its bound classes as plain attribute holders. `lmcache.lmcache_native`
(0.5.4+, a CPU extension) is the installed, really compiled one; the test checks it binds every
name the release's own binding file does.

What a user would notice: the connector's start-up phrase names the release and where its kernels
came from; the copier's LMCache calls (layout detection given vLLM's layout, page geometry,
pointers) work on that release; a kernel that fails at run time moves the copy to LMCache's own
torch implementation where the release has one (the chunk still lands, same bytes), and otherwise
fails as the copier's contract says (a RuntimeError: a miss), never anything else; a release
outside the supported ones takes the torch path with exactly one warning naming it.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OLDER = "0.4.2"  # the release before the first supported one
NEWER = "0.9.0"  # a release this package does not know
REQUIRED = (
    "multi_layer_kv_transfer",
    "single_layer_kv_transfer",
    "load_and_reshape_flash",
    "reshape_and_cache_back_flash",
)


# --- the fake compiled CUDA extension, built from a release's binding file -------------------------


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def binding_names(cpp: str) -> dict:
    """What a pybind11 binding file binds: ops, enums (members in order), classes, aliases."""
    text = _strip_comments(cpp)
    enums: dict[str, tuple[str, list[str]]] = {}
    for m in re.finditer(r'py::enum_<([\w:]+)>\(\s*m\s*,\s*"(\w+)"[^)]*\)', text):
        chain = text[m.end() : text.index(";", m.end())]
        enums[m.group(2)] = (m.group(1).split("::")[-1], re.findall(r'\.value\(\s*"(\w+)"', chain))
    return {
        "ops": re.findall(r'\bm\.def\(\s*"(\w+)"', text),
        "enums": enums,
        "classes": re.findall(r'py::class_<[^>]*>\(\s*m\s*,\s*"(\w+)"', text),
        "aliases": re.findall(r'm\.attr\(\s*"(\w+)"\s*\)\s*=\s*m\.attr\(\s*"(\w+)"\s*\)', text),
    }


def cpp_enum_values(csrc: Path, cpp_type: str, members: list[str]) -> dict[str, int]:
    """Member -> value of `enum class cpp_type` as the release's headers define it (the definition
    that has every one of `members`: a backend may carry an older copy)."""
    pattern = re.compile(r"enum\s+class\s+" + cpp_type + r"\b[^{;]*\{(.*?)\}", re.S)
    for header in sorted(csrc.rglob("*.h")) + sorted(csrc.rglob("*.cuh")):
        for found in pattern.finditer(_strip_comments(header.read_text(errors="replace"))):
            values, nxt = {}, 0
            for item in found.group(1).split(","):
                name, _, value = (p.strip() for p in item.strip().partition("="))
                if not name:
                    continue
                nxt = int(value, 0) if value else nxt
                values[name], nxt = nxt, nxt + 1
            if set(members) <= set(values):
                return values
    raise AssertionError(f"enum class {cpp_type} with {members} not found under {csrc}")


class FakeCudaOp:
    """An op of a FAKE compiled CUDA extension: callable, and fails as CUDA does without a GPU."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name, self.calls = module, name, 0

    def __call__(self, *args: object, **kwargs: object) -> None:
        self.calls += 1
        raise RuntimeError(f"FAKE {self.module}.{self.name}: CUDA error: no CUDA-capable device is detected")


class HostOp:
    """A host-side op (a KV-format predicate) of the FAKE extension: the same op of the installed,
    really compiled `lmcache.lmcache_native`, enum arguments passed by member name."""

    def __init__(self, native: types.ModuleType, name: str) -> None:
        self.native, self.name = native, name

    def __call__(self, *args: object) -> object:
        fmt = self.native.EngineKVFormat
        return getattr(self.native, self.name)(
            *(fmt.__members__[a.name] if isinstance(a, enum.Enum) else a for a in args)
        )


def fake_cuda_extension(name: str, binding: Path, csrc: Path, native: types.ModuleType | None) -> types.ModuleType:
    """The FAKE `name` module: the ops, enums and classes `binding` binds. An op the compiled
    CPU module `native` also binds runs there (host code); every other op fails as CUDA would."""
    names = binding_names(binding.read_text())
    module = types.ModuleType(name, f"FAKE compiled CUDA extension built from {binding.name} (test double)")
    module.__file__ = f"<FAKE {name}: {binding}>"
    for op in names["ops"]:
        host = native is not None and op.startswith("is_") and callable(getattr(native, op, None))
        setattr(module, op, HostOp(native, op) if host else FakeCudaOp(name, op))
    for py_name, (cpp_type, members) in names["enums"].items():
        values = cpp_enum_values(csrc, cpp_type, members)
        setattr(module, py_name, enum.IntEnum(py_name, [(m, values[m]) for m in members]))
    for cls in names["classes"]:
        setattr(module, cls, type(cls, (), {"__doc__": "FAKE bound class: a plain attribute holder"}))
    for alias, target in names["aliases"]:
        setattr(module, alias, getattr(module, target))
    return module


# --- what runs in the release's interpreter -------------------------------------------------------


def _release_layout(root: Path) -> tuple[str, Path, Path | None]:
    """(compiled CUDA module, its binding file, lmcache_native's binding file or None)."""
    if (root / "csrc" / "cuda" / "pybind.cpp").exists():
        return (
            "lmcache.cuda_ops",
            root / "csrc" / "cuda" / "pybind.cpp",
            root / "csrc" / "lmcache_native" / "pybind.cpp",
        )
    return "lmcache.c_ops", root / "csrc" / "pybind.cpp", None


def _install_modules(root: Path) -> dict:
    """Put the FAKE CUDA extension (and the real compiled lmcache_native, 0.5.4+) in sys.modules."""
    import importlib.util
    import site

    cuda_name, binding, native_binding = _release_layout(root)
    installed = next(Path(p) / "lmcache" for p in site.getsitepackages() if (Path(p) / "lmcache").is_dir())
    spec = importlib.util.spec_from_file_location("lmcache.lmcache_native", next(installed.glob("lmcache_native.*.so")))
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    sys.modules[cuda_name] = fake_cuda_extension(cuda_name, binding, root / "csrc", native)
    out: dict = {"fake": cuda_name, "fake_ops": binding_names(binding.read_text())["ops"]}
    if native_binding is not None:
        sys.modules["lmcache.lmcache_native"] = native
        want = binding_names(native_binding.read_text())
        out["native_missing"] = [
            n for n in [*want["ops"], *want["enums"], *want["classes"]] if not hasattr(native, n)
        ] + [f"{e}.{m}" for e, (_, ms) in want["enums"].items() for m in ms if not hasattr(getattr(native, e, None), m)]
    return out


def _as_on_a_cuda_host(fake: types.ModuleType) -> None:
    """Import the release's `lmcache` here, then redo its import-time backend choice as on a CUDA
    host, with the release's own code: 0.4.6 - 0.5.2 put a merged module (its Python fallbacks
    overlaid with the compiled ops) at `lmcache.c_ops`, 0.5.3 binds the compiled module onto its
    CUDA device ops behind a `lmcache.c_ops` shim; 0.5.4+ reads a CPU host's KV layouts as HND."""
    import lmcache
    import torch

    merge = getattr(lmcache, "_get_backend", None)  # 0.4.6 - 0.5.1
    if merge is None and callable(getattr(lmcache, "get_backend", None)):  # 0.5.2
        merge = lambda: lmcache.get_backend("cuda")  # noqa: E731
    if merge is not None or hasattr(lmcache, "_install_c_ops_shim"):
        sys.modules["lmcache.c_ops"] = lmcache.c_ops = fake  # what a CUDA host's import finds on disk
    if merge is not None:
        cuda_available = torch.cuda.is_available
        torch.cuda.is_available = lambda: True
        try:
            sys.modules["lmcache.c_ops"] = merge()
        finally:
            torch.cuda.is_available = cuda_available
    if hasattr(lmcache, "torch_device_type"):
        lmcache.torch_device_type = "cuda"
    if hasattr(lmcache, "_install_c_ops_shim"):
        lmcache._install_c_ops_shim()


def _connector_package_without_vllm() -> None:
    """`maru_vllm.connector` as a bare package: its __init__ imports the vLLM connector (seconds of
    imports per interpreter); kernels.py and transfer.py, tested here, do not need it."""
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.ModuleSpec("maru_vllm.connector", None, is_package=True)
    spec.submodule_search_locations = [str(REPO / "maru_vllm" / "connector")]
    sys.modules["maru_vllm.connector"] = importlib.util.module_from_spec(spec)


def _flash_caches(layers: int, nb: int, bs: int, nh: int, hs: int, fill: bool):
    """vLLM's flash-attention KV caches (LBNHC): per layer [2, blocks, block_size, heads, head_size]."""
    import torch

    gen = torch.Generator().manual_seed(7)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(2, nb, bs, nh, hs, generator=gen) if fill else torch.zeros(2, nb, bs, nh, hs)
        ).to(torch.float16)
        for i in range(layers)
    }


def run_release(root: str, version: str, host: str = "cuda") -> dict:
    """In the release's interpreter: resolve, summarise, build the copier, fail a kernel, copy.
    `host="cpu"`: as on a host where the compiled CUDA module does not load."""
    import torch

    records: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name.startswith("maru_vllm"):
                records.append((record.levelname, record.getMessage()))

    logging.getLogger("maru_vllm").addHandler(Keep())
    logging.getLogger("maru_vllm").setLevel(logging.INFO)
    out: dict = {"version": version}
    if root != "-":
        out.update(_install_modules(Path(root)))
    _connector_package_without_vllm()
    from maru_vllm.connector import kernels
    from maru_vllm.connector.transfer import FORMAT_LMCACHE_BLOCK, LMCacheBlockCopier, copy_format
    from maru_vllm.versions import LMCACHE

    if host == "cuda" and root != "-" and kernels.unsupported_release(LMCACHE.installed()) is None:
        _as_on_a_cuda_host(sys.modules[out["fake"]])
    elif host == "cpu":
        sys.modules.pop(out["fake"])  # the compiled module does not load
    # LMCache 0.4.x's gpu_connector.utils picks its enums module (c_ops) when imported on a CUDA host.
    cuda_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: host == "cuda"
    try:
        probe = kernels.probe_lmcache_kernels()
        k = kernels.resolve_lmcache_kernels(True)
        kernels.resolve_lmcache_kernels(True)  # a second resolution logs nothing more
    finally:
        torch.cuda.is_available = cuda_available
    out["summary_cuda"] = kernels.kernel_path_summary("cuda")
    out["summary_cpu"] = kernels.kernel_path_summary("cpu")
    out["copy_format"] = copy_format("cuda", True)
    out["probe"] = {
        "version": probe.version,
        "kernels_module": probe.kernels_module,
        "enums_module": probe.enums_module,
        "problems": list(probe.problems),
    }
    out["lmcache_imported"] = "lmcache" in sys.modules
    if k is not None:
        fake = sys.modules.get(out.get("fake", ""))
        names = (*kernels.REQUIRED_KERNELS, "multi_layer_block_kv_transfer")
        out["kernels_from_fake"] = all(getattr(k, n) is getattr(fake, n, None) for n in names)
        enums = ("EngineKVFormat", "TransferDirection")
        out["enums"] = {n: f"{getattr(k, n).__module__}.{getattr(k, n).__name__}" for n in enums}
        out["source"] = k.source
        out["detector"] = k.copier_api.detector if k.copier_api else None
    if out["copy_format"] == FORMAT_LMCACHE_BLOCK:
        geometry = dict(layers=2, nb=8, bs=4, nh=2, hs=8)
        src = _flash_caches(**geometry, fill=True)
        dst = _flash_caches(**geometry, fill=False)
        failing = k.multi_layer_block_kv_transfer
        cp = LMCacheBlockCopier(failing, src, block_size=4, num_blocks=8, blocks_per_chunk=2, kv_layout="LBNHC")
        d = cp.shape_desc
        out["engine_format"] = getattr(cp.engine_format, "name", str(cp.engine_format))
        out["shape_desc"] = [int(d.kv_size), int(d.nl), int(d.nb), int(d.bs), int(d.nh), int(d.hs)]
        out["ptrs"] = cp._ptrs.tolist() == [t.data_ptr() for t in src.values()]
        out["hnd_format"] = k.copier_api.detect(list(src.values()), "LBHNC")[0].name
        try:
            LMCacheBlockCopier(failing, src, block_size=4, num_blocks=8, blocks_per_chunk=2, kv_layout="LHBNC")
            out["odd_layout"] = "accepted"
        except NotImplementedError as exc:
            out["odd_layout"] = f"NotImplementedError: {exc}"
        obj = bytearray(cp.chunk_nbytes(2))
        try:
            cp.pack([3, 4], memoryview(obj))
            out["failure"] = f"fell back: {cp.name}"
            back = LMCacheBlockCopier(failing, dst, block_size=4, num_blocks=8, blocks_per_chunk=2, kv_layout="LBNHC")
            back.unpack([0, 1], memoryview(obj))
            out["roundtrip"] = all(
                torch.equal(s[:, 3:5], t[:, 0:2]) for s, t in zip(src.values(), dst.values())
            ) and any(bool(t.abs().sum()) for t in dst.values())
        except RuntimeError as exc:
            out["failure"] = f"RuntimeError: {exc}"
            try:  # a second copy fails at once: the broken kernel is not launched again
                cp.pack([3, 4], memoryview(obj))
            except RuntimeError as again:
                out["again"] = f"RuntimeError: {again}"
        out["failing_calls"] = failing.calls
    out["records"] = records
    return out


def run_in_release(root: Path | None, version: str, extra_path: Path | None = None, host: str = "cuda") -> dict:
    """`run_release` in a fresh interpreter whose sys.path starts with the release's sources."""
    path = [str(p) for p in (extra_path, root) if p is not None]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run(
        [sys.executable, __file__, str(root) if root else "-", version, host],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["records"] = [tuple(r) for r in out["records"]]
    return out


# --- the tests ------------------------------------------------------------------------------------


def _sources():
    import importlib.util

    spec = importlib.util.spec_from_file_location("compat_sources", REPO / "scripts" / "compat" / "sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _supported() -> tuple[str, ...]:
    from maru_vllm.versions import LMCACHE

    return LMCACHE.releases


@pytest.fixture(scope="module")
def releases() -> dict[str, tuple[Path, dict]]:
    """Every supported release and the older one, each run once in its own interpreter (two at a time)."""
    sources = _sources()
    versions = (*_supported(), OLDER)
    try:
        roots = {v: sources.release_source("lmcache", v) for v in versions}
    except sources.SourceUnavailable as exc:
        pytest.skip(f"LMCache sources cannot be fetched here: {exc}")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(versions, pool.map(lambda v: run_in_release(roots[v], v), versions)))
    return {v: (roots[v], results[v]) for v in versions}


def _kernel_messages(out: dict) -> list[tuple[str, str]]:
    return [r for r in out["records"] if "LMCache block kernel failed" not in r[1]]


def _has_torch_block_kernel(root: Path) -> bool:
    """Whether the release ships a torch implementation of the block kernel (a module-level def)."""
    return any(
        re.search(r"^def multi_layer_block_kv_transfer\(", f.read_text(errors="replace"), re.M)
        for f in (root / "lmcache").rglob("*.py")
        if "musa" not in f.parts and "rbln" not in f.parts and "devices" not in f.parts
    )


@pytest.mark.parametrize("version", _supported())
def test_each_supported_release_resolves_its_kernel_path(releases, version) -> None:
    root, out = releases[version]
    kernel_module, binding, _ = _release_layout(root)
    bound = binding_names(binding.read_text())
    assert {*REQUIRED, "multi_layer_block_kv_transfer"} <= set(bound["ops"])  # what the fake carries
    assert out["probe"]["version"] == version
    assert out["summary_cuda"] == f"kernel path: LMCache {version} ({kernel_module})"
    assert out["summary_cpu"] == "torch path: CPU engine"
    assert out["probe"]["kernels_module"] == kernel_module and out["kernels_from_fake"]
    # The enums where the release binds them: with the kernels up to 0.5.3 (0.4.x: GPUKVFormat),
    # in lmcache_native from 0.5.4.
    enums_module = (
        kernel_module
        if "EngineKVFormat" in bound["enums"] or "GPUKVFormat" in bound["enums"]
        else "lmcache.lmcache_native"
    )
    assert out["probe"]["enums_module"] == enums_module
    fmt_enum = (
        "EngineKVFormat" if enums_module != kernel_module or "EngineKVFormat" in bound["enums"] else "GPUKVFormat"
    )
    assert out["enums"]["EngineKVFormat"].endswith("." + fmt_enum)
    assert out["enums"]["TransferDirection"].endswith(".TransferDirection")
    assert out.get("native_missing", []) == []  # the compiled lmcache_native binds all the release's names
    assert _kernel_messages(out) == [("INFO", f"Using LMCache transfer kernels from {out['source']}")]
    # The copier's LMCache calls, on that release's own code.
    assert out["copy_format"] == "lmcache-block"
    module, _, function = out["detector"].rpartition(".")
    source = (root / (module.replace(".", "/") + ".py")).read_text()
    assert f"def {function}(" in source
    assert out["engine_format"] == "NL_X_TWO_NB_BS_NH_HS"  # vLLM's LBNHC hint
    assert out["hnd_format"] == "NL_X_TWO_NB_NH_BS_HS"  # the LBHNC hint on the same shapes
    assert out["shape_desc"] == [2, 2, 8, 4, 2, 8] and out["ptrs"]
    assert out["odd_layout"].startswith("NotImplementedError")


@pytest.mark.parametrize("version", _supported())
def test_a_kernel_failing_at_run_time_moves_to_lmcache_torch_or_is_a_miss(releases, version) -> None:
    root, out = releases[version]
    if _has_torch_block_kernel(root):
        assert out["failure"] == "fell back: lmcache-torch"
        assert out["roundtrip"] is True  # the chunk stored by the fallback loads back, same bytes
        warnings = [m for level, m in out["records"] if level == "WARNING"]
        assert warnings and all("using LMCache's torch implementation" in m for m in warnings)
    else:
        # No torch implementation in the release: the copier's contract, a RuntimeError (a miss).
        assert out["failure"].startswith("RuntimeError: LMCache block kernel failed")
        assert "no torch implementation" in out["failure"]
        assert out["again"] == out["failure"]
        assert out["failing_calls"] == 1
    assert out["failing_calls"] >= 1


@pytest.mark.parametrize("version", ["0.5.1", "0.5.3"])
def test_lmcaches_python_fallbacks_at_c_ops_are_not_taken_for_kernels(releases, version) -> None:
    """0.4.6 - 0.5.3 put their Python fallbacks at `lmcache.c_ops` when the compiled module does not
    load (a merged module up to 0.5.2, a shim over the CPU device ops in 0.5.3)."""
    root, _ = releases[version]
    out = run_in_release(root, version, host="cpu")
    assert out["summary_cuda"].startswith(f"torch path: LMCache {version} kernels unavailable (lmcache.c_ops holds")
    assert "its compiled ops did not load" in out["summary_cuda"]
    assert out["copy_format"] == "maru-pages"
    assert [level for level, _ in out["records"]] == ["INFO"]


def test_an_older_release_takes_the_torch_path_with_one_warning(releases) -> None:
    _, out = releases[OLDER]
    why = f"LMCache {OLDER} is older than the supported {_supported()[0]} - {_supported()[-1]}"
    assert out["summary_cuda"] == f"torch path: {why}"
    assert out["records"] == [("WARNING", f"{why}: using the torch copy path")]
    assert out["copy_format"] == "maru-pages"
    assert out["lmcache_imported"] is False


def test_an_unknown_release_takes_the_torch_path_with_one_warning(tmp_path) -> None:
    meta = tmp_path / f"lmcache-{NEWER}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: lmcache\nVersion: {NEWER}\n")
    out = run_in_release(None, NEWER, extra_path=tmp_path)
    why = f"LMCache {NEWER} is newer than the supported {_supported()[0]} - {_supported()[-1]}"
    assert out["summary_cuda"] == f"torch path: {why}"
    assert out["records"] == [("WARNING", f"{why}: using the torch copy path")]
    assert out["copy_format"] == "maru-pages"
    assert out["lmcache_imported"] is False


if __name__ == "__main__":
    print(json.dumps(run_release(*sys.argv[1:4])))
