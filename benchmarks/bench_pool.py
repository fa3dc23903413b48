#!/usr/bin/env python3
"""Benchmark the Maru KV pool: op latency and data-path bandwidth vs an in-process memcpy.

Starts a real pool service (`python -m maru_vllm.pool serve`) on a private unix socket and a
/dev/shm region, then measures from one client process:

* latency (p50/p99) of lookup (1 key and a 64-key batch), put (reserve + copy + commit) and
  get (acquire + copy out + release) round trips for a 4 KiB object;
* the connector's scheduler lookup (`lookup_prefix` of 8 chunk keys, then `lookup_parts` of 15
  part keys) asked of the service and answered from the region's presence table, idle and with
  `--busy N` processes spinning on the cores (what engines do to the service's replies), printed
  as the ratio service / table;
* bandwidth of put and get for 1-64 MiB objects, printed as a ratio to a plain in-process
  memcpy of the same number of bytes between two already-touched buffers, measured in the
  same run. put/get include their control round trips, so the ratio shows what the pool
  costs on top of the unavoidable copy.

Usage: python benchmarks/bench_pool.py [--size 1G] [--iters 2000] [--busy 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from maru_vllm.launch.stack import PoolProcess  # noqa: E402
from maru_vllm.pool import PoolClient  # noqa: E402

MiB = 1 << 20


def start_service(size: str, work: Path) -> PoolProcess:
    pool = PoolProcess(
        f"bench-{uuid.uuid4().hex[:8]}",
        size,
        work / "pool.log",
        listen=[f"unix://{work}/pool.sock"],
        extra_args=["--log-level", "WARNING"],
    )
    return pool.serve()


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def latency(c: PoolClient, iters: int) -> dict[str, dict[str, float]]:
    out = {}
    obj = os.urandom(4096)
    keys64 = [b"lat-%d" % i for i in range(64)]
    for k in keys64:
        c.put(k, obj)
    sink = memoryview(bytearray(4096))

    def measure(name, fn):
        for _ in range(min(200, iters)):
            fn(0)
        t = []
        for i in range(iters):
            t0 = time.perf_counter()
            fn(i)
            t.append(time.perf_counter() - t0)
        out[name] = {"p50_us": pct(t, 0.5) * 1e6, "p99_us": pct(t, 0.99) * 1e6}

    measure("lookup 1 key", lambda i: c.lookup([b"lat-1"]))
    measure("lookup 64 keys", lambda i: c.lookup(keys64))
    measure("lookup_prefix 64 keys", lambda i: c.lookup_prefix(keys64))
    n = iter(range(10**9))
    measure("put 4 KiB (reserve+copy+commit)", lambda i: c.put(b"p-%d" % next(n), obj))

    def get(i):
        with c.get(b"lat-7") as v:
            sink[:] = v

    measure("get 4 KiB (acquire+copy+release)", get)
    return out


def bandwidth(c: PoolClient, sizes_mib: list[int], reps: int) -> list[dict[str, float]]:
    rows = []
    for mib in sizes_mib:
        n = mib * MiB
        src = bytearray(os.urandom(n))
        dst = bytearray(n)
        dst_view = memoryview(dst)  # memoryview-to-memoryview assignment is a plain memcpy
        dst_view[:] = src  # touch both
        memcpy_t, put_t, get_t = [], [], []
        for r in range(reps):
            t0 = time.perf_counter()
            dst_view[:] = src
            memcpy_t.append(time.perf_counter() - t0)
            key = b"bw-%d-%d" % (mib, r)
            t0 = time.perf_counter()
            ok = c.put(key, src)
            put_t.append(time.perf_counter() - t0)
            if not ok:
                raise SystemExit(f"put of {mib} MiB failed")
            t0 = time.perf_counter()
            with c.get(key) as v:
                dst_view[:] = v
            get_t.append(time.perf_counter() - t0)
            with c.get(key) as v:  # verify outside the timed part (dst already held src)
                if v is None or bytes(v) != src:
                    raise SystemExit(f"{mib} MiB object read back differently")
        m, p, g = (statistics.median(x) for x in (memcpy_t, put_t, get_t))
        rows.append(
            {
                "size_mib": mib,
                "memcpy_gbps": n / m / 1e9,
                "put_gbps": n / p / 1e9,
                "get_gbps": n / g / 1e9,
                "put_ratio": m / p,
                "get_ratio": m / g,
            }
        )
    return rows


def _spin(stop: multiprocessing.synchronize.Event) -> None:
    while not stop.is_set():
        sum(range(10_000))


def scheduler_lookups(c: PoolClient, address: str, iters: int, busy: int) -> dict[str, dict[str, float]]:
    """The connector's two scheduler lookups, service vs presence table, idle and busy."""
    chunks = [b"sched-%d" % i for i in range(8)]
    parts = [b"sched-part-%d" % i for i in range(15)]
    for k in chunks:
        c.put(k, b"x" * 4096, "sched", parts=parts if k == chunks[-1] else None)
    out: dict[str, dict[str, float]] = {}
    with PoolClient.connect(address, local_lookups=True) as local:
        assert local.lookup_prefix(chunks, "sched") == 8 == c.lookup_prefix(chunks, "sched")
        assert local.lookup_parts(parts, "sched") == c.lookup_parts(parts, "sched") == list(range(1, 16))
        for load in (0, busy) if busy else (0,):
            stop = multiprocessing.Event()
            spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(load)]
            for sp in spinners:
                sp.start()
            try:
                for name, client in (("service", c), ("presence table", local)):
                    t = []
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        client.lookup_prefix(chunks, "sched")
                        client.lookup_parts(parts, "sched")
                        t.append(time.perf_counter() - t0)
                    out[f"scheduler lookup, {name}, {load} busy"] = {
                        "p50_us": pct(t, 0.5) * 1e6,
                        "p90_us": pct(t, 0.9) * 1e6,
                        "p99_us": pct(t, 0.99) * 1e6,
                    }
            finally:
                stop.set()
                for sp in spinners:
                    sp.join(10)
        assert local.lookups_asked == 0, "every table lookup was answered without the service"
    return out


def warm_region(c: PoolClient, size_bytes: int) -> None:
    chunk = bytes(64 * MiB)
    for i in range(size_bytes // (64 * MiB) + 2):
        c.put(b"warm-%d" % i, chunk)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G", help="pool size (default 1G)")
    ap.add_argument("--iters", type=int, default=2000, help="latency samples per op")
    ap.add_argument("--reps", type=int, default=7, help="bandwidth repetitions per size")
    ap.add_argument("--sizes", default="1,4,16,64", help="object sizes in MiB")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="spinning processes for the busy lookups")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mpb-", dir="/tmp"))
    pool = start_service(args.size, work)
    try:
        with PoolClient.connect(pool.address) as c:
            warm_region(c, c.stats()["capacity_bytes"])
            lat = latency(c, args.iters)
            sched = scheduler_lookups(c, pool.address, args.iters, args.busy)
            bw = bandwidth(c, [int(s) for s in args.sizes.split(",")], args.reps)
            st = c.stats()
    finally:
        pool.stop()
        shutil.rmtree(work, ignore_errors=True)
        pool.region_path.unlink(missing_ok=True)
    if args.json:
        print(
            json.dumps(
                {"latency": lat, "scheduler_lookups": sched, "bandwidth": bw, "evictions": st["evictions"]}, indent=2
            )
        )
        return 0
    print(f"maru pool benchmark  (pool {args.size} on /dev/shm, unix socket, {os.cpu_count()} CPUs)")
    print("\nop latency (client-observed round trip)")
    print(f"  {'op':<36}{'p50 us':>10}{'p99 us':>10}")
    for op, v in lat.items():
        print(f"  {op:<36}{v['p50_us']:>10.1f}{v['p99_us']:>10.1f}")
    print("\nscheduler lookup (lookup_prefix of 8 chunk keys + lookup_parts of 15 part keys)")
    print(f"  {'asked of':<36}{'p50 us':>10}{'p90 us':>10}{'p99 us':>10}")
    for op, v in sched.items():
        print(
            f"  {op.removeprefix('scheduler lookup, '):<36}{v['p50_us']:>10.1f}{v['p90_us']:>10.1f}{v['p99_us']:>10.1f}"
        )
    for load in sorted({int(k.rsplit(", ", 1)[1].split()[0]) for k in sched}):
        svc, tbl = (
            sched[f"scheduler lookup, service, {load} busy"],
            sched[f"scheduler lookup, presence table, {load} busy"],
        )
        print(
            f"  {load} busy: service / table = {svc['p50_us'] / tbl['p50_us']:.1f}x at p50,"
            f" {svc['p99_us'] / tbl['p99_us']:.1f}x at p99"
        )
    print("\ndata path bandwidth (median of reps; ratio = pool / in-process memcpy of the same bytes)")
    print(f"  {'size':>6}{'memcpy GB/s':>13}{'put GB/s':>10}{'put ratio':>11}{'get GB/s':>10}{'get ratio':>11}")
    for r in bw:
        print(
            f"  {r['size_mib']:>4}Mi{r['memcpy_gbps']:>13.2f}{r['put_gbps']:>10.2f}{r['put_ratio']:>11.2f}"
            f"{r['get_gbps']:>10.2f}{r['get_ratio']:>11.2f}"
        )
    print(f"\n(evictions during the run: {st['evictions']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
