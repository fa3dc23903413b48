"""The connector's INFO lines: vLLM's logging set-up carries them; the periodic summary's content."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from maru_vllm.connector.config import MaruConfigError, parse_config
from maru_vllm.connector.log_summary import ConnectorLogSummary
from maru_vllm.connector.stats import TransferCounters

POOL = {"maru_pool_address": "unix:///tmp/pool.sock"}


class FakePoolLink:
    """Stands in for PoolAccess: only the two fields the summary reads."""

    def __init__(self) -> None:
        self.up = True
        self.failures = 0

    @property
    def available(self) -> bool:
        return self.up


# -- logging set-up, in a fresh interpreter (logging is process-global) --------------------------
ENGINE_PROCESS = textwrap.dedent(
    """
    import sys
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging, init_logger
    from maru_vllm.connector.logging_setup import follow_vllm_logging

    config = LoggingConfig()  # from VLLM_CONFIGURE_LOGGING / VLLM_LOGGING_LEVEL, as in an engine
    configure_logging(config)
    print("followed", follow_vllm_logging(config.configure_logging), file=sys.stderr)
    log = init_logger("maru_vllm.connector.connector")
    log.info("maru-info-line %d", 1)
    log.warning("maru-warning-line")
    """
)


def engine_process_output(**env: str) -> str:
    """What the process writes (vLLM's handler writes to stdout, Python's last resort to stderr)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    full_env.update(env)
    res = subprocess.run(
        [sys.executable, "-c", ENGINE_PROCESS],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout[-3000:]
    return res.stdout


def test_info_lines_reach_the_engine_log_in_vllms_format() -> None:
    err = engine_process_output(VLLM_CONFIGURE_LOGGING="1")
    assert "followed True" in err
    info = next(line for line in err.splitlines() if "maru-info-line 1" in line)
    # vLLM's own format: "(process pid=N) INFO mm-dd hh:mm:ss [file.py:line] message"
    assert " INFO " in info and "[<string>:" in info and "pid=" in info, info
    assert "maru-warning-line" in err


def test_vllm_logging_level_applies_to_the_connector() -> None:
    err = engine_process_output(VLLM_CONFIGURE_LOGGING="1", VLLM_LOGGING_LEVEL="WARNING")
    assert "maru-info-line" not in err
    assert "maru-warning-line" in err


def test_logging_left_alone_when_vllm_does_not_configure_it() -> None:
    err = engine_process_output(VLLM_CONFIGURE_LOGGING="0")
    assert "followed False" in err
    assert "maru-info-line" not in err  # the application owns logging: Python's defaults apply
    assert "maru-warning-line" in err


# -- the summary line ----------------------------------------------------------------------------
def test_an_idle_interval_logs_nothing() -> None:
    summary = ConnectorLogSummary("scheduler", 10.0, 128, [FakePoolLink()])
    assert summary.take_line() is None
    assert summary.take_line() is None


def test_scheduler_line_counts_hits_misses_and_pool_tokens() -> None:
    summary = ConnectorLogSummary("scheduler", 10.0, 128, [FakePoolLink()])
    for tokens in (768, 0, 256, 0, 0):
        summary.record_lookup(tokens)
    line = summary.take_line()
    assert line is not None
    assert line.startswith("MaruKVConnector (scheduler) last ")
    assert "5 requests looked up: 2 hits (1024 tokens from the pool), 3 misses" in line
    assert "pool up" in line and "[since start: 2/5 hits, 1024 tokens]" in line
    assert summary.take_line() is None  # the window was taken
    summary.record_lookup(0)
    line = summary.take_line()
    assert (
        line is not None
        and "1 request looked up: 0 hits (0 tokens from the pool), 1 miss" in line
        and "2/6 hits" in line
    )


def test_worker_line_counts_tokens_and_bytes_loaded_and_stored() -> None:
    summary = ConnectorLogSummary("worker", 10.0, 128, [FakePoolLink(), FakePoolLink()])
    step1 = TransferCounters(chunks_loaded=3, blocks_loaded=6, bytes_loaded=6 * 1024 * 1024)
    step2 = TransferCounters(chunks_stored=2, bytes_stored=4 * 1024 * 1024, stores_skipped=1, load_failures=1)
    summary.record_transfers(step1)
    summary.record_transfers(step2)
    line = summary.take_line()
    assert line is not None
    assert "loaded 3 chunks (768 tokens, 6.0 MiB, 1 failed)" in line
    assert "stored 2 chunks (4.0 MiB, 0 failed, 1 skipped)" in line
    assert "[since start: 768 tokens loaded, 2 chunks stored]" in line


def test_pool_state_changes_are_reported_even_without_traffic() -> None:
    store_link = FakePoolLink()
    summary = ConnectorLogSummary("worker", 10.0, 128, [FakePoolLink(), store_link])
    store_link.up, store_link.failures = False, 4
    line = summary.take_line()
    assert line is not None and "pool went down (4 failed pool operations)" in line
    assert summary.take_line() is None  # still down, no new failures: quiet
    store_link.failures = 5
    line = summary.take_line()
    assert line is not None and "pool down (1 failed pool operations)" in line
    store_link.up = True
    line = summary.take_line()
    assert line is not None and line.endswith("pool came back")


def test_disabled_summary_starts_no_thread_and_keeps_nothing() -> None:
    summary = ConnectorLogSummary("scheduler", 0.0, 128, [FakePoolLink()])
    summary.record_lookup(256)
    summary.start()
    assert summary._thread is None
    assert summary.take_line() is None


def test_the_thread_logs_each_active_interval_and_the_rest_at_stop(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    # A name of its own: other tests' summary threads may still log through the same logger.
    summary = ConnectorLogSummary("scheduler-under-test", 0.05, 128, [FakePoolLink()])
    with caplog.at_level(logging.INFO, logger="maru_vllm.connector.log_summary"):
        summary.start()
        summary.record_lookup(256)
        from tests.waiting import wait_until

        wait_until(
            lambda: any("(scheduler-under-test)" in r.getMessage() for r in caplog.records) or None,
            10.0,
            "a summary line",
        )
        summary.record_lookup(0)
        thread = summary._thread
        summary.stop()
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "maru_vllm.connector.log_summary" and "(scheduler-under-test)" in r.getMessage()
    ]
    assert any("1 request looked up: 1 hit (256 tokens from the pool), 0 misses" in m for m in lines)
    assert "1 request looked up: 0 hits" in lines[-1]  # the rest, logged at stop
    assert thread is not None and not thread.is_alive()


# -- the key ---------------------------------------------------------------------------------------
def test_interval_key_default_and_zero() -> None:
    assert parse_config(POOL, block_size=128).log_stats_interval_s == 10.0
    assert parse_config({**POOL, "maru_log_stats_interval_s": "0"}, block_size=128).log_stats_interval_s == 0.0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("often", "maru_log_stats_interval_s='often' is not a number; use seconds >= 0 (0: no summaries)"),
        (-1, "maru_log_stats_interval_s=-1 must be a finite number of seconds >= 0"),
        ("nan", "maru_log_stats_interval_s='nan' must be a finite number of seconds >= 0"),
    ],
)
def test_bad_interval_names_the_key_and_what_is_allowed(value: object, message: str) -> None:
    with pytest.raises(MaruConfigError) as err:
        parse_config({**POOL, "maru_log_stats_interval_s": value}, block_size=128)
    assert message in str(err.value)
