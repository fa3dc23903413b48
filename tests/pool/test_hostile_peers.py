"""Hostile or broken peers: unauthenticated sockets, floods, bad tokens, deep nesting.

Each test drives a real pool service process over real sockets. Where a test needs time to
pass (a hello timeout, the auth throttle) it only checks a lower bound or an eventual state,
never a speed.
"""

from __future__ import annotations

import socket
import struct
import sys
import time

import pytest
from test_bad_input import Raw, _err

from maru_vllm.launch import free_port
from maru_vllm.pool import PoolClient, PoolProtocolError, PoolUnavailable
from maru_vllm.pool import protocol as P
from tests.waiting import wait_until

TOKEN = "t" * 24


def _deep(levels: int) -> bytes:
    """A msgpack value nested `levels` arrays deep (built by hand: the encoder would recurse)."""
    return b"\x91" * levels + b"\x90"


def _closed(r: Raw, timeout: float = 10.0) -> bool:
    r.s.settimeout(timeout)
    try:
        return r.s.recv(1) == b""
    except ConnectionError:
        return True


def test_silent_peer_is_dropped_before_hello(pool_factory):
    p = pool_factory(extra=["--hello-timeout", "0.5"])
    r = Raw(p.address)
    assert _closed(r), "a peer that never sent hello kept its connection"
    half = Raw(p.address)
    half.s.sendall(struct.pack(">I", 100) + b"x" * 10)  # a hello that never completes
    assert _closed(half)
    with PoolClient.connect(p.address) as c:  # after hello there is no such deadline
        time.sleep(1.0)
        c.ping()


def test_only_a_small_first_frame_is_accepted_before_hello(pool):
    r = Raw(pool.address)
    r.s.sendall(struct.pack(">I", 1 << 20))  # announces 1 MiB and never sends it
    code, msg = _err(r.recv())
    assert code == "too_large" and str(P.MAX_HELLO_FRAME) in msg and "hello" in msg
    assert r.recv() is None


@pytest.mark.parametrize("body", [b"\xc1\xff garbage", None])
def test_garbage_or_wrong_version_before_hello_closes_the_connection(pool, body):
    r = Raw(pool.address)
    if body is None:
        r.send("hello", {}, v=99)
        code, msg = _err(r.recv())
        assert code == "bad_version" and "99" in msg
    else:
        r.send_body(body)
        assert _err(r.recv())[0] == "bad_frame"
    assert r.recv() is None


@pytest.mark.parametrize("where", ["hello", "commit", "frame"])
def test_deeply_nested_msgpack_gets_a_clean_error(pool, where):
    r = Raw(pool.address)
    if where == "hello":
        r.send_body(b"\x94\x01\x01\xa5hello\x81\xa6client" + _deep(1000))
        assert _err(r.recv())[0] in ("bad_frame", "bad_request")
        assert r.recv() is None  # before hello: refused and closed
        r = Raw(pool.address)
    r.hello()
    if where == "commit":
        body = b"\x94\x01\x02\xa6commit\x82\xa4oids\x91\x01\xa5metas\x91\x81\xa1a" + _deep(1000)
    else:
        body = b"\x94\x01\x02\xa5stats" + _deep(100_000)
    r.send_body(body)
    code, msg = _err(r.recv())
    assert code in ("bad_frame", "bad_request") and "deep" in msg, msg
    ok = r.call("ping", rid=3)  # the connection still works
    assert ok[2] is True
    # a meta within the decoder's reach but deeper than any consumer should parse is refused too
    shallow_but_deep = b"\x94\x01\x04\xa6commit\x82\xa4oids\x91\x01\xa5metas\x91\x81\xa1a" + _deep(200)
    r.send_body(shallow_but_deep)
    code, msg = _err(r.recv())
    assert code == "bad_request" and "nest" in msg
    assert pool.proc.poll() is None
    assert "RecursionError" not in pool.log_text() and "Traceback" not in pool.log_text()


def test_connection_cap_refuses_clearly_and_keeps_room_for_clients(pool_factory):
    p = pool_factory(extra=["--max-connections", "4"])
    idle = [Raw(p.address) for _ in range(3)]  # peers that never say hello hold at most half the slots
    code, msg = _err(idle[0].recv())  # the oldest one made room for the newest
    assert code == "too_many_connections" and "hello" in msg
    assert idle[0].recv() is None
    clients = [PoolClient.connect(p.address, heartbeat=False) for _ in range(4)]  # idle peers never block clients
    try:
        with pytest.raises(PoolUnavailable, match=r"too_many_connections.*4.*--max-connections"):
            PoolClient.connect(p.address, heartbeat=False)
        clients.pop().close()
        clients.append(wait_until(lambda: _try_connect(p.address), what="a freed slot"))
        clients[-1].ping()
    finally:
        for c in clients:
            c.close()
        for r in idle:
            r.s.close()


def _try_connect(address):
    try:
        return PoolClient.connect(address, heartbeat=False)
    except PoolUnavailable:
        return None


def test_idle_sockets_with_a_low_file_limit_neither_block_clients_nor_flood_the_log(
    pool_factory, tmp_path, monkeypatch
):
    limited = tmp_path / "python-nofile-64"  # the service runs with `ulimit -n 64`
    limited.write_text(f'#!/bin/sh\nulimit -n 64\nexec {sys.executable} "$@"\n')
    limited.chmod(0o755)
    with monkeypatch.context() as m:
        m.setattr(sys, "executable", str(limited))
        p = pool_factory()
    socks = []
    for _ in range(80):
        s = socket.socket(socket.AF_UNIX)
        s.connect(p.address.removeprefix("unix://"))
        socks.append(s)
    time.sleep(2.0)  # an accept loop that retries EMFILE at once would log thousands of errors by now
    try:
        with PoolClient.connect(p.address, timeout=10) as c:
            assert c.stats()["max_connections"] == 64 - 32  # derived from the open-file limit
    finally:
        for s in socks:
            s.close()
    lines = p.log_text().splitlines()
    assert len(lines) < 60, f"{len(lines)} log lines:\n" + "\n".join(lines[:40])


def test_failed_authentication_is_logged_and_throttled(pool_factory, tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    port = free_port()
    p = pool_factory(extra=["--listen", f"tcp://127.0.0.1:{port}", "--token-file", str(token)])
    tcp = p.addresses[1]
    guesses = 12
    t0 = time.monotonic()
    for i in range(guesses):
        with pytest.raises(PoolProtocolError, match="auth_failed"):
            PoolClient.connect(tcp, token=f"guess-{i:020d}", heartbeat=False)
    elapsed = time.monotonic() - t0
    # failures are spaced out service-wide (a lower bound: a slow machine only adds to it)
    assert elapsed >= (guesses - 1) * 0.1, f"{guesses} wrong tokens answered in {elapsed:.2f}s"
    logs = p.log_text()
    assert "authentication failed" in logs and "127.0.0.1" in logs
    assert logs.count("authentication failed") <= guesses
    with PoolClient.connect(tcp, token=TOKEN, heartbeat=False) as c:  # the right token is not delayed
        c.ping()


def test_repeated_errors_are_rate_limited_in_the_log(pool_factory):
    p = pool_factory(extra=["--max-connections", "2"])
    with PoolClient.connect(p.address, heartbeat=False), PoolClient.connect(p.address, heartbeat=False):
        for _ in range(200):
            r = Raw(p.address)
            assert _err(r.recv())[0] == "too_many_connections"
            r.s.close()
    refusals = p.log_text().count("refused a connection")
    assert 1 <= refusals <= 10, p.log_text()[-3000:]


def test_throttled_log_counts_what_it_held_back():
    import logging

    from maru_vllm.pool.logthrottle import AuthThrottle, ThrottledLog

    now = [0.0]
    lines = []

    class Sink(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    lg = logging.getLogger("maru-test-throttle")
    lg.addHandler(Sink())
    lg.propagate = False
    log = ThrottledLog(lg, burst=2, interval_s=10, clock=lambda: now[0])
    written = [log.log(logging.WARNING, "k", "bad peer %d", i) for i in range(50)]
    assert written.count(True) == 2 and lines == ["bad peer 0", "bad peer 1"]
    assert log.log(logging.WARNING, "other", "another kind")  # kinds have separate budgets
    now[0] = 11.0
    log.log(logging.WARNING, "k", "bad peer again")
    assert lines[-1] == "bad peer again (48 similar messages suppressed in the last 10 s)"
    auth = AuthThrottle(interval_s=0.1, clock=lambda: now[0])
    assert [round(auth.delay_for_failure(), 3) for _ in range(4)] == [0.0, 0.1, 0.2, 0.3]
