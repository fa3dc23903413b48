# Step reporting, failure reporting and package checks shared by scripts/setup.sh and
# scripts/setup_compat.sh. Sourced, not run. The sourcing script sets first:
#   SETUP_TAG   the prefix of every line it prints (e.g. "setup")
#   STEP_TOTAL  how many `step`s it has
#   VENV        the virtual environment it fills
#   LOG_DIR     where each step's command output goes (shown when the step fails)
# and gets `step`, `done_step`, `run_logged`, `pip_`, `has_version`, and an ERR trap that names
# the failed step and shows the end of its log.

STEP_NO=0
CURRENT_STEP="start"
T0=$SECONDS

step() {
    STEP_NO=$((STEP_NO + 1))
    CURRENT_STEP="$1"
    STEP_START=$SECONDS
    printf '[%s] (%d/%d) %s\n' "$SETUP_TAG" "$STEP_NO" "$STEP_TOTAL" "$CURRENT_STEP"
}

done_step() {
    printf '[%s]       %s (%ds)\n' "$SETUP_TAG" "$1" "$((SECONDS - STEP_START))"
}

# fd 3 is the real stderr: the ERR trap can fire inside a command whose output goes to a log.
exec 3>&2

on_error() {
    local rc=$?
    trap - ERR
    exec 2>&3
    printf '\n[%s] FAILED at step %d/%d "%s" (exit %d).\n' "$SETUP_TAG" "$STEP_NO" "$STEP_TOTAL" "$CURRENT_STEP" "$rc" >&2
    if [[ -n "${LAST_LOG:-}" && -f "$LAST_LOG" ]]; then
        printf '[%s] last lines of %s:\n' "$SETUP_TAG" "$LAST_LOG" >&2
        tail -n 25 "$LAST_LOG" | sed 's/^/    /' >&2
    fi
    exit "$rc"
}
trap on_error ERR

# Run a command with its output in a per-step log (shown when it fails).
run_logged() {
    mkdir -p "$LOG_DIR"
    LAST_LOG="$LOG_DIR/step-${STEP_NO}.log"
    "$@" >"$LAST_LOG" 2>&1
}

pip_() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

# True when distribution $1 is installed at exactly version $2 (local version labels ignored).
has_version() {
    "$VENV/bin/python" - "$1" "$2" <<'PY'
import sys
from importlib import metadata
try:
    v = metadata.version(sys.argv[1])
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if v.split("+")[0] == sys.argv[2] else 1)
PY
}
