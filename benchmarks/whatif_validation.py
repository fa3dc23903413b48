#!/usr/bin/env python3
"""The what-if simulators against the real stack: the README's routing comparison replayed as a trace.

`benchmarks/routing_comparison.py --window 3` measured prefill tokens on two real workers (vLLM
CPU, Dynamo 1.6.1, the Maru pool; README "Routing comparison"). Here the same 21 requests
(`maru_dynamo.components.whatif.validation`) replay on the pool model and on Dynamo's offline replay, 2
workers, 128-token blocks (vLLM's block size there), GPU caches large enough that nothing is
evicted (the real run evicts nothing either), `--repeats` runs each, min / median / max.
``kv-gpu+pool`` is kv-pool with router host weight 0: engines load from the pool, the router
does not see it (the real run's ablation, workers started with ``--no-maru-pool-events``).

Usage: python benchmarks/whatif_validation.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maru_dynamo.components.whatif.runner import DYNAMO, MODEL, WhatIf
from maru_dynamo.components.whatif.spec import KV_GPU, KV_HOST, KV_POOL, ROUND_ROBIN
from maru_dynamo.components.whatif.trace import unique_prefix_tokens
from maru_dynamo.components.whatif.validation import (
    REAL_BLOCK_TOKENS,
    routing_comparison_trace,
    validation_itl_ms,
    validation_spec,
)

# Measured on the real stack (README routing table, 2026-11-29), prefill tokens computed.
REAL = {
    ROUND_ROBIN: "10112 (round-robin over Maru workers: the pool under it)",
    KV_GPU: "11136",
    "kv-gpu+pool": "9344",
    KV_HOST: "-",
    KV_POOL: "9216",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    spec = validation_spec().with_weight(0.97)
    requests = routing_comparison_trace(validation_itl_ms(spec))
    print(
        f"{len(requests)} requests, {sum(r.input_length for r in requests)} prompt tokens, prefix tree "
        f"{unique_prefix_tokens(requests, REAL_BLOCK_TOKENS)} tokens; prefill tokens computed (min / median / max "
        f"of {args.repeats} runs)\n"
    )
    print("| configuration | real stack | pool model | Dynamo replay |")
    print("|---|---:|---:|---:|")
    with WhatIf(requests, spec, MODEL, progress=None) as model, WhatIf(requests, spec, DYNAMO, progress=None) as dyn:
        for name, config, weight in (
            (ROUND_ROBIN, ROUND_ROBIN, None),
            (KV_GPU, KV_GPU, None),
            ("kv-gpu+pool", KV_POOL, 0.0),
            (KV_HOST, KV_HOST, None),
            (KV_POOL, KV_POOL, None),
        ):
            s = spec if weight is None else spec.with_weight(weight)
            cells = []
            for sim in (model, dyn):
                vals = []
                for _ in range(args.repeats):
                    try:
                        vals.append(sim.replay_once(s, config, 2).prefill_tokens)
                    except RuntimeError as exc:
                        vals.append(f"failed: {exc}")
                nums = sorted(v for v in vals if isinstance(v, int))
                cells.append(" / ".join(str(x) for x in (nums[0], nums[len(nums) // 2], nums[-1])) if nums else vals[0])
            print(f"| {name} | {REAL[name]} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
