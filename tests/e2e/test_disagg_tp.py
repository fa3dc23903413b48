"""A disaggregated graph with a TP size per role: `graph run graphs/disagg-tp.yaml` under streaming load.

Prefill at TP 1 stores every prompt chunk in the pool (one object per chunk, both KV heads);
decode at TP 2 (vLLM's mp executor, a core per rank) reads each rank's KV head out of those
objects. Streaming load - 48 greedy completions of 48 tokens, 6 in flight, prompts sharing four
768-token prefixes - through Dynamo's frontend:

* every request completes in full;
* of the whole-chunk prompt tokens the decode worker did not hold in its own prefix cache, at least
  90% came from the pool (vLLM's `prompt_tokens_by_source` on the decode worker's metrics), not
  counting the chunks whose store the prefill worker gave up (a store is skipped when a pool call
  passes its deadline, which busy cores can make happen: the decode worker then computes that
  chunk, correctly); it stores only what it computed;
* afterwards the pool holds no pin and no reservation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from maru_vllm.launch.engine_metrics import metric_total
from maru_vllm.pool import PoolClient
from tests.e2e.streaming_load import Load
from tests.e2e.test_disagg_roles import (
    MAX_TOKENS,
    OTHER,
    PREFIX_TOKENS,
    REQUESTS,
    THREADS,
    disaggregated,
    lines,
    metrics_text,
    prompt,
    role_leaders,
    sees_live,
    settled,
    settled_log,
    verdict,
)
from tests.e2e.test_graph_supervision import GraphRun, environ_of
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHUNK = 256
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
STORE_FAILURES = "vllm:maru_connector_store_failures_total"
DECODE_RANKS = 2


def by_source(text: str, source: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(BY_SOURCE + "{") and f'source="{source}"' in line
    )


@pytest.mark.timeout(1200)
def test_prefill_tp1_decode_tp2_under_streaming_load(tiny_model: Path) -> None:
    run = GraphRun("graphs/disagg-tp.yaml")
    work: Path | None = None
    passed = False
    try:
        work = Path(run.wait_line(r"logs in (/\S+)/logs", timeout=60).group(1))
        url = run.wait_line(r"\[graph\] ready: (http://127\.0\.0\.1:\d+) \(2 workers\)", timeout=900).group(1)
        logs = work / "logs"
        log_of = {role: logs / f"worker-{role}-0.log" for role in OTHER}
        wait_until(lambda: all(lines(log_of[r], "stands by for the") for r in OTHER), 120, what="stand-ins ready")
        wait_until(
            lambda: (
                disaggregated(url)
                and all(sees_live(log_of[r].read_text(errors="replace"), OTHER[r]) for r in OTHER)
                and settled_log(logs / "frontend.log")
            ),
            120,
            what="each role served by its own worker, the stand-ins forwarding",
        )
        leaders = role_leaders(run.proc.pid)
        decode = f"http://127.0.0.1:{environ_of(leaders['decode'])['DYN_SYSTEM_PORT']}/metrics"
        prefill = f"http://127.0.0.1:{environ_of(leaders['prefill'])['DYN_SYSTEM_PORT']}/metrics"
        before = metrics_text(decode)
        prefill_before = metrics_text(prefill)

        results = Load(url, str(tiny_model), prompt, MAX_TOKENS, threads=THREADS, requests=REQUESTS).start().wait()
        counts = verdict(results)
        assert counts["complete"] == REQUESTS, counts

        def counted() -> str | None:
            text = metrics_text(decode)
            return text if by_source(text, "local_compute") > by_source(before, "local_compute") else None

        after = wait_until(counted, 60, what="the decode worker's prompt-token counters")
        external = by_source(after, "external_kv_transfer") - by_source(before, "external_kv_transfer")
        local_hit = by_source(after, "local_cache_hit") - by_source(before, "local_cache_hit")
        whole = REQUESTS * (PREFIX_TOKENS // CHUNK) * CHUNK
        computed_whole = max(0.0, whole - external - local_hit)
        failed = STORE_FAILURES
        not_stored = (metric_total(metrics_text(prefill), failed) - metric_total(prefill_before, failed)) * CHUNK
        there = external + computed_whole - min(not_stored, computed_whole)  # what the pool held
        share = external / there if there else 0.0
        stored = metric_total(after, "vllm:maru_connector_chunks_stored_total") - metric_total(
            before, "vllm:maru_connector_chunks_stored_total"
        )
        print(
            f"[e2e] decode TP 2: {counts['complete']}/{REQUESTS} complete; whole-chunk tokens {whole}: "
            f"{external:.0f} from the pool, {local_hit:.0f} own prefix cache, {computed_whole:.0f} computed "
            f"({share:.1%} of those the pool held loaded; the prefill worker's failed stores: "
            f"{not_stored / CHUNK:.0f} chunks); chunks stored {stored:.0f}"
        )
        assert share >= 0.9
        assert stored * CHUNK <= DECODE_RANKS * computed_whole  # each rank stores only chunks it computed

        with PoolClient.connect(f"unix://{work}/pool-kv.sock") as c:
            wait_until(lambda: settled(c), 60, what="no pins and no reservations in the pool")
        passed = True
    finally:
        run.stop(work, keep_logs=not passed)
