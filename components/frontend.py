"""`python -m maru_dynamo.components.frontend [dynamo.frontend args]`: Dynamo's frontend for Maru.

Runs `dynamo.frontend` in this process with three defaults a Maru graph needs:

* ``--router-mode kv``: the KV router, which is what sees the pool's blocks at all;
* ``--router-host-cache-hit-weight W``: the pool's blocks are published on the host-pinned
  tier, so this weight is how much the router credits a prefix that sits in the pool.
  W is `maru_vllm.routing.POOL_TIER_WEIGHT`, or ``$MARU_POOL_TIER_WEIGHT`` when set;
* ``--migration-limit 3``: Dynamo's request migration. When a worker dies (or its stream breaks)
  mid-request, the frontend sends the request with the tokens generated so far to another
  worker, which loads the prompt's chunks from the pool instead of computing them again, and
  the client's stream goes on; without it the client gets a cut-off stream that ends like a
  complete one. ``--migration-limit 0`` turns it off.

In a disaggregated graph it also logs, once each time, when a role is degraded (no worker of it
is left and the other role's workers stand in for it, `maru_dynamo.components.disagg`) and when disaggregated
serving is restored (`maru_dynamo.components.disagg.frontend_log`, from the frontend's own `/health`).

Whatever the user passes wins: an explicit flag (or Dynamo's own ``DYN_ROUTER_MODE`` /
``DYN_ROUTER_HOST_CACHE_HIT_WEIGHT`` / ``DYN_MIGRATION_LIMIT`` variable) is left alone, and
every other argument goes to `dynamo.frontend` unchanged.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence

from maru_vllm.launch.argv import flag_value, has_flag
from maru_vllm.launch.handoff import run_module_as_main
from maru_vllm.routing import ENV_VAR as WEIGHT_ENV_VAR
from maru_vllm.routing import pool_tier_weight

logger = logging.getLogger(__name__)

ROUTER_MODE_FLAG = "--router-mode"
WEIGHT_FLAG = "--router-host-cache-hit-weight"
MIGRATION_FLAG = "--migration-limit"
MIGRATION_ENV_VAR = "DYN_MIGRATION_LIMIT"  # Dynamo's own variable for the flag
# How many times one request may move to another worker: a crash of each of three workers in a row.
DEFAULT_MIGRATION_LIMIT = 3


def build_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The `dynamo.frontend` argv: `argv` plus the Maru defaults the user did not set."""
    env = os.environ if environ is None else environ
    out = list(argv)
    if not has_flag(out, ROUTER_MODE_FLAG) and not env.get("DYN_ROUTER_MODE"):
        out += [ROUTER_MODE_FLAG, "kv"]
    if not has_flag(out, WEIGHT_FLAG):
        if env.get(WEIGHT_ENV_VAR, "").strip() or not env.get("DYN_ROUTER_HOST_CACHE_HIT_WEIGHT"):
            out += [WEIGHT_FLAG, repr(pool_tier_weight(env))]
        else:
            logger.info("pool tier weight from $DYN_ROUTER_HOST_CACHE_HIT_WEIGHT")
    if not has_flag(out, MIGRATION_FLAG) and not env.get(MIGRATION_ENV_VAR, "").strip():
        out += [MIGRATION_FLAG, str(DEFAULT_MIGRATION_LIMIT)]
    return out


def health_url(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> str:
    """Where this frontend will answer `/health` (its `--http-host`/`--http-port`, Dynamo's defaults)."""
    env = os.environ if environ is None else environ
    host = flag_value(list(argv), "--http-host") or env.get("DYN_HTTP_HOST") or "0.0.0.0"
    port = flag_value(list(argv), "--http-port") or env.get("DYN_HTTP_PORT") or "8000"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{port}/health"


def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        full = build_argv(args)
    except ValueError as exc:
        sys.exit(f"maru-dynamo frontend: error: {exc}")
    from maru_dynamo.components.disagg.frontend_log import RoleLog

    RoleLog(health_url(full)).start()
    run_module_as_main("dynamo.frontend", full)


if __name__ == "__main__":
    main()
