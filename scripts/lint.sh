#!/usr/bin/env bash
# `make lint`: ruff (lint rules, then the formatter in check mode) and mypy, configured in
# pyproject.toml. All three run so one pass shows every finding; the exit status is non-zero if any
# of them failed.
#
# Usage: scripts/lint.sh            (via `make lint`, and `make test` runs it first)
# Env:   VENV (default .venv)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
cd "$ROOT"

rc=0
run() {
    printf '[lint] %s\n' "$*"
    "$@" || rc=1
}

run "$VENV/bin/ruff" check
run "$VENV/bin/ruff" format --check --output-format concise  # `ruff format --diff` shows the changes

# components/ and graphs/ are installed as maru_dynamo.components / maru_dynamo.graphs
# ([tool.setuptools] package-dir), and they import each other under those names. mypy cannot
# follow setuptools' editable-install import hook, so it reads them through a tree of two links
# that has that layout (mypy_path in pyproject.toml); the paths it reports are mapped back.
TREE="$ROOT/build/typecheck/maru_dynamo"
mkdir -p "$TREE"
ln -sfn ../../../components "$TREE/components"
ln -sfn ../../../graphs "$TREE/graphs"
printf '[lint] mypy\n'
"$VENV/bin/python" -m mypy | sed -E 's#^build/typecheck/maru_dynamo/##' || rc=1

exit "$rc"
