"""Ready means warm, on the real graph: each worker warms its engine up before it registers.

Starts graphs/agg.yaml with graphs/run.py's own start_graph (nats-server, the pool, two Maru
workers, the frontend; ~1 min). Once start_graph returns (the graph is ready), every worker's log
must show its warm-up finished, settled, before `dynamo.vllm` registered the model; Dynamo's
system status server of each worker (DYN_SYSTEM_PORT, what a Kubernetes readiness probe asks)
must not have reported it ready before its warm-up finished; the pool must hold nothing the
warm-up sent, and the first sampled request must be served.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import completions
from maru_dynamo.graphs.plan import build_plan, resolve_model
from maru_dynamo.graphs.run import new_work_dir, start_graph, stop_graph, supervise
from maru_dynamo.graphs.spec import load_graph
from maru_vllm.launch import ProcessGroup
from maru_vllm.pool import PoolClient

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e]

REGISTERED = "Registered base model"  # dynamo.vllm's register_vllm_model publishing the model card
ISO_TIME = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")


def system_ready(url: str) -> bool:
    """Whether a worker's Dynamo system status server reports it ready (/health)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            body = json.loads(resp.read() or b"{}")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return False
    return isinstance(body, dict) and body.get("status") in ("ready", "healthy")


def watch_ready(urls: list[str], first_ready: dict[str, float], stop: threading.Event) -> None:
    """Note, per URL, the wall-clock time it first reported ready."""
    while not stop.is_set():
        for url in urls:
            if url not in first_ready and system_ready(url):
                first_ready[url] = time.time()
        stop.wait(0.1)


def log_time(line: str) -> float:
    m = ISO_TIME.search(line)
    assert m, line
    return datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.timezone.utc).timestamp()


def test_workers_register_only_after_a_settled_warmup() -> None:
    spec = load_graph(ROOT / "graphs" / "agg.yaml")
    model = resolve_model(spec.model)
    work_dir = new_work_dir()
    plan = build_plan(spec, model=model, work_dir=work_dir)
    group = ProcessGroup()
    supervisor = supervise(plan, group)  # only for its /dev/shm clean-up of a stop that had to SIGKILL
    health = {p.name: p.metrics_url.removesuffix("/metrics") + "/health" for p in plan.workers if p.metrics_url}
    assert len(health) == len(plan.workers) == 2
    first_ready: dict[str, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch_ready, args=(list(health.values()), first_ready, stop), daemon=True)
    watcher.start()
    try:
        start_graph(plan, group, supervisor=supervisor)
        for worker in (p for p in group if p.name.startswith("worker:")):
            lines = worker.log_text().splitlines()
            done = [i for i, ln in enumerate(lines) if "maru_worker: warm-up done:" in ln]
            registered = [i for i, ln in enumerate(lines) if REGISTERED in ln]
            assert len(done) == 1 and registered, "\n".join(lines[-60:])
            assert done[0] < registered[0], "registered before the warm-up finished"
            assert "(warm)" in lines[done[0]], lines[done[0]]
            assert "warm-up failed" not in worker.log_text()
            url = health[worker.name]
            deadline = time.monotonic() + 30
            while url not in first_ready and time.monotonic() < deadline:
                time.sleep(0.2)
            assert url in first_ready, f"{url} never reported ready"
            assert first_ready[url] >= log_time(lines[done[0]]), "the system status server said ready before warm"
        pool_socket = next(plan.work_dir.glob("pool-*.sock"))
        with PoolClient.connect(f"unix://{pool_socket}") as client:
            assert client.snapshot() == [], "a warm-up request was stored in the pool"
        out = completions(
            plan.url,
            {"model": model, "prompt": "Ready means warm. " * 4, "max_tokens": 4, "temperature": 1.0},
        )
        assert out["usage"]["completion_tokens"] == 4
    finally:
        stop.set()
        supervisor.watch(force=True)  # the segments the engines opened since they started
        stop_graph(group, supervisor=supervisor)
        shutil.rmtree(work_dir, ignore_errors=True)
