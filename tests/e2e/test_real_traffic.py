"""AIPerf on the real stack: plain Dynamo (dynamo.vllm workers, KV router) against Maru's pool-aware routing.

A short prefix-heavy synthetic trace replayed by AIPerf on fresh graphs of the `medium` fixture,
each worker's KV cache smaller than the traffic's prefixes (as a GPU's is against real traffic).
Asserts only what must hold whatever the machine's speed: every request completes, and with the
pool no more prompt tokens are computed than by plain workers each with its own prefix cache (a
prefix computed on one Maru worker is loaded, never recomputed, on the other); the run reports
the testbed's ratios and a goodput per configuration. Nothing is timed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

REQUESTS = 16


@pytest.fixture(scope="module")
def aiperf() -> Path:
    """AIPerf's own venv, made by the make target when it is missing."""
    from traffic_load import AIPERF_BIN

    if not AIPERF_BIN.exists():
        subprocess.run(["make", "-C", str(ROOT), "aiperf"], check=True, timeout=1200)
    return AIPERF_BIN


def test_pool_aware_routing_computes_no_more_than_plain_dynamo_and_loses_nothing(aiperf: Path, tmp_path: Path) -> None:
    import real_traffic

    out = tmp_path / "traffic.json"
    rc = real_traffic.main(
        [
            "--synthetic",
            "--requests",
            str(REQUESTS),
            "--rate",
            "1.5",
            "--prefixes",
            "2",
            "--synthetic-isl",
            "768",
            "--prefix-ratio",
            "0.75",
            "--configs",
            "plain-kv,maru-pool,lmcache-kv",
            "--model",
            "medium",
            "--kv-cache-tokens",
            "4096",
            "--pool-size",
            "1G",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["requests"] == REQUESTS
    by = {r["config"]: r for r in doc["results"]}
    assert set(by) == {"plain-kv", "maru-pool", "lmcache-kv"}
    for r in by.values():
        assert (r["completed"], r["failed"]) == (REQUESTS, 0), r
        assert r["workers"] == 2
    assert by["plain-kv"]["pool_loaded_tokens"] == 0  # plain dynamo.vllm workers have no pool
    # the peer (plain workers sharing an LMCache server) served every request, and its server
    # left no shared memory behind
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith("maru-bench-lmc-")]
    assert by["maru-pool"]["prefill_tokens"] <= by["plain-kv"]["prefill_tokens"], by
    # the testbed's ratios are measured and reported: 4096 KV tokens per worker (32 blocks of 128),
    # a pool larger than the traffic, and the probe's cold prefill against a pool hit
    assert doc["kv_cache_tokens"] == 4096
    assert doc["unique_prompt_tokens"] > 0 and doc["pool_tokens"] >= doc["unique_prompt_tokens"]
    assert doc["recompute_to_load"] is not None and doc["recompute_to_load"] > 0
    assert {g["config"] for g in doc["goodput"]} == set(by)
    assert all(r["rate"] == 1.5 for r in doc["results"])
    # Every request's prompt is either computed or cached; at least the shared prefixes are reused.
    assert by["maru-pool"]["prefill_tokens"] < REQUESTS * 768
