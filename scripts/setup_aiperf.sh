#!/usr/bin/env bash
# Idempotent set-up of the load generator's own venv: AIPerf (Dynamo's benchmarking tool).
#
# Usage: scripts/setup_aiperf.sh   (via `make aiperf`)
# Env:   AIPERF_VENV (default .venv-aiperf), PYTHON (default python3.11)
#
# AIPerf pins its own versions of pydantic, transformers, zmq and friends that clash with
# the serving stack's venv, so it lives apart: benchmarks call its `aiperf` console script
# as a subprocess and read the JSON it exports. It is never a runtime dependency.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
AIPERF_VENV="${AIPERF_VENV:-$ROOT/.venv-aiperf}"
PYTHON="${PYTHON:-python3.11}"
AIPERF_VERSION=0.13.0
LOG="${AIPERF_VENV}.log"

installed_version() {
    "$AIPERF_VENV/bin/python" -c \
        'import importlib.metadata as m; print(m.version("aiperf"))' 2>/dev/null || true
}

if [[ -x "$AIPERF_VENV/bin/aiperf" && "$(installed_version)" == "$AIPERF_VERSION" ]]; then
    echo "[aiperf] aiperf $AIPERF_VERSION already in $AIPERF_VENV"
    exit 0
fi

T0=$SECONDS
echo "[aiperf] installing aiperf $AIPERF_VERSION into $AIPERF_VENV (log $LOG)"
if [[ ! -x "$AIPERF_VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$AIPERF_VENV"
fi
if ! "$AIPERF_VENV/bin/python" -m pip --disable-pip-version-check install -q \
        "aiperf==$AIPERF_VERSION" >"$LOG" 2>&1; then
    echo "[aiperf] pip install aiperf==$AIPERF_VERSION failed; last lines of $LOG:" >&2
    tail -n 20 "$LOG" | sed 's/^/    /' >&2
    exit 1
fi
"$AIPERF_VENV/bin/aiperf" --version >/dev/null 2>&1 || "$AIPERF_VENV/bin/aiperf" --help >/dev/null
echo "[aiperf] aiperf $(installed_version) ready in $AIPERF_VENV ($((SECONDS - T0))s)"
