"""The frontend's role log, from the `/health` Dynamo 1.6.1's frontend serves (no processes)."""

from __future__ import annotations

import logging

import pytest

from maru_dynamo.components.disagg.frontend_log import RoleLog
from maru_dynamo.components.disagg.view import RoleView
from maru_dynamo.components.frontend import health_url

P, D = 5105075361137414446, 11102425294254454071


def health(*instances: tuple[str, str, int]) -> dict:
    """`/health` as the frontend answers it (shape copied from a live frontend's answer)."""
    return {
        "status": "healthy",
        "endpoints": [f"dyn://dynamo.{c}.{e}" for c, e, _ in instances],
        "instances": [
            {
                "component": c,
                "endpoint": e,
                "namespace": "dynamo",
                "instance_id": i,
                "transport": {"tcp": f"127.0.0.1:1/x/dynamo/{c}/{e}"},
                "device_type": "cpu",
                "request_plane_codec": "msgpack",
            }
            for c, e, i in instances
        ],
    }


WATCHES = (("prefill", "maru_watch", P), ("backend", "maru_watch", D))
# Every worker serves the other role's generate all along: its forwarding stand-in.
WHOLE = health(
    ("prefill", "generate", P),
    ("prefill", "generate", D),
    ("backend", "generate", D),
    ("backend", "generate", P),
    *WATCHES,
)
NO_PREFILL = health(("prefill", "generate", D), ("backend", "generate", D), ("backend", "maru_watch", D))
NO_DECODE = health(("prefill", "generate", P), ("backend", "generate", P), ("prefill", "maru_watch", P))


def test_role_view_tells_workers_from_stand_ins() -> None:
    view = RoleView.from_health(WHOLE)
    assert view.generate == {"prefill": {P, D}, "decode": {D, P}} and view.workers == {"prefill": {P}, "decode": {D}}
    assert view.state() == "disaggregated"
    assert RoleView.from_health(NO_PREFILL).state() == "prefill degraded"
    assert RoleView.from_health(NO_PREFILL).standing_in("prefill") == {D}
    assert RoleView.from_health(NO_DECODE).state() == "decode degraded"
    assert RoleView.from_health(NO_DECODE).standing_in("decode") == {P}
    # Aggregated graphs, graphs without stand-ins and graphs without workers say nothing.
    assert RoleView.from_health(health(("backend", "generate", D))).state() is None
    assert RoleView.from_health(health(("prefill", "generate", P), ("backend", "generate", D))).state() is None
    assert RoleView.from_health({"status": "notready", "instances": []}).state() is None
    assert RoleView.from_health("garbage").state() is None


def test_each_change_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    log = RoleLog("http://127.0.0.1:1/health")
    caplog.set_level(logging.WARNING)
    said = [log.observe(RoleView.from_health(h)) for h in (WHOLE, WHOLE, NO_PREFILL, NO_PREFILL, WHOLE, NO_DECODE)]
    assert said[0] is None and said[1] is None  # a graph that comes up whole says nothing
    assert said[2] == (
        "disaggregation degraded: no prefill worker; 1 decode worker(s) prefill requests themselves until one is back"
    )
    assert said[3] is None
    assert said[4] == "disaggregation restored: 1 prefill and 1 decode worker(s)"
    assert said[5] is not None and said[5].startswith("disaggregation degraded: no decode worker; 1 prefill worker(s)")
    assert [r.getMessage() for r in caplog.records] == [f"maru frontend: {s}" for s in said if s is not None]


def test_a_graph_that_starts_degraded_says_so() -> None:
    log = RoleLog("http://127.0.0.1:1/health")
    assert log.observe(RoleView.from_health(NO_PREFILL)) is not None
    assert log.observe(RoleView.from_health(WHOLE)) == "disaggregation restored: 1 prefill and 1 decode worker(s)"


def test_an_unreachable_frontend_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    log = RoleLog("http://127.0.0.1:9/health")  # discard port: refused
    log.poll()
    assert log.state is None and not caplog.records


def test_health_url_follows_the_frontend_flags() -> None:
    assert health_url([], {}) == "http://127.0.0.1:8000/health"
    assert health_url(["--http-host", "127.0.0.1", "--http-port", "9123"], {}) == "http://127.0.0.1:9123/health"
    assert health_url(["--http-port=81"], {"DYN_HTTP_HOST": "10.0.0.5"}) == "http://10.0.0.5:81/health"
    assert health_url([], {"DYN_HTTP_PORT": "7000"}) == "http://127.0.0.1:7000/health"
