"""Local trust: region files, the default socket directory, the server's uid, token files,
bind errors, and metrics scraped while the pool is busy."""

from __future__ import annotations

import os
import socket
import threading
import urllib.request
from pathlib import Path

import pytest
from pool_helpers import pool_cli, service_in_process

from maru_vllm.launch import free_port
from maru_vllm.pool import PoolClient, PoolError, PoolUnavailable
from maru_vllm.pool import address as address_mod
from maru_vllm.pool import connection as connection_mod

TOKEN = "k" * 32


# -- region files ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["shm", "file"])
def test_serve_refuses_to_replace_a_file_that_is_not_a_region(backend, tmp_path, sockdir):
    path = Path(f"/dev/shm/not-a-region-{os.getpid()}") if backend == "shm" else tmp_path / "precious"
    path.write_bytes(b"precious data\n" * 1000)
    try:
        args = [
            "serve",
            "--name",
            "x",
            "--size",
            "4M",
            "--backend",
            backend,
            "--path",
            str(path),
            "--listen",
            f"{sockdir}/r.sock",
        ]
        out = pool_cli(*args)
        assert out.returncode == 1
        err = out.stderr.strip().splitlines()
        assert len(err) == 1 and str(path) in err[0] and "not a maru pool region" in err[0] and "--force" in err[0]
        assert path.read_bytes() == b"precious data\n" * 1000
    finally:
        path.unlink(missing_ok=True)


def test_force_replaces_a_foreign_file_and_a_stale_region_needs_no_force(pool_factory, tmp_path):
    path = tmp_path / "region"
    path.write_bytes(b"old")
    p = pool_factory(extra=["--backend", "file", "--path", str(path), "--force", "--keep-region"])
    with PoolClient.connect(p.address) as c:
        assert c.put(b"k", b"v")
    p.stop()
    assert path.stat().st_size > 3
    q = pool_factory(extra=["--backend", "file", "--path", str(path)])  # a region left behind is replaced
    with PoolClient.connect(q.address) as c:
        assert c.lookup([b"k"]) == [False]


# -- default socket directory and the server's uid -------------------------------------------
def test_default_socket_lives_in_a_private_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(address_mod, "FALLBACK_RUNTIME_BASE", tmp_path)
    a = address_mod.default_listen("kv")
    d = tmp_path / f"maru-{os.geteuid()}"
    assert a.path == str(d / "maru-kv.sock")
    assert d.is_dir() and d.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("squat", ["open-mode", "symlink", "other-owner"])
def test_a_squatted_socket_directory_is_refused(monkeypatch, tmp_path, squat):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(address_mod, "FALLBACK_RUNTIME_BASE", tmp_path)
    d = tmp_path / f"maru-{os.geteuid()}"
    if squat == "symlink":
        (tmp_path / "elsewhere").mkdir()
        d.symlink_to(tmp_path / "elsewhere")
    else:
        d.mkdir()
        d.chmod(0o777)
        if squat == "other-owner":
            d.chmod(0o700)
            os.chown(d, 4242, -1)
    with pytest.raises(PoolError, match=str(d)):
        address_mod.default_listen("kv")


def test_client_reads_the_servers_uid_and_refuses_a_stranger(pool, monkeypatch):
    with PoolClient.connect(pool.address) as c:
        assert connection_mod._peer_uid(c._sock) == os.geteuid()
    monkeypatch.setattr(connection_mod, "_peer_uid", lambda sock: 4242)
    with pytest.raises(PoolUnavailable, match=r"uid 4242.*refusing"):
        PoolClient.connect(pool.address, token="t" * 32)


# -- token files ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content,mode,needle",
    [
        ("short", 0o600, "at least 16"),
        (TOKEN, 0o644, "readable by group or others"),
        (TOKEN, 0o640, "readable by group or others"),
    ],
)
def test_weak_or_exposed_token_files_are_refused(tmp_path, sockdir, content, mode, needle):
    f = tmp_path / "token"
    f.write_text(content + "\n")
    f.chmod(mode)
    out = pool_cli(
        "serve", "--name", "x", "--size", "4M", "--listen", f"tcp://127.0.0.1:{free_port()}", "--token-file", str(f)
    )
    assert out.returncode == 1
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0] and needle in err[0], out.stderr
    out = pool_cli("status", "--address", f"unix://{sockdir}/none.sock", "--token-file", str(f))
    assert out.returncode == 1 and needle in out.stderr


def test_connector_refuses_an_exposed_token_file(tmp_path):
    from maru_vllm.connector.config import MaruConfigError, parse_config

    f = tmp_path / "token"
    f.write_text(TOKEN)
    f.chmod(0o644)
    with pytest.raises(MaruConfigError, match="readable by group or others"):
        parse_config({"maru_pool_address": "tcp://127.0.0.1:1", "maru_pool_token_file": str(f)}, block_size=16)


# -- bind errors ----------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["listen", "metrics"])
def test_bind_errors_name_the_address(sockdir, what):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        if what == "listen":
            f = sockdir / "token"
            f.write_text(TOKEN)
            f.chmod(0o600)
            extra = ["--listen", f"tcp://127.0.0.1:{port}", "--token-file", str(f)]
            needle = f"tcp://127.0.0.1:{port}"
        else:
            extra = ["--listen", f"{sockdir}/m.sock", "--metrics-port", str(port)]
            needle = f"127.0.0.1:{port}"
        out = pool_cli("serve", "--name", f"bind{os.getpid()}", "--size", "4M", *extra)
    assert out.returncode == 1
    assert needle in out.stderr and "in use" in out.stderr, out.stderr
    assert not Path(f"/dev/shm/maru-bind{os.getpid()}").exists()


# -- metrics -------------------------------------------------------------------------------
def test_metrics_are_computed_on_the_event_loop_thread(sockdir):
    """The scrape thread must not walk the index while the loop mutates it (that returned HTTP 500)."""
    name = f"met{os.getpid()}"
    with service_in_process(name, f"unix://{sockdir}/m.sock") as (svc, t):
        seen = []
        real_stats = svc.index.stats
        svc.index.stats = lambda: (seen.append(threading.current_thread()), real_stats())[1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10).read().decode()
        assert f'maru_pool_objects{{pool="{name}"}} 0.0' in text
        assert seen and all(th is t for th in seen), seen
