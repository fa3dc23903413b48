"""`make demo` / `maru-dynamo demo`: the main job on the embedded defaults.

Runs the bundled aggregated graph (`graphs/agg.yaml`: nats-server, the Maru pool, Dynamo's
frontend with the pool-aware KV router, two Maru workers) on the offline `medium` fixture model,
whose prefill costs about what a GPU's does against a pool load (a pool hit replaces a prefill
of 5-20x its time, as on a GPU serving a 32B model from CXL), and shows what the product does:

1. a long prompt goes through the router to one worker, which prefills it and stores its
   chunks in the shared pool;
2. the router now credits the *other* worker with those chunks at the pool tier;
3. the same prompt sent to that other worker is served from the pool (its `cached_tokens`
   cover the prompt) with the same greedy output - nothing was recomputed - in a fraction of
   the prefill's time: the demo prints the ratio, and the same prompt served from that
   worker's own prefix cache for reference.

Then it prints the pool's status and, last, where the two requests' prompt tokens came from (the
workers' token-source counters: computed, local prefix cache, pool, tier 2), and stops everything.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from maru_dynamo.graphs.client import cached_tokens, get_json, prompt_tokens, stream_events
from maru_vllm.launch import ProcessGroup


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run the main job (aggregated graph, cross-worker KV reuse) and stop")
    p.add_argument(
        "--model", default="medium", help="fixture size (tiny, medium, bench) or a model directory (default medium)"
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=8 * 256 + 1,
        help="length of the demo prompt in tokens (default 2049: eight 256-token pool chunks and one token)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the graph's logs")
    p.set_defaults(func=run_demo)


def _post(url: str, payload: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """A streamed completion: ({"text", "usage"}, seconds to its first token). The time to the
    first token is what a prompt's prefill - or its load from a cache - costs the user."""
    t0 = time.monotonic()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    for at, event in stream_events(url, {**payload, "stream_options": {"include_usage": True}}):
        for choice in event.get("choices") or []:
            # a byte-level token can be part of a UTF-8 character: an event with no text yet
            ttft = at - t0 if ttft is None else ttft
            text.append(choice.get("text") or "")
        usage = event.get("usage") or usage
    return {"text": "".join(text), "usage": usage}, (ttft if ttft is not None else time.monotonic() - t0)


def _selected_worker(log_text: str, after: int) -> int | None:
    import re

    lines = [ln for ln in re.sub(r"\x1b\[[0-9;]*m", "", log_text).splitlines() if "Selected worker" in ln]
    if len(lines) <= after:
        return None
    return int(lines[after].split("worker_id=")[1].split()[0])


def _token_sources(plan: Any) -> dict[str, float]:
    """Where the workers' prompt tokens came from so far, read off their /metrics."""
    import urllib.request

    from maru_dynamo.graphs.prometheus import token_sources_text

    texts = []
    for worker in plan.workers:
        with urllib.request.urlopen(worker.metrics_url, timeout=10) as resp:
            texts.append(resp.read().decode())
    return token_sources_text(texts)


def _token_sources_after(plan: Any, before: dict[str, float], sent: int) -> dict[str, float]:
    """The readings once the workers count `sent` more prompt tokens (their metrics follow the
    replies by an engine step), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        now = _token_sources(plan)
        if now["prompt tokens"] - before["prompt tokens"] >= sent or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def run_demo(args: argparse.Namespace) -> int:
    from maru_dynamo.graphs.plan import build_plan, resolve_model
    from maru_dynamo.graphs.run import new_work_dir, start_graph, stop_graph
    from maru_dynamo.graphs.spec import load_graph, resolve_graph_path
    from maru_vllm.pool import PoolClient
    from maru_vllm.pool.cli import format_status

    if args.prompt_tokens < 2:
        raise SystemExit(f"--prompt-tokens={args.prompt_tokens}: use at least 2 tokens")
    spec = load_graph(resolve_graph_path("agg"))
    model = resolve_model(args.model)
    work = new_work_dir()
    plan = build_plan(spec, model=model, work_dir=work)
    print(f"[demo] graph {spec.name}: {len(plan.workers)} Maru workers + pool + KV-router frontend; model {model}")
    print(f"[demo] logs in {work / 'logs'}; starting (each vLLM worker takes ~20 s on CPU) ...", flush=True)
    group = ProcessGroup()
    try:
        start_graph(plan, group)
        frontend = next(p for p in group if p.name == "frontend")
        url = plan.url
        rng = random.Random(7)
        prompt = [rng.randrange(32, 127) for _ in range(args.prompt_tokens)]
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}

        sources_before = _token_sources(plan)
        first, t_first = _post(url, body)
        worker_a = _selected_worker(frontend.log_text(), 0)
        print(
            f"\n[demo] 1. router sent the {len(prompt)}-token prompt to worker {worker_a}: first token after "
            f"{t_first:.2f}s (its prefill), cached_tokens={cached_tokens(first)}"
        )

        pool_address = next(
            a for a in next(p for p in plan.processes if p.name == "pool").argv if a.startswith("unix://")
        )
        with PoolClient.connect(pool_address) as c:
            for _ in range(50):
                if c.stats()["objects"] > 0:
                    break
                time.sleep(0.1)
            stats = c.stats()
        print(f"[demo] 2. the pool now holds {stats['objects']} chunk objects from it")

        health = get_json(f"{url}/health", timeout=10)
        ids = sorted({i["instance_id"] for i in health.get("instances", []) if i.get("endpoint") == "generate"})
        worker_b = next(i for i in ids if i != worker_a)
        on_b = {**body, "nvext": {"backend_instance_id": worker_b}}
        second, t_second = _post(url, on_b)
        same = second["text"] == first["text"]
        print(
            f"[demo] 3. the same prompt on worker {worker_b}, which never saw it: "
            f"cached_tokens={cached_tokens(second)} "
            f"(loaded from the pool), first token after {t_second:.2f}s, same output: {same}"
        )
        print(f"[demo]    output: {second['text']!r}")
        sent = prompt_tokens(first) + prompt_tokens(second)
        sources_after = _token_sources_after(plan, sources_before, sent)
        _, t_local = _post(url, on_b)
        print(
            f"[demo]    recompute-to-load: the prefill took {t_first / t_second:.1f}x as long as the pool hit "
            f"that replaced it; a hit in worker {worker_b}'s own prefix cache now takes {t_local:.2f}s"
        )
        with PoolClient.connect(pool_address) as c:
            print("\n[demo] pool status:\n" + format_status(c.stats()))
        from maru_dynamo.graphs.prometheus import token_sources_line

        line = token_sources_line(sources_before, sources_after)
        print(f"\n[demo] where the two requests' prompt tokens came from: {line}")
        return 0 if same and cached_tokens(second) > 0 else 1
    finally:
        stop_graph(group)
        if not args.keep_logs:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
        print("[demo] stopped")
