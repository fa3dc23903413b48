"""A disaggregated graph that loses a role keeps serving: `graph run graphs/disagg.yaml` under load.

One real graph (nats-server, the pool, one prefill and one decode Maru worker, the frontend) and,
for each role in turn, streaming load - 48 greedy completions of 48 tokens, 6 in flight, prompts
sharing four 768-token prefixes - with that role's worker SIGKILLed (its whole process tree) a
quarter of the way in:

* the other worker takes the lost role over through its stand-in for that role, which is in
  discovery all along and passes what it gets on to a live worker of the role: once none answers
  it serves on its own engine - a decode worker's prefill stand-in prefills, a prefill worker's
  decode stand-in decodes and finishes the streams it was relaying from the dead decode worker -
  and it takes the frontend's retries of requests that failed on the dead worker. Its log says
  so once, the frontend's too, and it counts what it served
  (`maru_disagg_standby_requests_total`);
* every request completes in full: none ends with an error, none is a short completion behind an
  HTTP 200;
* a request served while the role is missing gives the same greedy tokens as the disaggregated
  path gave before;
* the graph restarts the killed worker; once it is up the other worker hands the role back
  (logged once, by the worker and the frontend) and the frontend's view is disaggregated again;
  requests give the same tokens as before;
* afterwards the pool holds no pin and no reservation.

A second graph has two prefill workers (the chart's replicas): one of them SIGKILLed under the same
load costs nothing - its requests move to the other prefill worker, and nobody stands in.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from maru_dynamo.components.disagg.view import RoleView
from maru_dynamo.graphs.client import completion, get_json
from maru_vllm.launch.engine_metrics import metric_total
from maru_vllm.pool import PoolClient
from tests.e2e.conftest import token_prompt
from tests.e2e.streaming_load import Load, StreamResult
from tests.e2e.test_graph_run import cmdline, descendants
from tests.e2e.test_graph_supervision import GraphRun, environ_of
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

REQUESTS, THREADS, MAX_TOKENS = 48, 6, 48
PREFIX_TOKENS, SUFFIX_TOKENS, PREFIXES = 768, 16, 4
PREFIX = [token_prompt(700 + p, PREFIX_TOKENS) for p in range(PREFIXES)]
STANDBY_REQUESTS = "maru_disagg_standby_requests_total"
OTHER = {"prefill": "decode", "decode": "prefill"}


def prompt(i: int) -> list[int]:
    return PREFIX[i % PREFIXES] + token_prompt(9000 + i, SUFFIX_TOKENS)


def probes() -> list[list[int]]:
    """Prompts the load never sends, for the token check (same prefixes, their own tails)."""
    return [PREFIX[p] + token_prompt(8000 + p, SUFFIX_TOKENS) for p in range(2)]


def role_leaders(run_pid: int) -> dict[str, int]:
    """prefill / decode -> the pid of that role's (first) worker's leader process."""
    return {role: pids[0] for role, pids in sorted(all_leaders(run_pid).items())}


def all_leaders(run_pid: int) -> dict[str, list[int]]:
    """prefill / decode -> the pids of every worker leader process of that role."""
    leaders: dict[str, list[int]] = {}
    for pid in sorted(descendants(run_pid)):
        line = cmdline(pid)
        if "maru_dynamo.components.maru_worker" in line and os.getpgid(pid) == pid:
            mode = re.search(r"--disaggregation-mode (\w+)", line)
            assert mode is not None, line
            leaders.setdefault(mode.group(1), []).append(pid)
    return leaders


def metrics_text(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def answer(url: str, model: str, tokens: list[int]) -> tuple[str, list[float]]:
    out = completion(url, model, tokens, max_tokens=16, logprobs=1)
    choice = out["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def role_view(url: str) -> RoleView:
    return RoleView.from_health(get_json(f"{url}/health"))


def sees_live(log: str, role: str) -> bool:
    """Whether a worker's log says that it sees a live worker of `role` (its latest count)."""
    counts = re.findall(rf"maru_worker: (\d+) live {role} worker\(s\)", log)
    return bool(counts) and int(counts[-1]) > 0


def settled_log(frontend_log: Path) -> bool:
    """Whether the frontend's role log is not left saying degraded: a graph whose workers start a
    moment apart can be degraded for that moment, and the log, read every second, says so late."""
    said = lines(frontend_log, "disaggregation")
    return not said or RESTORED in said[-1]


def disaggregated(url: str) -> RoleView | None:
    """The frontend's view once both roles have workers and neither is stood in for; else None."""
    view = role_view(url)
    return view if view.state() == "disaggregated" else None


def settled(client: PoolClient) -> dict | None:
    """The pool's stats once it holds no pin and no reservation; else None."""
    stats = client.stats()
    return None if stats.get("pinned") or stats.get("pins") or stats.get("reserved") else stats


DEGRADED, RESTORED = "disaggregation degraded", "disaggregation restored"


def count(path: Path, text: str) -> int:
    return len(lines(path, text))


def lines(path: Path, text: str) -> list[str]:
    return [line for line in path.read_text(errors="replace").splitlines() if text in line]


def verdict(results: list[StreamResult]) -> dict[str, int]:
    out = {"complete": 0, "error event": 0, "error status": 0, "short 200": 0}
    for r in results:
        if r.complete(MAX_TOKENS):
            out["complete"] += 1
        elif r.status == 200 and r.error is not None:
            out["error event"] += 1
        elif r.status != 200:
            out["error status"] += 1
        else:
            out["short 200"] += 1
    return out


@pytest.mark.timeout(2400)
def test_disagg_graph_survives_losing_each_role(tiny_model: Path) -> None:
    run = GraphRun("graphs/disagg.yaml")
    work: Path | None = None
    passed = False
    try:
        work = Path(run.wait_line(r"logs in (/\S+)/logs", timeout=60).group(1))
        url = run.wait_line(r"\[graph\] ready: (http://127\.0\.0\.1:\d+) \(2 workers\)", timeout=900).group(1)
        model = str(tiny_model)
        logs = work / "logs"
        log_of = {role: logs / f"worker-{role}-0.log" for role in OTHER}
        frontend_log = logs / "frontend.log"
        leaders = role_leaders(run.proc.pid)
        assert set(leaders) == {"prefill", "decode"}, leaders
        metrics = {r: f"http://127.0.0.1:{environ_of(pid)['DYN_SYSTEM_PORT']}/metrics" for r, pid in leaders.items()}
        wait_until(lambda: all(lines(log_of[r], "stands by for the") for r in OTHER), 120, what="stand-ins ready")
        wait_until(
            lambda: (
                disaggregated(url)
                and all(sees_live(log_of[r].read_text(errors="replace"), OTHER[r]) for r in OTHER)
                and settled_log(frontend_log)
            ),
            60,
            what="each worker's stand-in forwarding to the other, and the frontend's log caught up",
        )
        reference = [answer(url, model, p) for p in probes()]  # through the disaggregated path

        for role in ("prefill", "decode"):
            # (A worker up before the other role's first worker stood in at the start: counts, not lines.)
            other_log = log_of[OTHER[role]]
            said = {(log, text): count(log, text) for log in (other_log, frontend_log) for text in (DEGRADED, RESTORED)}
            kill_under_load(run, url, model, role, leaders, metrics, other_log, reference)
            # The graph restarts the killed worker; the stand-in leaves once it is up, and each log says
            # so once.
            run.wait_line(rf"\[graph\] worker:{role}-0 restarted \(pid \d+, restart 1\)", timeout=120)
            for log in (other_log, frontend_log):
                before = said[(log, RESTORED)]
                wait_until(
                    lambda log=log, n=before: count(log, RESTORED) > n, 600, interval=1, what=f"{log.name} restored"
                )
                assert count(log, DEGRADED) == said[(log, DEGRADED)] + 1, lines(log, "disaggregation")
                assert count(log, RESTORED) == said[(log, RESTORED)] + 1, lines(log, "disaggregation")
            leaders = role_leaders(run.proc.pid)
            metrics[role] = f"http://127.0.0.1:{environ_of(leaders[role])['DYN_SYSTEM_PORT']}/metrics"
            view = wait_until(lambda: disaggregated(url), 60, what="disaggregated again")
            print(f"[e2e] {role} back: workers listed { ({r: len(ids) for r, ids in view.workers.items()}) }")
            assert [answer(url, model, p)[0] for p in probes()] == [t for t, _ in reference]

        with PoolClient.connect(f"unix://{work}/pool-kv.sock") as c:
            stats = wait_until(lambda: settled(c), 60, what="no pins and no reservations in the pool")
        print(f"[e2e] pool after: { ({k: stats.get(k) for k in ('objects', 'pinned', 'pins', 'reserved')}) }")
        passed = True
    finally:
        run.stop(work, keep_logs=not passed)


def kill_under_load(
    run: GraphRun,
    url: str,
    model: str,
    role: str,
    leaders: dict[str, int],
    metrics: dict[str, str],
    other_log: Path,
    reference: list[tuple[str, list[float]]],
) -> None:
    """The load, with `role`'s worker SIGKILLed a quarter in; checks what the clients got."""
    other = OTHER[role]
    served_before = metric_total(metrics_text(metrics[other]), STANDBY_REQUESTS)
    degraded, restored = count(other_log, DEGRADED), count(other_log, RESTORED)
    load = Load(url, model, prompt, MAX_TOKENS, threads=THREADS, requests=REQUESTS).start()
    wait_until(lambda: load.done() >= REQUESTS // 4, 600, interval=0.1, what="a quarter of the load done")
    t_kill = time.monotonic()
    os.killpg(leaders[role], signal.SIGKILL)
    wait_until(lambda: count(other_log, DEGRADED) > degraded, 60, what=f"{other} stands in")
    t_degraded = time.monotonic()
    results = load.wait()
    t_load = time.monotonic()
    counts = verdict(results)
    served = metric_total(metrics_text(metrics[other]), STANDBY_REQUESTS) - served_before
    same = None
    if count(other_log, RESTORED) == restored:
        # The load ended before the killed worker was back: requests are still served in fallback mode.
        same = [answer(url, model, p) for p in probes()]
        if count(other_log, RESTORED) > restored:
            same = None  # restored while they ran: they may have been served either way
    print(
        f"\n[e2e] {role} killed: {counts} of {len(results)}; {other} stood in after {t_degraded - t_kill:.2f} s "
        f"and served {served:.0f} request(s) for the {role} role; the load ended {t_load - t_kill:.1f} s after "
        f"the kill; fallback tokens checked: {same is not None}"
    )
    short = [r for r in results if r.status == 200 and r.error is None and not r.complete(MAX_TOKENS)]
    assert not short, f"requests cut short without an error event: {short[:5]}"
    failed = [r for r in results if not r.complete(MAX_TOKENS)]
    assert not failed, f"requests that did not complete: {failed[:5]}\n{run.text()[-3000:]}"
    assert served > 0, f"the {other} worker served nothing for the {role} role"
    if same is not None:
        assert [t for t, _ in same] == [t for t, _ in reference], (same, reference)


@pytest.mark.timeout(1500)
def test_one_of_two_prefill_workers_lost_moves_its_requests(tiny_model: Path, tmp_path: Path) -> None:
    graph = tmp_path / "disagg-2p.yaml"
    text = (ROOT / "graphs" / "disagg.yaml").read_text()
    graph.write_text(text.replace("role: prefill\n    replicas: 1", "role: prefill\n    replicas: 2", 1))
    run = GraphRun(str(graph))
    work: Path | None = None
    passed = False
    try:
        work = Path(run.wait_line(r"logs in (/\S+)/logs", timeout=60).group(1))
        url = run.wait_line(r"\[graph\] ready: (http://127\.0\.0\.1:\d+) \(3 workers\)", timeout=900).group(1)
        model = str(tiny_model)
        logs = work / "logs"
        leaders = all_leaders(run.proc.pid)
        assert len(leaders["prefill"]) == 2 and len(leaders["decode"]) == 1, leaders
        decode_metrics = f"http://127.0.0.1:{environ_of(leaders['decode'][0])['DYN_SYSTEM_PORT']}/metrics"
        wait_until(lambda: disaggregated(url), 120, what="a disaggregated graph")
        said = [count(logs / name, DEGRADED) for name in ("worker-decode-0.log", "frontend.log")]
        served_before = metric_total(metrics_text(decode_metrics), STANDBY_REQUESTS)
        load = Load(url, model, prompt, MAX_TOKENS, threads=THREADS, requests=REQUESTS).start()
        wait_until(lambda: load.done() >= REQUESTS // 4, 600, interval=0.1, what="a quarter of the load done")
        os.killpg(leaders["prefill"][0], signal.SIGKILL)
        results = load.wait()
        counts = verdict(results)
        served = metric_total(metrics_text(decode_metrics), STANDBY_REQUESTS) - served_before
        print(
            f"\n[e2e] one of two prefill workers killed: {counts} of {len(results)}; "
            f"the decode worker's stand-in served {served:.0f}"
        )
        assert counts["complete"] == REQUESTS, counts
        assert served == 0  # nobody stood in: a prefill worker was left
        assert [count(logs / name, DEGRADED) for name in ("worker-decode-0.log", "frontend.log")] == said
        run.wait_line(r"\[graph\] worker:prefill-\d restarted \(pid \d+, restart 1\)", timeout=120)
        passed = True
    finally:
        run.stop(work, keep_logs=not passed)
