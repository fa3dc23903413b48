#!/usr/bin/env python3
"""Does crediting the tier-2's chunks at Dynamo's disk tier change where the router sends requests?

The domains graph (`graphs/domains.yaml`'s topology: a mooncake_master, a pool per CXL domain, one
Maru worker on each, one frontend with Dynamo's KV router) run through `graphs/run.py` four
times, alternating tier-2 credit off / on / off / on (`--maru-tier2-credit` in both workers,
through `MARU_TIER2_CREDIT`), each run driven by the same shared-prefix traffic as the routing
comparison (`routing_comparison.DEFAULT_SPEC`: 21 requests of 7 chat sessions on two system
prompts, `--window` requests in flight at each decision, each routed once the one before it is
prefilled and its events had `--settle-s`). The router's disk weight is Dynamo's default
(`--router-disk-cache-hit-weight` 0.25), the host weight the pool's (`maru_vllm.routing`).

Measured per run: the worker each request went to (the one whose prompt counter grew: one per
frontend `Selected worker` line, whose `disk_blocks` past its `host_pinned_blocks` say the disk
tier credited it), and the prefill tokens computed. Between two runs, the decisions that
differ, the two workers matched up between the runs (the domains are alike: a first request,
a tie, that went to the other worker only swaps the workers' names). Dynamo breaks ties between
equally good workers at random, so two runs of the same setting differ too: off vs off and on
vs on are the noise floor, and credit changes routing only where off vs on differs by more;
the prefill ratio says whether for the better.

Usage: python benchmarks/tier2_credit.py [--window 3] [--settle-s 1.0] [--routes] [--json]
(run under `flock -x /tmp/maru-heavy.lock`: four graph runs, ~2 min each on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import routing_comparison as rc  # noqa: E402
from maru_vllm.fixtures.workload import Workload, build_workload  # noqa: E402
from maru_vllm.launch import stack  # noqa: E402
from maru_vllm.routing import DYNAMO_DISK_TIER_WEIGHT, POOL_TIER_WEIGHT  # noqa: E402

SETTINGS = ("off", "on", "off", "on")  # alternating: drift in the machine hits both settings alike


def graph(name: str, nats_url: str, *, credit: bool, window: int) -> dict[str, object]:
    """The domains graph on the shared nats-server: two domains, one pinned Maru worker each."""
    args = ["--max-model-len", str(rc.MAX_MODEL_LEN)]
    if window > 1:
        args += ["--stream-interval", str(rc.STREAM_INTERVAL)]
    env = {"MARU_TIER2_CREDIT": "1" if credit else "0"}
    return {
        "name": name,
        "nats": {"url": nats_url},
        "mooncake": {},
        "domains": ["a", "b"],
        "pool": {"name": "kv", "size": "512M", "chunk_tokens": rc.CHUNK_TOKENS},
        "frontend": {"router_mode": "kv", "pool_tier_weight": POOL_TIER_WEIGHT},
        "workers": [
            {"name": "worker-a", "domain": "a", "args": args, "env": env},
            {"name": "worker-b", "domain": "b", "args": args, "env": env},
        ],
    }


def disk_credited(line: str) -> bool:
    """Whether a frontend `Selected worker` line credits the selected worker with blocks at the
    disk tier: its `disk_blocks` (the prefix matched down to the disk tier, as Dynamo reports it)
    reach past its `host_pinned_blocks` (down to the host tier)."""
    host = re.search(r"host_pinned_blocks=(\d+)", line)
    disk = re.search(r"disk_blocks=(\d+)", line)
    return bool(host and disk and int(disk.group(1)) > int(host.group(1)))


def differing(a: rc.ConfigResult, b: rc.ConfigResult) -> int:
    """Requests the two runs sent to different workers, the workers matched up between the runs
    as best they can be: the two domains are alike, so a run whose first request (a tie: nothing
    is cached yet) went to the other worker is the same routing with the workers' names swapped."""
    n = max(len(a.workers), len(b.workers), 2)
    pairs = [(x.worker, y.worker) for x, y in zip(a.requests, b.requests)]
    return min(
        sum(1 for x, y in pairs if x is None or y is None or x != perm[y]) for perm in itertools.permutations(range(n))
    )


@dataclasses.dataclass
class Comparison:
    runs: list[tuple[str, rc.ConfigResult]]

    def pairs(self, same: bool) -> list[tuple[int, int, int]]:
        """(i, j, differing decisions) of every pair of runs of the same (or of different) setting."""
        out = []
        for (i, (si, ri)), (j, (sj, rj)) in itertools.combinations(enumerate(self.runs), 2):
            if (si == sj) == same:
                out.append((i, j, differing(ri, rj)))
        return out

    @property
    def noise(self) -> int:
        return max((d for _, _, d in self.pairs(True)), default=0)

    @property
    def effect(self) -> float:
        return statistics.fmean(d for _, _, d in self.pairs(False))

    @property
    def changes_routing(self) -> bool:
        return self.effect > self.noise

    def prefill(self, setting: str) -> list[int]:
        return [r.prefill_computed for s, r in self.runs if s == setting]

    def report(self, workload: Workload, window: int) -> str:
        n = len(workload)
        rows = [
            f"tier-2 credit at the disk tier: {len(self.runs)} runs of the domains graph (2 domains, 1 worker each), "
            f"{n} requests, window {window}, disk weight {DYNAMO_DISK_TIER_WEIGHT} (Dynamo's default), "
            f"host weight {POOL_TIER_WEIGHT}",
            f"{'run':<8} {'credit':<6} {'prefill computed':>16} {'req/worker':>11} {'decisions with disk credit':>27}",
        ]
        for i, (s, r) in enumerate(self.runs):
            credited = sum(1 for q in r.requests if disk_credited(q.router_line))
            rows.append(
                f"{i + 1:<8} {s:<6} {r.prefill_computed:>16} {'/'.join(map(str, r.requests_per_worker)):>11} "
                f"{credited:>27}"
            )
        for same, label in ((True, "same setting (noise floor)"), (False, "off vs on")):
            for i, j, d in self.pairs(same):
                rows.append(f"decisions differing, runs {i + 1} vs {j + 1} ({label}): {d} of {n} ({d / n:.3f})")
        off, on = statistics.fmean(self.prefill("off")), statistics.fmean(self.prefill("on"))
        rows.append(
            f"off vs on: {self.effect:.1f} of {n} decisions differ ({self.effect / n:.3f}) against a noise floor of "
            f"{self.noise} ({self.noise / n:.3f}); prefill computed on / off = {on / off:.3f} "
            f"({on:.0f} / {off:.0f} tokens)"
        )
        if not self.changes_routing:
            verdict = "changes no routing beyond chance"
        else:
            verdict = "changes routing beyond the noise floor, " + (
                "computing less prefill" if on < off else "computing no less prefill"
            )
        rows.append(f"=> tier-2 credit {verdict}")
        return "\n".join(rows)


def run(
    *, model: str, work_dir: Path, window: int, settle_s: float, log: Callable[[str], None] = print
) -> tuple[Comparison, Workload]:
    workload = build_workload(rc.DEFAULT_SPEC)
    nats, nats_url = stack.nats_server(work_dir / "logs")
    nats.start()
    runs: list[tuple[str, rc.ConfigResult]] = []
    try:
        nats.wait_for_log(stack.NATS_READY_PATTERN, timeout=30)
        for i, setting in enumerate(SETTINGS):
            name = f"credit-{setting}-{i + 1}"
            cfg = rc.RoutingConfig(name, "kv", True, True, f"domains graph, tier-2 credit {setting}")
            t0 = time.monotonic()
            result = rc.run_config(
                cfg,
                workload,
                model=model,
                nats_url=nats_url,
                work_dir=work_dir,
                settle_s=settle_s,
                window=window,
                log=log,
                graph=graph(name, nats_url, credit=setting == "on", window=window),
            )
            runs.append((setting, result))
            log(f"[{name}] done in {time.monotonic() - t0:.0f}s: prefill computed {result.prefill_computed}")
    finally:
        nats.stop(rc.STOP_GRACE_S)
    return Comparison(runs), workload


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", default="tiny", help="fixture model (tiny, bench) or a model path")
    ap.add_argument("--window", type=int, default=rc.DEFAULT_WINDOW, help="requests in flight at each decision")
    ap.add_argument("--settle-s", type=float, default=1.0, help="pause after each request for its events")
    ap.add_argument("--keep-logs", action="store_true", help="keep the work dir with every process's log")
    ap.add_argument("--routes", action="store_true", help="also print where each request went in each run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error(f"--window must be >= 1 (requests in flight at each routing decision), got {args.window}")
    from maru_dynamo.graphs.plan import resolve_model

    model = resolve_model(args.model_size)
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    tmp = tempfile.mkdtemp(prefix="maru-tier2-credit-")
    try:
        comparison, workload = run(model=model, work_dir=Path(tmp), window=args.window, settle_s=args.settle_s, log=log)
    finally:
        if args.keep_logs:
            log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        out = {
            "window": args.window,
            "noise_floor": comparison.noise,
            "off_vs_on": comparison.effect,
            "changes_routing": comparison.changes_routing,
            "runs": [{"setting": s} | r.as_dict() for s, r in comparison.runs],
        }
        print(json.dumps(out, indent=1))
    else:
        print(comparison.report(workload, args.window))
        if args.routes:
            for _, r in comparison.runs:
                print(rc.format_routes(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
