"""The two-level topology in the what-if: per-domain pools, with and without a tier-2 under them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from maru_dynamo.components.whatif import domains as D
from maru_dynamo.components.whatif.spec import ClusterSpec
from maru_dynamo.components.whatif.timing import mocker_timing
from maru_dynamo.components.whatif.trace import TraceRequest

SPEC = ClusterSpec(block_size=64, trace_block_size=512, gpu_blocks=200, pool_bytes=10**12)


def _prompt(t: float, ident: int) -> TraceRequest:
    return TraceRequest(t, 8 * 512 + 1, 4, tuple(1000 * ident + i for i in range(9)))


def _trace(rounds: int = 10) -> list[TraceRequest]:
    """Each round: a new prompt P; 5 s later a new prompt Q, then P again right behind it, so P's
    repeat often finds the worker that computed P busy with Q and goes to the other domain."""
    out = []
    for k in range(rounds):
        out.append(_prompt(k * 10_000.0, 2 * k))
        out.append(_prompt(k * 10_000.0 + 5_000, 2 * k + 1))
        out.append(_prompt(k * 10_000.0 + 5_001, 2 * k))
    return out


def _run(config: str, requests: list[TraceRequest], workers: int = 2, domains: int = 2) -> D.DomainsResult:
    return D.replay_domains(requests, SPEC, config, workers, domains, mocker_timing(SPEC), D.Tier2Spec(), seed=3)


def test_a_tier2_lets_a_domain_load_what_another_domain_computed():
    requests = _trace()
    alone = _run(D.KV_DOMAINS, requests)
    tier2 = _run(D.KV_TIER2, requests)
    assert tier2.tier2_hit_tokens > 0 and alone.tier2_hit_tokens == 0
    assert tier2.run.prefill_tokens < alone.run.prefill_tokens
    # one domain: nothing to share across domains, the tier-2 adds nothing
    one = [_run(c, requests, domains=1) for c in (D.KV_DOMAINS, D.KV_TIER2)]
    assert one[0].run.prefill_tokens == one[1].run.prefill_tokens and one[1].tier2_hit_tokens == 0


def test_spill_on_eviction_shares_nothing_while_the_pools_keep_everything():
    requests = _trace()
    spill = _run(D.KV_TIER2_SPILL, requests)
    assert spill.tier2_hit_tokens == 0
    assert spill.run.prefill_tokens == _run(D.KV_DOMAINS, requests).run.prefill_tokens


def test_router_changes_count_decisions_a_tier2_credit_would_flip():
    requests = _trace()
    r = _run(D.KV_TIER2, requests)
    assert r.decisions == len(requests) and 0 <= r.router_changes <= r.decisions
    assert _run(D.KV_DOMAINS, requests).decisions == 0  # no tier-2, nothing to ask


def test_workers_must_split_into_domains():
    with pytest.raises(ValueError, match="do not split"):
        _run(D.KV_TIER2, _trace(1), workers=6, domains=4)


def test_cli_domains_table_and_one_line_errors(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "\n".join(
            f'{{"timestamp": {int(r.timestamp_ms)}, "input_length": {r.input_length}, '
            f'"output_length": {r.output_length}, "hash_ids": {list(r.hash_ids)}}}'
            for r in _trace(3)
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "maru_dynamo.components.main",
        "whatif",
        str(trace),
        "--workers",
        "2",
        "--domains",
        "2",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "kv-domains" in res.stdout and "kv-tier2" in res.stdout
    bad = subprocess.run([*cmd[:-1], "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith("give domain counts like 2,4,8")
