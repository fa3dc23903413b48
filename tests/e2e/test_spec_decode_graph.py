"""Speculative decoding through `graph run` and Dynamo's frontend, on real vLLM CPU engines.

One graph: two Maru workers decoding with vLLM's n-gram proposer, and one with a draft model
(a second random-weight Llama) whose layers vLLM keeps in the KV cache beside the target's.

* n-gram: the proposer keeps no KV, the KV cache is the target model's alone, and the connector
  serves it as without speculation. A prompt of three chunks and one token answered on worker
  A (cold), then on worker B (which loads its three chunks from the pool), then on A again (its
  own prefix cache) gives the same tokens and logprobs all three times, and both workers did
  propose draft tokens.
* draft model: the connector stands aside in one start-up line naming the drafter's layers
  (`engine_support.py`); the worker serves the same tokens without the pool and stores nothing.

Afterwards the pool holds no pin and no reservation.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import cached_tokens, completion, get_json
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch.engine_metrics import metric_total
from maru_vllm.pool import PoolClient
from tests.e2e.conftest import CHUNK, stored_chunks, token_prompt
from tests.e2e.test_disagg_roles import metrics_text, settled
from tests.e2e.test_graph_supervision import GraphRun, cmdline, descendants, environ_of
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
DRAFTS = "vllm:spec_decode_num_drafts_total"


def graph_file(tmp: Path, target: Path, draft: Path) -> Path:
    drafted = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    spec = {
        "name": "maru-spec",
        "model": str(target),
        "pool": {"name": "kv", "size": "256M"},
        "workers": [
            {"name": "ngram", "replicas": 2, "args": ["--speculative-config", json.dumps(NGRAM)]},
            # vLLM CPU's rejection sampler fails on a sampled (top-k) request with a draft model,
            # as the warm-up sends: this worker is asked greedy requests only.
            {"name": "draft", "args": ["--speculative-config", json.dumps(drafted), "--no-maru-warmup"]},
        ],
    }
    path = tmp / "spec.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def answer(out: dict) -> tuple[list[str], list[float]]:
    lp = out["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def worker_metrics(run_pid: int) -> dict[str, str]:
    """speculative method (ngram / draft_model) -> the /metrics URL of each worker using it."""
    urls: dict[str, str] = {}
    for pid in sorted(descendants(run_pid)):
        line = cmdline(pid)
        if "maru_dynamo.components.maru_worker" in line and os.getpgid(pid) == pid:
            method = "draft_model" if "draft_model" in line else "ngram"
            urls[f"{method}-{sum(u.startswith(method) for u in urls)}"] = (
                f"http://127.0.0.1:{environ_of(pid)['DYN_SYSTEM_PORT']}/metrics"
            )
    return urls


def instance_id(worker_log: Path) -> int:
    """The Dynamo instance id a worker registered under, from its log."""
    m = re.search(r"WorkerKvQuery endpoint starting for worker (\d+)", worker_log.read_text(errors="replace"))
    assert m, worker_log
    return int(m.group(1))


@pytest.mark.timeout(900)
def test_speculative_decoding_through_the_frontend(tmp_path: Path) -> None:
    target, draft = ensure_model("tiny"), ensure_model("tiny", seed=1)
    run = GraphRun(str(graph_file(tmp_path, target, draft)))
    work: Path | None = None
    passed = False
    try:
        work = Path(run.wait_line(r"logs in (/\S+)/logs", timeout=60).group(1))
        url = run.wait_line(r"\[graph\] ready: (http://127\.0\.0\.1:\d+) \(3 workers\)", timeout=600).group(1)
        logs = work / "logs"
        metrics = worker_metrics(run.proc.pid)
        assert sorted(metrics) == ["draft_model-0", "ngram-0", "ngram-1"], metrics
        draft_log = next(p for p in logs.glob("worker-draft*.log"))
        stands_aside = [ln for ln in draft_log.read_text(errors="replace").splitlines() if "stands aside" in ln]
        assert len(stands_aside) == 1 and "speculative decoding (draft_model)" in stands_aside[0], stands_aside
        assert re.search(r"keeps 2 drafter layer", stands_aside[0]), stands_aside[0]
        for log in logs.glob("worker-ngram*.log"):
            assert "stands aside" not in log.read_text(errors="replace"), log

        ids = {log.stem.removeprefix("worker-"): instance_id(log) for log in logs.glob("worker-*.log")}
        health = get_json(f"{url}/health")
        assert sorted(i["instance_id"] for i in health["instances"] if i.get("endpoint") == "generate") == sorted(
            ids.values()
        ), (ids, health)
        # A repeating prompt, so that the n-gram proposer finds matches to draft from.
        prompt = (token_prompt(11, 61) * 16)[: 3 * CHUNK + 1]
        pool_address = f"unix://{work}/pool-kv.sock"

        def on(worker: str) -> dict:
            nvext = {"backend_instance_id": ids[worker]}
            return completion(url, str(target), prompt, max_tokens=16, logprobs=1, nvext=nvext)

        drafts_before = {name: metric_total(metrics_text(u), DRAFTS) for name, u in metrics.items()}
        cold = on("ngram-0")
        stored_chunks(pool_address, prompt, range(3))
        pool_hit = on("ngram-1")
        local_hit = on("ngram-0")
        drafted = on("draft-0")
        hits = {"cold": cold, "pool hit": pool_hit, "local hit": local_hit, "draft model": drafted}
        print("[e2e] cached tokens: " + ", ".join(f"{k} {cached_tokens(v)}" for k, v in hits.items()))
        assert [cached_tokens(o) for o in hits.values()] == [0, 3 * CHUNK, 3 * CHUNK, 0]
        for name, out in hits.items():
            assert answer(out) == answer(cold), (name, answer(out), answer(cold))
        drafts = {name: metric_total(metrics_text(u), DRAFTS) - drafts_before[name] for name, u in metrics.items()}
        print(f"[e2e] spec decode: draft proposals per worker {drafts}")
        assert all(n > 0 for n in drafts.values()), drafts
        with PoolClient.connect(pool_address) as c:
            wait_until(lambda: settled(c), 60, what="no pins and no reservations in the pool")
        passed = True
    finally:
        run.stop(work, keep_logs=not passed)
