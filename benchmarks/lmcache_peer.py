"""LMCache's multiprocess mode as the peer the benchmarks compare Maru with.

One LMCache MP server (`lmcache.v1.multiprocess.http_server`: an L1 cache in shared memory that
every engine on the host reaches over ZMQ) and the `kv_transfer_config` that points vLLM's
`LMCacheMPConnector` at it. `bench_connector.py` runs it beside plain vLLM engines,
`real_traffic.py` beside plain `dynamo.vllm` workers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from maru_vllm.launch import ManagedProcess, ProcessGroup, free_port


class LMCacheServer:
    """A started LMCache MP server: `kv_transfer_config` for its engines, `stop` removes its memory."""

    def __init__(self, port: int, shm_name: str) -> None:
        self.port = port
        self.shm_name = shm_name

    @property
    def kv_transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port},
        }

    def remove_shared_memory(self) -> None:
        """The server's L1 segment, should a killed server have left it behind."""
        Path("/dev/shm", self.shm_name).unlink(missing_ok=True)


def start_lmcache_server(
    group: ProcessGroup,
    log_path: Path,
    *,
    chunk_tokens: int,
    l1_gb: int,
    cpus: tuple[int, ...] | None = None,
    timeout: float = 180.0,
) -> LMCacheServer:
    """Start the server in `group` and wait until it answers HTTP."""
    port, http_port = free_port(), free_port()
    server = LMCacheServer(port, f"maru-bench-lmc-{port}")
    proc = group.start(
        ManagedProcess(
            "lmcache-server",
            [
                sys.executable,
                "-m",
                "lmcache.v1.multiprocess.http_server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(http_port),
                "--chunk-size",
                str(chunk_tokens),
                "--l1-size-gb",
                str(l1_gb),
                "--max-workers",
                "1",
                "--eviction-policy",
                "LRU",
                "--disable-metrics",
                "--supported-transfer-mode",
                "engine_driven",
                "--shm-name",
                server.shm_name,
            ],
            log_path=log_path,
            cpus=cpus,
        )
    )
    proc.wait_for_http(f"http://127.0.0.1:{http_port}/", timeout=timeout)
    return server
