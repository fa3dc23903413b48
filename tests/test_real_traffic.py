"""The real-traffic benchmark's parts that need no stack: traffic scaling, synthetic prefixes,
AIPerf's export, the configurations' graphs, and one-line refusals of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from maru_dynamo.graphs.plan import build_plan
from maru_dynamo.graphs.spec import GraphSpecError, parse_graph

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_traffic  # noqa: E402
import traffic_load as T  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "real_traffic.py"


def _req(ts: float, n_in: int, n_out: int, ids: list[int]) -> T.TraceRequest:
    return T.TraceRequest(ts, n_in, n_out, tuple(ids))


def test_scaling_keeps_each_input_inside_its_hash_blocks_and_divides_arrival_gaps() -> None:
    raw = [_req(1000, 1024, 512, [0, 1]), _req(3000, 513, 100, [0, 2]), _req(5000, 1500, 20, [3, 4, 5])]
    t = T.scale_trace(raw, name="x", block_tokens=16, speedup=2.0, max_output=8)
    assert [r.input_length for r in t.requests] == [32, 17, 47]  # 2, 2 and 3 blocks of 16
    assert [r.output_length for r in t.requests] == [8, 4, 4]  # scaled by 16/512, kept within 4..8
    assert [r.timestamp_ms for r in t.requests] == [0.0, 1000.0, 2000.0]
    assert [r.hash_ids for r in t.requests] == [(0, 1), (0, 2), (3, 4, 5)]
    # Block 0 is shared: an ideal cache computes it once (16 + 16 + 16 + 47).
    assert t.unique_prefix_tokens() == 16 + 16 + 1 + 47


def test_scaling_drops_requests_longer_than_the_context_and_counts_them() -> None:
    raw = [_req(0, 512, 10, [0]), _req(1, 512 * 300, 10, list(range(1, 301)))]
    t = T.scale_trace(raw, name="x", block_tokens=16, max_total=4096)
    assert len(t.requests) == 1 and t.dropped_too_long == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_tokens": 0}, "--trace-block-size 0: use 1 to 512 tokens per hash id"),
        ({"block_tokens": 16, "speedup": 0.0}, "--speedup 0.0: use a number > 0"),
    ],
)
def test_scaling_refuses_bad_values_in_one_line(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(T.TrafficError) as exc:
        T.scale_trace([_req(0, 10, 1, [0])], name="x", **kwargs)  # type: ignore[arg-type]
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_synthetic_requests_share_one_of_the_prefixes_for_the_given_ratio() -> None:
    w = T.PrefixWorkload(requests=40, input_tokens=256, output_tokens=4, prefix_ratio=0.5, prefixes=2, rate=4.0)
    t = T.synthetic_trace(w, block_tokens=16)
    heads = {r.hash_ids[:8] for r in t.requests}
    assert len(heads) == 2  # 128 of 256 tokens = 8 blocks shared, two distinct prefixes
    tails = [r.hash_ids[8:] for r in t.requests]
    assert len({x for tail in tails for x in tail}) == 40 * 8  # the rest is each request's own
    assert all(r.input_length == 256 for r in t.requests)
    assert [r.timestamp_ms for r in t.requests] == sorted(r.timestamp_ms for r in t.requests)
    assert t.unique_prefix_tokens() == 2 * 128 + 40 * 128
    assert T.synthetic_trace(w, 16) == t  # reproducible from its seed


def test_mooncake_reader_names_the_bad_line(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    with pytest.raises(T.TrafficError) as exc:
        T.read_mooncake(f)
    assert "line 2: 'input_length' must be an integer >= 1" in str(exc.value) and "\n" not in str(exc.value)
    assert len(T.read_mooncake(f, limit=1)) == 1


def test_aiperf_export_is_read_per_request(tmp_path: Path) -> None:
    recs = []
    for i, ttft in enumerate([30.0, 10.0, 20.0]):
        recs.append(
            {
                "metadata": {"request_start_ns": 1e9 + i * 1e8, "request_end_ns": 2e9 + i * 1e8},
                "metrics": {
                    "time_to_first_token": {"value": ttft, "unit": "ms"},
                    "inter_token_latency": {"value": 2.0 + i, "unit": "ms"},
                    "output_sequence_length": {"value": 8, "unit": "tokens"},
                },
            }
        )
    recs.append({"metadata": {}, "metrics": {}, "error": {"code": 500, "message": "boom"}})
    (tmp_path / "profile_export.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = T.read_aiperf(tmp_path)
    assert (got.completed, got.failed, got.output_tokens) == (3, 1, 24)
    assert got.ttft_ms == (10.0, 20.0, 30.0)
    assert got.ttft(50) == 20.0 and got.ttft(99) == 30.0
    assert got.output_tokens_per_s == pytest.approx(24 / 1.2)


def test_aiperf_runs_the_trace_with_a_local_tokenizer_on_a_fixed_schedule(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    name, env = T.tokenizer_cache(model, tmp_path / "hub")
    snapshot = tmp_path / "hub" / "models--maru-fixture--tokenizer" / "snapshots"
    assert (next(snapshot.iterdir()) / "tokenizer.json").read_text() == "{}"
    assert env["HF_HUB_OFFLINE"] == "1"
    cmd = T.aiperf_command(
        url="http://h:1",
        model="m",
        tokenizer=name,
        trace_file=tmp_path / "t",
        artifact_dir=tmp_path,
        block_tokens=16,
        slo_ms=500,
    )
    joined = " ".join(cmd)
    for part in ("--streaming", "--custom-dataset-type mooncake_trace", "--fixed-schedule", "--isl-block-size 16"):
        assert part in joined
    assert "builtin" not in joined


def test_each_configuration_is_a_graph_of_its_workers_and_router(tmp_path: Path) -> None:
    for cfg in real_traffic.CONFIGS:
        spec = parse_graph(cfg.graph("/m", 2))
        plan = build_plan(spec, model="/m", work_dir=tmp_path)
        fe = next(p for p in plan.processes if p.name == "frontend")
        assert fe.argv[fe.argv.index("--router-mode") + 1] == cfg.router_mode
        assert len(plan.workers) == 2
        for w in plan.workers:
            plain = "maru_dynamo.components.vllm_worker" in w.argv
            assert plain == (cfg.engine == "vllm"), cfg.name
            assert ("--maru-pool-address" in w.argv) == (cfg.engine == "maru")
            assert ("--no-maru-pool-events" in w.argv) == (cfg.name == "maru-kv-gpu")


def test_graph_worker_engine_is_validated() -> None:
    with pytest.raises(GraphSpecError) as exc:
        parse_graph({"name": "g", "workers": [{"name": "w", "engine": "sglang"}]})
    assert "workers[0].engine: invalid value 'sglang': use one of maru, vllm" in str(exc.value)
    with pytest.raises(GraphSpecError) as exc:
        parse_graph(
            {
                "name": "g",
                "workers": [{"name": "p", "role": "prefill", "engine": "vllm"}, {"name": "d", "role": "decode"}],
            }
        )
    assert "'vllm' workers are agg only" in str(exc.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--configs", "plain-kv,bogus"], "--configs 'plain-kv,bogus': unknown bogus; use plain-rr, plain-kv"),
        (["--trace-block-size", "600"], "--trace-block-size 600: use 1 to 512 tokens per hash id"),
        (["--trace", "/nonexistent.jsonl"], "--trace /nonexistent.jsonl: No such file or directory"),
        (["--workers", "0"], "--workers 0: use 1 to 16"),
        (["--synthetic", "--prefix-ratio", "1.5"], "--prefix-ratio 1.5: use a share from 0.0 to 1.0"),
        (["--synthetic", "--sweep", "2,x"], "--sweep '2,x': use comma-separated arrivals per second > 0"),
        (["--sweep", "0,4"], "--sweep '0,4': use comma-separated speedups > 0"),
        (["--kv-cache-tokens", "100"], "--kv-cache-tokens 100: use at least 256 tokens"),
        (["--kv-cache-tokens", "2048"], "--kv-cache-tokens 2048: use at least the context, 4096 tokens"),
        (["--pool-size", "lots"], "--pool-size 'lots': invalid size 'lots'"),
    ],
)
def test_bad_input_is_one_line_naming_the_value(args: list[str], message: str) -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_whatif_replays_the_same_scaled_trace_calibrated_on_the_run(tmp_path: Path) -> None:
    from types import SimpleNamespace

    import real_traffic_whatif as W
    from maru_vllm.fixtures import models
    from maru_vllm.fixtures.calibration import read_calibration, write_calibration

    model = str(models.ensure_model("tiny"))
    run = SimpleNamespace(prefill_tokens=6000, prefill_seconds=0.5, load_bytes=10**8, load_seconds=0.1)
    cal = W.calibration_from_runs([run], model)
    assert (cal.prefill_tokens_per_s, cal.load_gbps) == (12000.0, 1.0)
    write_calibration(tmp_path / "cal.json", cal)
    assert read_calibration(tmp_path / "cal.json") == cal
    w = T.PrefixWorkload(requests=12, input_tokens=512, output_tokens=4, prefix_ratio=0.75, prefixes=2, rate=4.0)
    trace = T.synthetic_trace(w, 16).write(tmp_path / "t.jsonl")
    rows = W.whatif_rows(
        trace,
        tmp_path / "cal.json",
        workers=2,
        trace_block_size=16,
        block_size=16,
        gpu_blocks=4000,
        pool_size="1G",
        configs=["kv-gpu", "kv-pool"],
    )
    by = {r["config"]: r for r in rows}
    assert by["kv-pool"]["prefill_tokens"] <= by["kv-gpu"]["prefill_tokens"]
    real = [
        {"config": "plain-kv", "prefill_tokens": 3000, "ttft_p50_ms": 30.0, "ttft_p90_ms": 60.0},
        {"config": "maru-pool", "prefill_tokens": 2000, "ttft_p50_ms": 31.0, "ttft_p90_ms": 40.0},
    ]
    text = W.side_by_side(real, rows, cal)
    assert "TTFT p90 order   real: maru-pool < plain-kv" in text
    assert "prefill order    real: maru-pool < plain-kv" in text


def test_orderings_call_values_within_two_percent_equal() -> None:
    import real_traffic_whatif as W

    assert W.order_of({"a": 100.0, "b": 101.0, "c": 150.0}) == "a = b < c"


def test_session_sample_keeps_every_turn_of_every_kth_conversation() -> None:
    from maru_dynamo.components.whatif.trace import TraceRequest

    def req(t: float, *ids: int) -> TraceRequest:
        return TraceRequest(t, 16 * len(ids), 4, ids)

    trace = [req(0, 0, 1), req(1, 0, 2), req(2, 0, 1, 3), req(3, 0), req(4, 0, 2, 4), req(5, 0, 5)]
    assert T.session_of(trace) == [0, 1, 0, 2, 1, 3]
    # sessions 0 and 2: both turns of the first conversation, and the lone one-block request
    assert T.sample_sessions(trace, 2) == [trace[0], trace[2], trace[3]]
    assert T.sample_sessions(trace, 1) == trace
    with pytest.raises(T.TrafficError, match=r"--sample-sessions 0: use an integer >= 1"):
        T.sample_sessions(trace, 0)


def test_scale_whatif_gives_every_worker_the_real_runs_request_rate() -> None:
    import real_traffic_scale as S
    from maru_dynamo.components.whatif.trace import TraceRequest

    reqs = tuple(TraceRequest(i * 1000.0, 16, 4, (i,)) for i in range(11))  # 11 requests over 10 s: 1.1/s
    traffic = T.Traffic("t", 16, reqs)
    for workers in (8, 64):
        speedup = S.speedup_for(traffic, workers, 2.0)
        assert len(reqs) / (traffic.duration_s / speedup) == pytest.approx(2.0 * workers)


def test_scale_whatif_refuses_bad_worker_counts_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import real_traffic_scale as S

    cal = tmp_path / "cal.json"
    cal.write_text("{}")
    assert S.main(["--calibration", str(cal), "--workers", "8,x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["real_traffic_scale.py: error: --workers '8,x': use comma-separated integers >= 1"]


def test_kv_cache_tokens_size_every_worker_alike_and_the_pool_follows_pool_size(tmp_path: Path) -> None:
    for name in ("plain-kv", "maru-pool"):
        graph = real_traffic.BY_NAME[name].graph("/m", 2, kv_cache_tokens=10_000, pool_size="3G")
        plan = build_plan(parse_graph(graph), model="/m", work_dir=tmp_path)
        for w in plan.workers:
            argv = list(w.argv)
            # whole 128-token blocks: 10,000 tokens are 78 blocks, and vLLM's null block
            assert argv[argv.index("--num-gpu-blocks-override") + 1] == "79", name
            assert argv[argv.index("--block-size") + 1] == "128", name
        assert graph["pool"]["size"] == "3G"  # type: ignore[index]
    plain = real_traffic.BY_NAME["plain-kv"].graph("/m", 2)
    assert "--num-gpu-blocks-override" not in plain["workers"][0]["args"]  # type: ignore[index]


def _run(config: str, rate: float, p90: float, failed: int = 0, repeat: int = 0) -> real_traffic.Run:
    load = T.LoadResult(10 - failed, failed, tuple([p90] * 10), (1.0,), 10, 1.0)
    return real_traffic.Run(config, 2, load, 0, 0, 0, [5, 5], 0.0, 0.0, 0, 0.0, repeat=repeat, rate=rate)


def test_goodput_is_the_highest_rate_meeting_the_slo_with_every_lower_rate_meeting_it() -> None:
    import traffic_report as R

    runs = [
        # plain-kv meets the SLO at 1 and 2 req/s (median of three repeats at 2: one repeat misses)
        *(_run("plain-kv", 1, 300, repeat=k) for k in range(3)),
        _run("plain-kv", 2, 900, repeat=0),
        _run("plain-kv", 2, 1200, repeat=1),
        _run("plain-kv", 2, 950, repeat=2),
        _run("plain-kv", 4, 5000),
        # maru-pool meets it at 4 too, but a failed request at 8 disqualifies that rate
        _run("maru-pool", 1, 100),
        _run("maru-pool", 2, 200),
        _run("maru-pool", 4, 400),
        _run("maru-pool", 8, 600, failed=1),
        # a configuration that misses at its lowest rate has no goodput, even if a higher rate meets it
        _run("lmcache-kv", 1, 1500),
        _run("lmcache-kv", 2, 800),
    ]
    summaries = R.summarise(runs, ["plain-kv", "maru-pool", "lmcache-kv"])
    assert [(s.config, s.rate) for s in summaries][:3] == [("plain-kv", 1), ("plain-kv", 2), ("plain-kv", 4)]
    good = {g["config"]: g["max_rate"] for g in R.goodput(summaries, 1000.0)}
    assert good == {"plain-kv": 2, "maru-pool": 4, "lmcache-kv": None}
    text = R.format_goodput(R.goodput(summaries, 1000.0), "req/s")
    assert "maru-pool    4 (2.00x plain-kv)" in text
    assert "lmcache-kv   none swept" in text
    assert summaries[0].as_json()["rate"] == 1


def test_sweep_traffic_has_the_same_requests_at_every_rate() -> None:
    args = real_traffic._parser().parse_args(
        ["--synthetic", "--requests", "20", "--synthetic-isl", "300", "--sweep", "4,2"]
    )
    _, rates, traffics = real_traffic._validate(args)
    assert rates == [2.0, 4.0]
    slow, fast = traffics[2.0], traffics[4.0]
    assert [r.hash_ids for r in slow.requests] == [r.hash_ids for r in fast.requests]
    assert fast.duration_s == pytest.approx(slow.duration_s / 2, rel=1e-3)


def test_predict_replays_the_whatif_on_a_recorded_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """real_traffic_predict.py rebuilds each rate's traffic from the recorded argv and predicts with
    the recorded calibration; --json rewrites the run's 'whatif' entries."""
    import real_traffic_predict as P

    argv = ["--synthetic", "--requests", "12", "--synthetic-isl", "512", "--prefixes", "2", "--sweep", "2,4"]
    argv += ["--model", "tiny", "--kv-cache-tokens", "4096"]
    cal = {
        "model": "tiny",
        "kv_bytes_per_token": 1024,
        "load_gbps": 2.0,
        "store_gbps": 2.0,
        "prefill_tokens_per_s": 50000.0,
        "memcpy_gbps": 8.0,
        "version": 1,
        "prefill_points": [[16, 5.0], [512, 15.0], [4000, 90.0]],
        "decode_points": [[528, 3.0], [8320, 4.0]],
        "step_tokens": 2048,
    }
    rows = [
        {"config": c, "rate": r, "prefill_tokens": 3000, "ttft_p50_ms": 20.0, "ttft_p90_ms": 40.0}
        for c in ("plain-kv", "maru-pool")
        for r in (2.0, 4.0)
    ]
    detail = tmp_path / "runs.json"
    detail.write_text(json.dumps({"argv": argv, "calibration": cal, "kv_cache_tokens": 4096, "results": rows}))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"results": [{**r, "whatif": {"stale": 1}} for r in rows]}))
    assert P.main([str(detail), "--json", str(results)]) == 0
    out = capsys.readouterr().out
    assert "-- rate 2 --" in out and "-- rate 4 --" in out
    assert "plain-kv   kv-gpu" in out and "maru-pool  kv-pool" in out
    rewritten = json.loads(results.read_text())["results"]
    for r in rewritten:
        assert set(r["whatif"]) == {"prefill_tokens", "ttft_p50_ms", "ttft_p90_ms"}, r
    by = {(r["config"], r["rate"]): r["whatif"]["prefill_tokens"] for r in rewritten}
    assert by[("maru-pool", 2.0)] <= by[("plain-kv", 2.0)]

    # --load-gbps: the replay's pool loads at another speed, said in its header; never 0.
    assert P.main([str(detail), "--load-gbps", "64"]) == 0
    assert "pool loads 64 GB/s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        P.main([str(detail), "--load-gbps", "0"])
    assert "--load-gbps 0: want a speed above 0 GB/s" in capsys.readouterr().err


def _fake_sweep(
    monkeypatch: pytest.MonkeyPatch, failures: dict[int, int], configs: int = 2, rates: int = 2, repeats: int = 2
) -> tuple[list[object], bool, list[str]]:
    """A sweep of `configs` configs x `rates` rates x `repeats` repeats whose n-th run fails
    `failures[n]` times; each run names its configuration (`config`)."""
    calls: dict[int, int] = {}
    order: list[tuple[str, float]] = []

    def run_config(cfg: real_traffic.Config, *a: object, rate: float, **kw: object) -> object:
        n = len(order)
        calls[n] = calls.get(n, 0) + 1
        if calls[n] <= failures.get(n, 0):
            raise real_traffic.ProcessFailed(f"worker of {cfg.name} died")
        order.append((cfg.name, rate))

        class Load:
            completed, failed = 10, 0

            def ttft(self, q: int) -> float:
                return 1.0

        return type("Run", (), {"load": Load(), "prefill_tokens": 5, "config": cfg.name})()

    monkeypatch.setattr(real_traffic, "run_config", run_config)
    logs: list[str] = []
    args = type("Args", (), {"repeats": repeats})()
    runs, ok = real_traffic.sweep(
        args,  # type: ignore[arg-type]
        list(real_traffic.CONFIGS[:configs]),
        [1.0, 2.0][:rates],
        {1.0: Path("a"), 2.0: Path("b")},
        {1.0: None, 2.0: None},  # type: ignore[dict-item]
        bed=None,  # type: ignore[arg-type]
        work=Path("w"),
        log=logs.append,
        rate_unit="req/s",
    )
    return runs, ok, logs


def test_repeats_rotate_which_configuration_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    runs, ok, _ = _fake_sweep(monkeypatch, {}, configs=3, rates=1, repeats=3)
    names = [c.name for c in real_traffic.CONFIGS[:3]]
    repeats = [[r.config for r in runs[i : i + 3]] for i in (0, 3, 6)]  # type: ignore[attr-defined]
    assert ok and [order[0] for order in repeats] == names
    assert all(sorted(order) == sorted(names) for order in repeats)


def test_a_run_that_fails_once_is_run_again_and_the_sweep_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    runs, ok, logs = _fake_sweep(monkeypatch, {3: 1})
    assert ok and len(runs) == 8
    assert sum("attempt 1 failed: worker of" in line for line in logs) == 1


def test_a_run_that_fails_twice_ends_the_sweep_with_what_ran_so_far(monkeypatch: pytest.MonkeyPatch) -> None:
    runs, ok, logs = _fake_sweep(monkeypatch, {5: 2})
    assert not ok and len(runs) == 5
    assert logs[-1] == "[traffic] sweep stopped; reporting the 5 run(s) done"
