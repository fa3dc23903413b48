"""`maru-dynamo whatif` as a user drives it: JSON schema, progress, plot, sweep, calibration, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from maru_dynamo.components.main import main
from maru_dynamo.components.whatif.spec import CONFIGS, parse_size
from maru_vllm.fixtures.calibration import Calibration, write_calibration

RESULT_KEYS = {
    "workers",
    "config",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "prefill_tokens",
    "input_tokens",
    "output_tokens_per_s",
    "runs",
    "failed_runs",
}


def test_json_has_exactly_the_documented_schema_and_progress_goes_to_stderr(synthetic_trace: Path, capsys) -> None:
    rc = main(["whatif", str(synthetic_trace), "--requests", "60", "--workers", "2,4", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0
    doc = json.loads(out)  # stdout is the JSON and nothing else
    assert set(doc) == {"trace", "requests", "results"}
    assert doc["trace"] == str(synthetic_trace) and doc["requests"] == 60
    assert [(r["workers"], r["config"]) for r in doc["results"]] == [(w, c) for w in (2, 4) for c in CONFIGS]
    for r in doc["results"]:
        assert set(r) == RESULT_KEYS
        assert r["runs"] == 1 and r["failed_runs"] == 0
        assert 0 < r["prefill_tokens"] <= r["input_tokens"]
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"]
        assert isinstance(r["output_tokens_per_s"], float)
    assert len([line for line in err.splitlines() if line.startswith("[whatif] ")]) == 8  # one line per replay


def test_repeats_report_the_median_over_runs(synthetic_trace: Path, capsys) -> None:
    rc = main(
        [
            "whatif",
            str(synthetic_trace),
            "--requests",
            "40",
            "--workers",
            "2",
            "--configs",
            "kv-pool",
            "--repeats",
            "3",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    (row,) = json.loads(out)["results"]
    assert row["runs"] == 3 and row["failed_runs"] == 0
    runs = [
        int(line.split("prefill ")[1].split(" of")[0].replace(",", "")) for line in err.splitlines() if "run " in line
    ]
    assert len(runs) == 3 and row["prefill_tokens"] == sorted(runs)[1]


def test_dynamo_simulator_counts_its_shared_tier_abort_as_a_failed_run(synthetic_trace: Path, capsys) -> None:
    """Dynamo 1.6.1's cluster_shared replay aborts on GPU eviction; the row says so instead of crashing."""
    rc = main(
        [
            "whatif",
            str(synthetic_trace),
            "--requests",
            "300",
            "--workers",
            "8",
            "--configs",
            "kv-gpu,kv-pool",
            "--simulator",
            "dynamo",
        ]
    )
    out, _ = capsys.readouterr()
    assert rc == 0
    pool_row = next(line for line in out.splitlines() if line.split()[1:2] == ["kv-pool"])
    assert "failed" in pool_row and pool_row.split()[-1] == "1"
    assert "Failed to find block" in out


def test_plot_writes_a_png(synthetic_trace: Path, tmp_path: Path, capsys) -> None:
    png = tmp_path / "whatif.png"
    rc = main(
        [
            "whatif",
            str(synthetic_trace),
            "--requests",
            "30",
            "--workers",
            "1,2",
            "--configs",
            "kv-gpu,kv-pool",
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_weight_reports_the_best_weight_per_worker_count(synthetic_trace: Path, capsys) -> None:
    rc = main(
        ["whatif", str(synthetic_trace), "--requests", "60", "--workers", "2,4", "--sweep-weight", "0,0.5,1", "--json"]
    )
    out, _ = capsys.readouterr()
    assert rc == 0
    doc = json.loads(out)
    assert [(r["workers"], r["host_weight"]) for r in doc["results"]] == [(w, x) for w in (2, 4) for x in (0, 0.5, 1)]
    assert all(r["config"] == "kv-pool" for r in doc["results"])
    for workers, weight in doc["best_host_weight"].items():
        rows = [r for r in doc["results"] if r["workers"] == int(workers)]
        assert min(r["ttft_p90_ms"] for r in rows) == next(r["ttft_p90_ms"] for r in rows if r["host_weight"] == weight)


def test_calibration_sets_pool_bandwidth_and_scales_the_mockers_prefill(
    synthetic_trace: Path, tmp_path: Path, capsys
) -> None:
    from maru_dynamo.components.whatif.spec import ClusterSpec
    from maru_dynamo.components.whatif.timing import mocker_prefill_tokens_per_s

    base_tps = mocker_prefill_tokens_per_s(ClusterSpec(kv_bytes_per_token=131072))
    cal = tmp_path / "cal.json"
    write_calibration(
        cal,
        Calibration(
            model="m",
            kv_bytes_per_token=131072,
            load_gbps=12.5,
            store_gbps=10.0,
            prefill_tokens_per_s=base_tps / 4,
            memcpy_gbps=20.0,
        ),
    )
    args = ["whatif", str(synthetic_trace), "--requests", "40", "--workers", "2", "--configs", "kv-gpu", "--json"]
    assert main(args + ["--kv-bytes-per-token", "131072"]) == 0
    fast = json.loads(capsys.readouterr()[0])["results"][0]
    assert main(args[:-1] + ["--calibration", str(cal)]) == 0
    out = capsys.readouterr()[0]
    assert "12.5 GB/s per link" in out and "prefill speed x0.25" in out
    assert main(args + ["--calibration", str(cal)]) == 0
    slow = json.loads(capsys.readouterr()[0])["results"][0]
    # A 4x slower prefill (as measured) makes cold prompts' first tokens several times later.
    assert slow["ttft_p50_ms"] > 2.5 * fast["ttft_p50_ms"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["/nonexistent/trace.jsonl"], "trace /nonexistent/trace.jsonl: No such file or directory"),
        (
            ["TRACE", "--configs", "kv-gpu,kv-magic"],
            "unknown config 'kv-magic': use round-robin, kv-gpu, kv-host, kv-pool",
        ),
        (["TRACE", "--workers", "4,x"], "--workers '4,x': 'x' is not a worker count"),
        (["TRACE", "--pool-size", "lots"], "invalid size 'lots'"),
        (["TRACE", "--host-weight", "1.5"], "--host-weight: invalid pool tier weight '1.5'"),
        (["TRACE", "--calibration", "/nonexistent/cal.json"], "calibration file /nonexistent/cal.json"),
    ],
)
def test_bad_input_is_a_one_line_error(argv, message, synthetic_trace: Path, capsys) -> None:
    argv = [str(synthetic_trace) if a == "TRACE" else a for a in argv]
    assert main(["whatif", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_a_malformed_trace_line_is_named_by_its_number(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]})
    trace.write_text(
        good + "\n" + good + "\n" + '{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1]}\n'
    )
    assert main(["whatif", str(trace)]) == 2
    err = capsys.readouterr()[1]
    assert f"trace {trace} line 3:" in err and "input_length is 600" in err
    trace.write_text(good + "\n{not json\n")
    assert main(["whatif", str(trace)]) == 2
    assert f"trace {trace} line 2: not JSON" in capsys.readouterr()[1]


def test_sizes_parse_like_a_user_writes_them() -> None:
    assert parse_size("1T") == 10**12
    assert parse_size("100G") == 100 * 10**9
    assert parse_size("512Gi") == 512 * 2**30
    assert parse_size("4096") == 4096


def test_model_config_gives_kv_bytes_per_token(tmp_path: Path) -> None:
    from maru_dynamo.components.whatif.spec import DEFAULT_KV_BYTES_PER_TOKEN, kv_bytes_per_token_of_model

    # Qwen2.5-32B's geometry: 64 layers, 40 query heads, 8 KV heads, hidden 5120, bf16.
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 64,
                "num_attention_heads": 40,
                "num_key_value_heads": 8,
                "hidden_size": 5120,
                "torch_dtype": "bfloat16",
            }
        )
    )
    assert kv_bytes_per_token_of_model(str(tmp_path)) == DEFAULT_KV_BYTES_PER_TOKEN == 262144
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="lacks"):
        kv_bytes_per_token_of_model(str(tmp_path))
