"""The static level of the compatibility matrix: upstream symbols checked against released sources.

The collector and the resolver are tried on small source trees written here (a symbol that
moves is named with the release that lost it, a re-export counts as present, a missing class
field is reported); then the real check runs over every supported release of vLLM, LMCache and
Dynamo (their sources are fetched once into `.compat-cache/`), and a last test makes sure the
collector sees every upstream import our sources have.
"""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest

from maru_vllm.upstream_contracts import CONTRACTS, Contract
from scripts.compat import static
from scripts.compat.sources import SourceUnavailable

REPO = Path(__file__).resolve().parents[2]


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


# ---- the collector ---------------------------------------------------------------------------

OUR_SOURCE = '''
"""Docstrings naming vllm.logger are prose, not uses."""
import importlib
from typing import TYPE_CHECKING

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.v1.request import Request

PROTOCOLS = "dynamo.vllm.kv_connector_protocols"
DETECTORS = (("lmcache.v1.utils", "detect"),)


def lazy():
    try:
        from lmcache import c_ops
    except ImportError:
        c_ops = None
    import dynamo.vllm.main as dm

    dm.register_vllm_model = None
    flag = getattr(dm, "shutdown_endpoints", None)
    mod = importlib.import_module(PROTOCOLS)
    return f"vllm.{flag}", mod, c_ops
'''


def test_the_collector_finds_imports_at_any_depth_strings_and_attribute_lookups() -> None:
    uses = {(u.symbol, u.site.split(":")[1], u.guard, u.kind) for u in static.collect_source(OUR_SOURCE, "ours.py")}
    assert uses == {
        ("vllm.logger:init_logger", "6", "", "import"),
        ("vllm.v1.request:Request", "9", "", "import"),  # under TYPE_CHECKING
        ("dynamo.vllm.kv_connector_protocols", "11", "", "string"),  # a module-level constant
        ("lmcache.v1.utils:detect", "12", "", "string"),  # a (module, name) pair
        ("lmcache:c_ops", "17", "try/except ImportError", "import"),  # inside a function, guarded
        ("dynamo.vllm.main", "20", "", "import"),
        ("dynamo.vllm.main:register_vllm_model", "22", "", "attribute"),  # patched on the module
        ("dynamo.vllm.main:shutdown_endpoints", "23", "getattr default", "attribute"),
        ("dynamo.vllm.kv_connector_protocols", "24", "", "string"),  # import_module(CONSTANT)
    }


# ---- the resolver, on releases written here ---------------------------------------------------

RELEASE_1 = {
    "vllm/__init__.py": "from vllm.engine import Engine as Engine\n",
    "vllm/engine.py": """
        import dataclasses

        @dataclasses.dataclass
        class Base:
            block_ids: list

        class Engine(Base):
            kind = "v1"

            def __init__(self, config):
                self.steps = 0

            def step(self, request, num_tokens):
                return None

            @property
            def idle(self):
                return True
    """,
    "vllm/utils/__init__.py": "from .hashing import *\n",
    "vllm/utils/hashing.py": "def block_hash(x):\n    return x\n",
    "vllm/envs.py": """
        def __getattr__(name):
            return _VARS[name]()

        _VARS = {"VLLM_FLAG": lambda: 1}
    """,
    "csrc/bind.cpp": """
        PYBIND11_MODULE(_ops, m) {
          py::enum_<Direction>(m, "Direction").value("H2D", Direction::H2D);
          m.def("copy_blocks", &copy_blocks);
        }
    """,
}
# Release 2: block_hash moved to vllm.utils.hash (re-exported nowhere), Engine lost `steps`,
# `step` renamed its parameter, the compiled module lost copy_blocks.
RELEASE_2 = {
    **RELEASE_1,
    "vllm/utils/__init__.py": "",
    "vllm/utils/hashing.py": "",
    "vllm/utils/hash.py": "def block_hash(x):\n    return x\n",
    "vllm/engine.py": RELEASE_1["vllm/engine.py"]
    .replace("self.steps = 0", "self.count = 0")
    .replace("request, num_tokens", "req, num_tokens"),
    "csrc/bind.cpp": RELEASE_1["csrc/bind.cpp"].replace('m.def("copy_blocks", &copy_blocks);', ""),
}


@pytest.fixture
def releases(tmp_path: Path) -> dict[str, Path]:
    return {"1.0": write(tmp_path / "r1", RELEASE_1), "2.0": write(tmp_path / "r2", RELEASE_2)}


def check(releases: dict[str, Path], uses: list[static.Use], contracts: list[Contract]) -> dict:
    return static.run_static_level(
        {"vllm": list(releases)}, roots=lambda dist, version: [releases[version]], uses=uses, contracts=contracts
    )


def use(module: str, *path: str, guard: str = "") -> static.Use:
    return static.Use(module, tuple(path), "maru_vllm/x.py:7", guard)


def missing(report: dict, version: str) -> dict[str, dict]:
    return {row["symbol"]: row for row in report["releases"][f"vllm=={version}"]["missing"]}


def test_a_moved_function_is_missing_from_the_release_that_moved_it(releases: dict[str, Path]) -> None:
    report = check(releases, [use("vllm.utils", "block_hash")], [])
    assert missing(report, "1.0") == {}  # found through the star import
    row = missing(report, "2.0")["vllm.utils:block_hash"]
    assert row["first_missing"] == "2.0"
    assert row["history"] == "present 1.0; absent 2.0"
    assert row["sites"] == ["maru_vllm/x.py:7"]
    assert report["ok"] is False
    assert report["releases"]["vllm==2.0"]["verdict"] == "vllm==2.0: 1 symbol(s) MISSING"


def test_a_reexport_a_lazy_export_and_a_compiled_binding_count_as_present(releases: dict[str, Path]) -> None:
    uses = [use("vllm", "Engine"), use("vllm.envs", "VLLM_FLAG"), use("vllm._ops", "Direction", "H2D")]
    report = check(releases, uses, [])
    assert report["ok"], report
    # ...and the same lookups fail for names that are not there.
    absent = [use("vllm", "Motor"), use("vllm.envs", "NOT_A_FLAG"), use("vllm._ops", "Direction", "D2H")]
    assert set(missing(check(releases, absent, []), "1.0")) == {
        "vllm:Motor",
        "vllm.envs:NOT_A_FLAG",
        "vllm._ops:Direction.D2H",
    }


def test_a_missing_class_field_or_renamed_parameter_is_reported_and_an_inherited_one_found(
    releases: dict[str, Path],
) -> None:
    contract = Contract(
        "vllm",
        "vllm.engine",
        "Engine",
        ("block_ids", "kind", "idle", "steps", "step(request, num_tokens)", "__init__(config)"),
        used_in=("maru_vllm/x.py",),
    )
    report = check(releases, [], [contract])
    assert missing(report, "1.0") == {}
    gone = missing(report, "2.0")
    assert set(gone) == {"vllm.engine:Engine.steps", "vllm.engine:Engine.step"}
    assert "takes (req, num_tokens), we rely on (request, num_tokens)" in gone["vllm.engine:Engine.step"]["detail"]
    # A dataclass's generated __init__ takes its fields.
    base = Contract("vllm", "vllm.engine", "Base", ("__init__(block_ids)",))
    assert check(releases, [], [base])["ok"]


def test_a_handled_absence_is_reported_as_handled_not_missing(releases: dict[str, Path]) -> None:
    contracts = [
        # Moved: found at an alternative place.
        Contract("vllm", "vllm.utils.hashing", "block_hash", alternatives=("vllm.utils.hash:block_hash",)),
        # Read with a fallback by our code.
        Contract("vllm", "vllm.engine", "Engine", ("steps?",)),
        # The compiled kernels are optional: our code copies without them.
        Contract("vllm", "vllm._ops", attrs=("copy_blocks",), optional=True),
    ]
    guarded = [use("vllm.utils", "block_hash", guard="try/except ImportError")]
    report = check(releases, guarded, contracts)
    assert report["ok"], report
    handled = {row["symbol"]: row["detail"] for row in report["releases"]["vllm==2.0"]["handled"]}
    assert set(handled) == {
        "vllm.utils.hashing:block_hash",
        "vllm.engine:Engine.steps",
        "vllm._ops.copy_blocks",
        "vllm.utils:block_hash",
    }
    assert "moved: vllm.utils.hash:block_hash has it" in handled["vllm.utils.hashing:block_hash"]
    assert report["releases"]["vllm==1.0"]["handled"] == []


# ---- the real check, every supported release --------------------------------------------------


@pytest.fixture(scope="module")
def real_report() -> dict:
    canary = Contract("vllm", "vllm.v1.core.sched.output", "SchedulerOutput", ("no_such_field_anywhere",))
    try:
        return static.run_static_level(contracts=(*CONTRACTS, canary))
    except SourceUnavailable as exc:
        pytest.skip(f"released sources cannot be fetched here: {exc}")


def test_every_upstream_symbol_we_use_is_in_every_supported_release(real_report: dict) -> None:
    canary = "vllm.v1.core.sched.output:SchedulerOutput.no_such_field_anywhere"
    expected = {**static.supported_releases()}
    assert {(r["dist"], r["version"]) for r in real_report["releases"].values()} == {
        (dist, v) for dist, versions in expected.items() for v in versions
    }
    unhandled = [
        f"{key}: {row['symbol']} ({row['detail']}; used at {', '.join(row['sites'])})"
        for key, r in real_report["releases"].items()
        for row in r["missing"]
        if row["symbol"] != canary
    ]
    assert unhandled == [], "upstream symbols missing:\n" + "\n".join(unhandled)
    # The check reads the real trees: a field no release has is reported in every vLLM release.
    for version in expected["vllm"]:
        assert canary in {row["symbol"] for row in real_report["releases"][f"vllm=={version}"]["missing"]}
    assert min(r["checked"] for r in real_report["releases"].values()) >= 30


def test_known_moves_are_reported_with_their_release(real_report: dict) -> None:
    def history(key: str, symbol: str) -> str:
        rows = {row["symbol"]: row for row in real_report["releases"][key]["handled"]}
        return rows[symbol]["history"]

    resumed = "vllm.v1.core.sched.output:CachedRequestData.resumed_req_ids"
    assert history("vllm==0.34.0", resumed) == "present 0.31.0-0.33.0; absent 0.34.0"
    assert history("lmcache==0.5.4", "lmcache.c_ops") == "present 0.4.3-0.5.3; absent 0.5.4-0.5.6"
    assert history("lmcache==0.4.3", "lmcache.cuda_ops") == "absent 0.4.3-0.5.3; present 0.5.4-0.5.6"


# ---- the collector misses no upstream import of ours -------------------------------------------

IMPORT_LINE = re.compile(
    r"^\s*(?:from\s+(?:vllm|lmcache|dynamo)(?:\.\w+)*\s+import\b|import\s+(?:vllm|lmcache|dynamo)\b)"
)
MODULE_NAME = re.compile(r"(?:vllm|lmcache|dynamo)(?:\.\w+)+")


def module_name_strings(source: str) -> set[int]:
    """Lines of string tokens that are exactly an upstream module's dotted name (not f-strings)."""
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and tok.string[0] in "'\"":
            value = ast.literal_eval(tok.string)
            if isinstance(value, str) and MODULE_NAME.fullmatch(value) and value not in static.NOT_MODULES:
                lines.add(tok.start[0])
    return lines


def test_the_collector_finds_every_upstream_import_and_module_name_in_our_sources() -> None:
    uses = static.collect_uses()
    found = {(u.site, u.kind == "import") for u in uses}
    grepped_imports, grepped_strings = set(), set()
    for folder in static.OUR_SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel in static.NOT_SCANNED:
                continue
            source = path.read_text(encoding="utf-8")
            for n, line in enumerate(source.splitlines(), 1):
                if IMPORT_LINE.match(line):
                    grepped_imports.add(f"{rel}:{n}")
            grepped_strings |= {f"{rel}:{n}" for n in module_name_strings(source)}
    assert len(grepped_imports) > 40  # the grep reads the real tree
    assert grepped_imports == {site for site, is_import in found if is_import}
    assert len(grepped_strings) > 5
    assert grepped_strings <= {site for site, is_import in found if not is_import}
    # Every import the collector saw is one the grep saw: no import is counted from a comment.
    assert {site for site, is_import in found if is_import} <= grepped_imports
