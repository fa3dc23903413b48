"""A Mooncake master for a local graph, tests and benchmarks: its command line and process.

One `mooncake_master` serves a whole second tier: the store's RPC service (`--rpc_port`), the
transfer engine's metadata (its built-in HTTP metadata server, so no etcd is needed) and its
own metrics. Everything binds to loopback here. The binary comes with Mooncake's Python wheel
(`mooncake-transfer-engine-non-cuda` on CPU installs, `mooncake-transfer-engine` on GPU ones;
`make setup` installs the right one) into the environment's `bin/`.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from pathlib import Path

from maru_vllm.launch.ports import free_ports
from maru_vllm.launch.process import ManagedProcess

LOOPBACK = "127.0.0.1"
# The master's log line once its RPC service and metadata server accept clients.
MASTER_READY_PATTERN = r"Task cleanup thread started"


def master_binary() -> str:
    """The `mooncake_master` of this environment (beside its python), else the one on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.exists():
        return str(beside)
    found = shutil.which("mooncake_master")
    if found is None:
        raise FileNotFoundError(
            "mooncake_master not found: install Mooncake (make setup installs maru-dynamo[mooncake])"
        )
    return found


def master_command(rpc_port: int, http_port: int, metrics_port: int, host: str = LOOPBACK) -> list[str]:
    """The master with its built-in metadata server, on `host`."""
    return [
        master_binary(),
        f"--rpc_address={host}",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={http_port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
    ]


class MooncakeMaster(ManagedProcess):
    """`mooncake_master` as a child process on free loopback ports (kept across restarts)."""

    def __init__(self, log_path: Path | str, *, name: str = "mooncake-master") -> None:
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        argv = master_command(self.rpc_port, self.http_port, self.metrics_port)
        env = dict(os.environ)
        super().__init__(name, argv, log_path=log_path, env=env)

    @property
    def address(self) -> str:
        """HOST:PORT for `pool serve --mooncake-master`."""
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """The URL for `pool serve --mooncake-metadata`."""
        return f"http://{LOOPBACK}:{self.http_port}/metadata"

    def pool_args(self) -> list[str]:
        return ["--mooncake-master", self.address, "--mooncake-metadata", self.metadata_url]

    def serve(self, timeout: float = 30.0) -> MooncakeMaster:
        """Start (again) and wait until its RPC port accepts connections."""
        if self.proc is not None:
            self.stop()
            self.restart()
        else:
            self.start()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        self.wait_for_log(MASTER_READY_PATTERN, timeout)
        while True:
            try:
                socket.create_connection((LOOPBACK, self.rpc_port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
