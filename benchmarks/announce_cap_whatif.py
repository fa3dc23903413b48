#!/usr/bin/env python3
"""What an announce cap costs in router credit on a Mooncake trace (an offline model, no engines).

Each hash id of a request is one pool chunk (the traces' 512-token blocks). The pool holds every
chunk ever stored (or the `--pool-chunks` most recently used) in LRU order; a request's pool
hit is the longest prefix of its chunks the pool holds, and those are used (moved to the most
recently used end); then its other chunks are stored. A relay capped at N announces what
`maru_vllm.events.pool_view` does: at a resync the pool's N most recently used chunks; then
every stored chunk, first counting the chain it is stored on as used, withdrawing the least
recently used announced chunk past N; and a resync again after N withdrawals. The router credits
a request with the longest prefix of its chunks the relay announces.

Prints, per cap (a share of the chunks the pool ends with), the share of pool-hit chunks the
router credits: what routing still sees of the pool under the cap.

Usage: python benchmarks/announce_cap_whatif.py --trace ../shared/traces/mooncake_conversation.jsonl
       [--pool-chunks P] [--caps 0.05 0.1 0.25 0.5] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

from harness import write_json


def replay(trace: list[list[int]], cap: int | None, pool_chunks: int) -> tuple[int, int, int]:
    """(pool-hit chunks, of them credited under `cap`, chunks in the pool at the end)."""
    pool: collections.OrderedDict[int, None] = collections.OrderedDict()
    announced: collections.OrderedDict[int, None] = collections.OrderedDict()
    withdrawals = hit = credited = 0
    for ids in trace:
        h = 0
        while h < len(ids) and ids[h] in pool:
            h += 1
        c = 0
        while c < h and ids[c] in announced:
            c += 1
        hit, credited = hit + h, credited + c
        new = [k for k in ids if k not in pool]
        for k in ids:
            if k in pool:
                pool.move_to_end(k)
            else:
                pool[k] = None
                if pool_chunks and len(pool) > pool_chunks:
                    announced.pop(pool.popitem(last=False)[0], None)  # evicted: the relay withdraws it
        if cap is None or not new:
            continue
        for k in ids[: ids.index(new[0])]:  # the chain the first new chunk is stored on: just used
            if k in announced:
                announced.move_to_end(k)
        for k in new:
            announced[k] = None
            if len(announced) > cap:
                announced.popitem(last=False)
                withdrawals += 1
                if withdrawals >= cap:  # resync: the pool's most recently used
                    withdrawals = 0
                    announced = collections.OrderedDict((m, None) for m in list(pool)[-cap:])
    return hit, credited, len(pool)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="a Mooncake trace (JSON lines with hash_ids)")
    ap.add_argument("--pool-chunks", type=int, default=0, help="pool capacity in chunks (0: every chunk)")
    ap.add_argument("--caps", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5], help="caps as shares of the pool")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    trace = [json.loads(line)["hash_ids"] for line in Path(args.trace).read_text().splitlines() if line.strip()]
    hit, _, chunks = replay(trace, None, args.pool_chunks)
    print(f"{args.trace}: {len(trace)} requests, {chunks} chunks in the pool at the end, {hit} pool-hit chunks")
    out: dict[str, Any] = {"trace": args.trace, "requests": len(trace), "pool_chunks": chunks, "caps": []}
    for share in args.caps:
        cap = max(1, int(share * chunks))
        h, c, _ = replay(trace, cap, args.pool_chunks)
        out["caps"].append({"share": share, "cap": cap, "credited_share": c / h if h else 1.0})
        print(f"  cap {cap} chunks ({share:.0%} of the pool): the router credits {c / h:.1%} of pool-hit chunks")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
