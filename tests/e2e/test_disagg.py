"""Disaggregated serving through the Maru pool, on the real stack.

The graph a user runs, `graphs/disagg.yaml`, planned and started by graphs/run.py: nats-server,
the pool service (--nats), Dynamo's frontend (--router-mode kv), one prefill Maru worker
(`--disaggregation-mode prefill`, storing inline, core 0) and one decode Maru worker
(`--disaggregation-mode decode`, core 1). The prefill worker stores the prompt's chunks in the
pool; Dynamo hands the decode worker an empty `kv_transfer_params` (Maru is a cache-mediated PD
connector, `maru_dynamo.components.dynamo_pd`), and the decode worker's connector loads the chunks
by block hash while it schedules the same prompt. Each worker stands in for the other role while
that role has no worker (`maru_dynamo.components.disagg`): the checks below run once the graph is
disaggregated, i.e. once no worker serves both roles.

Reference, run before the graph starts: a plain vLLM OpenAI server (no connector) on the decode
worker's core (one OpenMP thread: greedy output and logprobs are bit-exact only with the
same thread count). A 769-token prompt has three 256-token chunks; a pool load leaves one token
to compute, exactly the work of the reference's own local prefix hit (its second request), so
logprobs must match that bit for bit (as float32), and the text must match its cold run too.
(Token strings are not compared: for a partial UTF-8 byte vLLM's server says '' and Dynamo's
frontend says '\ufffd'.)

Then the decode worker is replaced by one whose pool address is unreachable: it still answers,
by local prefill (a decode miss degrades, never fails), with the reference's cold output.

Note: Dynamo's decode handler reports the *prefill* worker's `prompt_tokens_details` in the
response usage, so the decode worker's pool hit is read from its own metrics
(`DYN_SYSTEM_PORT`/metrics: vLLM's external prefix-cache hits and the connector's counters).
"""

from __future__ import annotations

import re
import struct
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import cached_tokens, completion
from maru_vllm.launch import ManagedProcess, ProcessGroup, stack
from maru_vllm.launch.engine_metrics import metric_total, scrape
from maru_vllm.pool import PoolClient
from tests.e2e import planned_graph
from tests.e2e.conftest import CHUNK, stored_chunks, token_prompt
from tests.e2e.test_disagg_roles import disaggregated, sees_live
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT_LEN = 3 * CHUNK + 1  # 769 tokens: three loadable chunks, one token left to compute
MAX_TOKENS = 8
PREFILL_CORE, DECODE_CORE = 0, 1
PREFILL, DECODE = "worker:prefill-0", "worker:decode-0"  # graphs/disagg.yaml's workers
ROOT = Path(__file__).resolve().parents[2]


def metrics(url: str) -> str:
    return scrape(url, timeout=10)


def wait_metric(url: str, name: str, at_least: float, timeout: float = 30.0) -> str:
    """The worker's /metrics once `name` reaches `at_least` (stats arrive with engine outputs)."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(url)
        if metric_total(text, name) >= at_least or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def ask(url: str, model: Path, prompt: list[int]) -> dict:
    return completion(url, str(model), prompt, max_tokens=MAX_TOKENS, logprobs=1)


def tokens(out: dict) -> list[str]:
    return out["choices"][0]["logprobs"]["tokens"]


def logprobs(out: dict) -> list[float]:
    return out["choices"][0]["logprobs"]["token_logprobs"]


def f32(values: list[float]) -> list[float]:
    """Logprobs as float32: vLLM computes them in float32; its server prints them as doubles,
    Dynamo's frontend as float32 (shortest repr), so bit-exact means equal after this."""
    return [struct.unpack("<f", struct.pack("<f", v))[0] for v in values]


def text(out: dict) -> str:
    return out["choices"][0]["text"]


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def selections(frontend: ManagedProcess) -> list[dict[str, str]]:
    """The KV router's `Selected worker` log lines, as key=value dicts."""
    out = []
    for line in ANSI.sub("", frontend.log_text()).splitlines():
        if "Selected worker" in line:
            out.append({k: v.strip('"') for k, v in re.findall(r"(\w+)=(\S+)", line)})
    return out


def pool_stats(address: str) -> dict:
    with PoolClient.connect(address) as c:
        return c.stats()


def serve_when_ready(url: str, model: Path, worker_logs: list[ManagedProcess], timeout: float = 300.0) -> None:
    """Retry a short request until the frontend serves through prefill and decode workers."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        for w in worker_logs:
            if w.proc is not None and w.proc.poll() is not None:
                raise AssertionError(f"{w.name} exited:\n{w.failure_report()}")
        try:
            out = completion(url, str(model), token_prompt(99, 40), max_tokens=2)
            if out["usage"]["completion_tokens"] == 2:
                return
            last = out
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"the disaggregated graph did not serve within {timeout:.0f}s: {last!r}")
        time.sleep(2)


@pytest.mark.timeout(1500)
def test_decode_loads_prefill_kv_from_pool_and_matches_aggregated(
    tiny_model: Path, procs: ProcessGroup, log_dir: Path, tmp_path: Path
) -> None:
    prompt = token_prompt(21, PROMPT_LEN)
    prompt_miss = token_prompt(22, PROMPT_LEN)

    # The reference first, alone, on the decode worker's core (in a group of its own: `procs`
    # holds the graph, which must have no stopped process in it).
    ref_env = stack.StackEnv(discovery_dir=tmp_path / "ref-discovery").build(cpu_thread=DECODE_CORE)
    with ProcessGroup() as ref_group:
        ref_proc, ref_url = stack.vllm_openai_server("reference", tiny_model, ref_env, log_dir)
        ref_group.start(ref_proc)
        ref_proc.wait_for_http(f"{ref_url}/v1/models", timeout=400)
        ref_cold = ask(ref_url, tiny_model, prompt)
        ref_warm = ask(ref_url, tiny_model, prompt)  # local prefix hit: 768 cached, 1 computed
        ref_miss = ask(ref_url, tiny_model, prompt_miss)
        assert ref_proc.stop() is not None
    assert cached_tokens(ref_cold) == 0 and cached_tokens(ref_warm) == 3 * CHUNK
    assert cached_tokens(ref_miss) == 0
    print("reference:", repr(text(ref_cold)), logprobs(ref_warm))

    # The graph users run (graphs/disagg.yaml): prefill on core 0, decode on core 1.
    plan = planned_graph.plan(ROOT / "graphs" / "disagg.yaml", tiny_model, tmp_path / "graph")
    assert [stack.cpu_thread_for(i) for i in (0, 1)] == [PREFILL_CORE, DECODE_CORE]
    graph = planned_graph.start(plan, procs)
    url, frontend, pool_address = graph.url, graph["frontend"], graph.pool_address()
    prefill, decode = graph[PREFILL], graph[DECODE]
    prefill_metrics, decode_metrics = plan.process(PREFILL).metrics_url, plan.process(DECODE).metrics_url
    assert prefill_metrics and decode_metrics
    serve_when_ready(url, tiny_model, [prefill, decode], timeout=400)
    # Disaggregated, and the prefill worker's decode stand-in passes what it gets on to the decode worker.
    wait_until(lambda: disaggregated(url) and sees_live(prefill.log_text(), "decode"), 60, what="disaggregated")

    # The frontend found the prefill worker (component "prefill", WorkerType.Prefill).
    assert "Prefill worker detected" in frontend.log_text()

    before = pool_stats(pool_address)
    decode_before = metrics(decode_metrics)
    n_selected = len(selections(frontend))
    out = ask(url, tiny_model, prompt)
    after = pool_stats(pool_address)
    print("disagg:", repr(text(out)), logprobs(out), "usage:", out["usage"])
    # One request, routed to the prefill worker and then to the decode worker.
    frontend.wait_until(lambda: len(selections(frontend)) >= n_selected + 2, 10, "two Selected worker lines")
    routed = selections(frontend)[n_selected:]
    assert {r["worker_type"] for r in routed} == {"prefill", "decode"}, routed
    assert len({r["request_id"] for r in routed}) == 1, routed

    # The prefill worker stored the prompt's three full chunks; the decode worker stores nothing.
    assert sorted(stored_chunks(pool_address, prompt, range(3))) == [0, 1, 2]
    assert after["stores"] - before["stores"] == 3, (before, after)
    # ... and the decode worker found and loaded them (the prefill worker had nothing to load).
    assert after["hits"] - before["hits"] >= 3, (before, after)
    hits_name = "vllm:external_prefix_cache_hits_total"
    loaded_name = "vllm:maru_connector_chunks_loaded_total"
    dm = wait_metric(decode_metrics, loaded_name, metric_total(decode_before, loaded_name) + 3)
    decode_loaded = metric_total(dm, loaded_name) - metric_total(decode_before, loaded_name)
    decode_external_hits = metric_total(dm, hits_name) - metric_total(decode_before, hits_name)
    pm = metrics(prefill_metrics)
    print(
        f"pool: stores +{after['stores'] - before['stores']} hits +{after['hits'] - before['hits']}; "
        f"decode: chunks loaded +{decode_loaded}, external prefix-cache hit tokens +{decode_external_hits}; "
        f"prefill: chunks stored {metric_total(pm, 'vllm:maru_connector_chunks_stored_total')}"
    )
    assert decode_loaded == 3
    assert metric_total(dm, "vllm:maru_connector_chunks_stored_total") == 0  # it computed no whole chunk
    assert decode_external_hits == 3 * CHUNK
    assert metric_total(pm, "vllm:maru_connector_chunks_stored_total") >= 3
    assert metric_total(pm, loaded_name) == 0

    # Same output as the aggregated engine: bit-exact against its local prefix hit.
    assert out["usage"]["prompt_tokens"] == PROMPT_LEN
    assert out["usage"]["completion_tokens"] == MAX_TOKENS
    assert text(out) == text(ref_cold) == text(ref_warm)
    assert len(tokens(out)) == MAX_TOKENS
    assert f32(logprobs(out)) == f32(logprobs(ref_warm))

    # A decode worker that cannot reach the pool still answers: local prefill, same output.
    assert decode.stop() is not None
    missing = f"unix:///tmp/maru-absent-{uuid.uuid4().hex[:8]}.sock"
    argv = list(plan.process(DECODE).argv)
    argv[argv.index("--maru-pool-address") + 1] = missing
    decode2 = graph.start(DECODE, name="worker:decode-nopool", argv=tuple(argv))  # same port, env, core
    serve_when_ready(url, tiny_model, [prefill, decode2])
    wait_until(lambda: disaggregated(url) and sees_live(prefill.log_text(), "decode"), 60, what="disaggregated")
    before = pool_stats(pool_address)
    d2_before = metrics(decode_metrics)
    out_miss = ask(url, tiny_model, prompt_miss)
    after = pool_stats(pool_address)
    # The prefill worker still stored the chunks; the decode worker could not fetch them.
    assert sorted(stored_chunks(pool_address, prompt_miss, range(3))) == [0, 1, 2]
    assert after["hits"] == before["hits"], (before, after)
    d2 = wait_metric(
        decode_metrics, "vllm:prompt_tokens_total", metric_total(d2_before, "vllm:prompt_tokens_total") + PROMPT_LEN
    )
    assert metric_total(d2, loaded_name) == 0
    assert metric_total(d2, hits_name) == 0
    print(
        "decode without pool:",
        repr(text(out_miss)),
        logprobs(out_miss),
        "usage:",
        out_miss["usage"],
        "reference:",
        logprobs(ref_miss),
    )
    assert "serving without the pool cache" in decode2.log_text()  # the connector saw the pool down
    assert out_miss["usage"]["completion_tokens"] == MAX_TOKENS
    assert text(out_miss) == text(ref_miss)
    assert f32(logprobs(out_miss)) == f32(logprobs(ref_miss))  # same work: a full 769-token prefill
