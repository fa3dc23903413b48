"""How much Dynamo's KV router should credit a prefix that is in the Maru pool.

The router scores a worker by the prefix blocks it already holds. Blocks on the GPU (device
tier) save their whole prefill; blocks that must first be loaded from the pool save only the
part of the prefill time that loading does not eat. The pool's blocks are published on the
host-pinned tier, so the frontend's ``--router-host-cache-hit-weight`` is the knob, and this
module is the one place its value comes from.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

POOL_TIER_WEIGHT: float = 0.97
"""Router credit for one pool-resident block, relative to one device-resident block (0..1).

Measured by ``benchmarks/bench_connector.py`` as ``1 - load time / recompute time`` of the same
prompt on the bench model: a pool hit's time to first token minus a local prefix-cache hit's,
over a cold prefill's minus the local hit's, subtracted from 1 (the share of the recompute time
that loading from the pool saves), on this project's CPU machine; the run's figures are in the
docs/performance.md ("Pool-aware routing"). On CPU, prefill is slow and a load from the pool is fast, so a pool
hit is worth almost a device hit; on a GPU prefill is far faster and the weight will be lower.

To redo it on GPU hardware: ``make setup GPU=1`` on the target machine (same GPU, same pool
medium: /dev/shm or the CXL DAX device used in production), run
``python benchmarks/bench_connector.py --json`` and take ``pool_tier_weight`` from its output;
repeat a few times and use the median. The ratio depends on the model (prefill cost grows with
its size, load cost with its KV bytes per token), the prompt length and the pool's bandwidth,
so measure with a model of the serving model's geometry and update this constant. Deployments
that differ can override it without a code change: ``MARU_POOL_TIER_WEIGHT`` in the frontend's
environment, or ``--router-host-cache-hit-weight`` on its command line.
"""

DYNAMO_DISK_TIER_WEIGHT: float = 0.25
"""Dynamo 1.6.1's default ``--router-disk-cache-hit-weight``: the credit its router gives a block
announced at the disk tier, relative to a device block. The what-if's second tier (its domain
model, `maru-dynamo whatif`) is credited at this weight where it models announcing the tier."""

ENV_VAR = "MARU_POOL_TIER_WEIGHT"


def validate_weight(value: object, source: str) -> float:
    """`value` as a router weight in [0, 1]; `source` names where it came from, for the error."""
    try:
        weight = float(value)  # type: ignore[arg-type]  # any input: float() raising is the check
    except (TypeError, ValueError):
        raise ValueError(f"{source}: invalid pool tier weight {value!r}: use a number from 0.0 to 1.0") from None
    if not math.isfinite(weight) or not 0.0 <= weight <= 1.0:
        raise ValueError(f"{source}: invalid pool tier weight {value!r}: use a number from 0.0 to 1.0")
    return weight


def pool_tier_weight(environ: Mapping[str, str] | None = None) -> float:
    """The weight in force: ``$MARU_POOL_TIER_WEIGHT`` when set, else `POOL_TIER_WEIGHT`."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_VAR, "").strip()
    if raw:
        return validate_weight(raw, f"${ENV_VAR}")
    return POOL_TIER_WEIGHT
