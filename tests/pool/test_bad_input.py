"""Malformed and hostile input: every case gets an error reply and the service keeps serving."""

from __future__ import annotations

import socket
import struct

import msgspec
import pytest
from pool_helpers import pool_cli

from maru_vllm.launch import free_port
from maru_vllm.pool import PoolClient, PoolProtocolError, PoolUnavailable
from maru_vllm.pool.protocol import PROTOCOL_VERSION


class Raw:
    """A hand-driven protocol connection."""

    def __init__(self, address: str) -> None:
        if address.startswith("tcp://"):
            host, port = address[6:].rsplit(":", 1)
            self.s = socket.create_connection((host, int(port)), timeout=10)
        else:
            self.s = socket.socket(socket.AF_UNIX)
            self.s.settimeout(10)
            self.s.connect(address.removeprefix("unix://"))

    def send_body(self, body: bytes) -> None:
        self.s.sendall(struct.pack(">I", len(body)) + body)

    def send(self, op, args=None, v=PROTOCOL_VERSION, rid=1) -> None:
        self.send_body(msgspec.msgpack.encode([v, rid, op, args or {}]))

    def recv(self):
        hdr = self._exact(4)
        if hdr is None:
            return None
        return msgspec.msgpack.decode(self._exact(struct.unpack(">I", hdr)[0]))

    def _exact(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.s.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def call(self, op, args=None, **kw):
        self.send(op, args, **kw)
        return self.recv()

    def hello(self, token=None):
        r = self.call("hello", {"token": token, "client": "raw"})
        assert r[2] is True, r
        return r


def _err(reply):
    assert reply is not None, "connection closed instead of an error reply"
    _v, _rid, ok, _result, error = reply
    assert ok is False
    return error[0], error[1]


def test_bad_frames_get_error_replies_and_service_keeps_serving(pool):
    r = Raw(pool.address)
    r.hello()
    r.send_body(b"\xc1\xff garbage")
    assert _err(r.recv())[0] == "bad_frame"
    r.send_body(msgspec.msgpack.encode({"not": "an array"}))
    assert _err(r.recv())[0] == "bad_frame"
    code, msg = _err(r.call("stats", v=99))
    assert code == "bad_version" and "99" in msg and str(PROTOCOL_VERSION) in msg
    code, msg = _err(r.call("frobnicate"))
    assert code == "unknown_op" and "frobnicate" in msg and "lookup" in msg
    code, msg = _err(r.call("reserve", {"items": [[b"k", -5]]}))
    assert code == "bad_request" and "reserve" in msg
    code, _ = _err(r.call("lookup", {"keys": [b"x" * 10_000]}))
    assert code == "bad_request"
    code, _ = _err(r.call("lookup", {"keys": "not-a-list"}))
    assert code == "bad_request"
    code, _ = _err(r.call("commit", {"oids": [1, 2], "metas": [None]}))
    assert code == "bad_request"
    code, _ = _err(r.call("hello", {}))  # hello twice
    assert code == "bad_request"
    ok = r.call("lookup", {"keys": [b"a"]})  # the same connection still works
    assert ok[2] is True and ok[3] == [False]
    # an oversized frame is refused; that connection is closed, the service is not
    r.s.sendall(struct.pack(">I", 1 << 30))
    assert _err(r.recv())[0] == "too_large"
    with PoolClient.connect(pool.address) as c:
        assert c.put(b"still", b"up")
        assert c.stats()["sessions"] == 1
    assert pool.proc.poll() is None


def test_ops_before_hello_are_refused(pool):
    r = Raw(pool.address)
    code, _ = _err(r.call("stats"))
    assert code == "auth_required"
    assert r.recv() is None  # and the connection is closed
    with PoolClient.connect(pool.address) as c:
        c.ping()


def test_client_sees_server_rejections_as_pool_protocol_error(pool):
    with PoolClient.connect(pool.address) as c:
        with pytest.raises(PoolProtocolError, match="commit has 1 oids but 2 metas"):
            c._call("commit", {"oids": [1], "metas": [None, None]})
        c.ping()


def test_tcp_requires_token(pool_factory, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-s3cret-s3cret\n")
    token.chmod(0o600)
    port = free_port()
    p = pool_factory(extra=["--listen", f"tcp://127.0.0.1:{port}", "--token-file", str(token)])
    tcp = p.addresses[1]
    assert tcp == f"tcp://127.0.0.1:{port}"
    r = Raw(tcp)
    assert _err(r.call("hello", {}))[0] == "auth_required"
    assert r.recv() is None
    r = Raw(tcp)
    assert _err(r.call("hello", {"token": "wrong"}))[0] == "auth_failed"
    r = Raw(tcp)
    assert _err(r.call("lookup", {"keys": []}))[0] == "auth_required"
    with pytest.raises(PoolProtocolError, match="auth_failed"):
        PoolClient.connect(tcp, token="nope")
    with pytest.raises(PoolProtocolError, match="auth_required"):
        PoolClient.connect(tcp)
    with PoolClient.connect(tcp, token="s3cret-s3cret-s3cret") as c:
        assert c.put(b"over-tcp", b"data")
        with c.get(b"over-tcp") as v:
            assert bytes(v) == b"data"
    assert p.proc.poll() is None


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--name", "x", "--size", "4X"], ["invalid size '4X'", "512M"]),
        (["--name", "x", "--size=-1G"], ["invalid size '-1G'"]),
        (["--name", "bad/name", "--size", "4M"], ["invalid pool name 'bad/name'", "letters, digits"]),
        (["--name", "x", "--size", "4M", "--backend", "nvme"], ["invalid choice: 'nvme'", "shm", "dax", "file"]),
        (
            ["--name", "x", "--size", "4M", "--listen", "http://h:1"],
            ["invalid address 'http://h:1'", "tcp://host:port"],
        ),
        (["--name", "x", "--size", "4M", "--metrics-port", "70000"], ["invalid port '70000'", "0-65535"]),
        (["--name", "x", "--size", "4M", "--nats", "localhost:4222"], ["invalid NATS URL 'localhost:4222'", "nats://"]),
        (["--name", "x", "--size", "4M", "--lease-seconds", "0"], ["invalid duration '0'"]),
    ],
)
def test_bad_cli_values_get_clear_messages(args, needle):
    out = pool_cli("serve", *args)
    assert out.returncode == 2
    for n in needle:
        assert n in out.stderr, out.stderr


def test_cli_runtime_errors_are_clear(tmp_path, sockdir):
    out = pool_cli("serve", "--name", "x", "--size", "4M", "--listen", f"tcp://127.0.0.1:{free_port()}")
    assert out.returncode == 1 and "needs a shared-secret token (--token-file)" in out.stderr
    out = pool_cli(
        "serve", "--name", "x", "--size", "4M", "--path", "../../etc/passwd", "--listen", f"{sockdir}/a.sock"
    )
    assert out.returncode == 1 and "invalid shm path '../../etc/passwd'" in out.stderr
    out = pool_cli("serve", "--name", "x", "--size", "4M", "--token-file", str(tmp_path / "none"))
    assert out.returncode == 1 and "cannot read token file" in out.stderr
    out = pool_cli("status", "--address", f"unix://{sockdir}/nobody.sock")
    assert out.returncode == 1 and "cannot connect to pool" in out.stderr


def test_unreachable_pool_raises_pool_unavailable(sockdir):
    with pytest.raises(PoolUnavailable, match="cannot connect"):
        PoolClient.connect(f"unix://{sockdir}/nothing.sock", timeout=1)
