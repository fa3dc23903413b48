"""Module-scoped stacks for end-to-end tests: a pool service and vLLM engines sharing it."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from maru_vllm.launch import ProcessGroup, free_port, stack
from maru_vllm.pool import PoolClient
from tests.cleanup import stop_leaving_nothing
from tests.waiting import wait_until

CHUNK = 256  # the connector's default chunk (maru_kv_chunk_tokens)


def start_pool(
    group: ProcessGroup, log_dir: Path, name: str, size: str = "256M", extra: list[str] | None = None
) -> stack.PoolProcess:
    pool = stack.PoolProcess(
        name,
        size,
        log_dir / f"pool-{name}.log",
        listen=[f"unix:///tmp/maru-test-{name}.sock"],
        extra_args=extra or [],
        name=f"pool-{name}",
    )
    group.add(pool)
    return pool.serve()


def maru_kv_config(pool_address: str, role: str = "kv_both", **extra: object) -> dict[str, object]:
    return {
        "kv_connector": "MaruKVConnector",
        "kv_connector_module_path": "maru_vllm.connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"maru_pool_address": pool_address, **extra},
    }


def token_prompt(seed: int, length: int) -> list[int]:
    """A prompt of exactly `length` byte tokens (ids 32..126), reproducible from `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


def pool_chunks(address: str, prompt: list[int], chunk_tokens: int = CHUNK) -> dict[int, dict]:
    """Pool objects whose committed metadata says they hold chunk i of `prompt`, by i."""
    with PoolClient.connect(address) as c:
        objs = c.snapshot()
    found = {}
    for o in objs:
        meta = o.get("meta") or {}
        i = meta.get("chunk")
        if i is None:
            continue
        if [t for block in meta["token_ids"] for t in block] == prompt[i * chunk_tokens : (i + 1) * chunk_tokens]:
            found[i] = o
    return found


def stored_chunks(address: str, prompt: list[int], want: Iterable[int], timeout: float = 30.0) -> dict[int, dict]:
    """`pool_chunks` once every chunk in `want` is there.

    Stores are write-behind: an engine answers before its last step's chunks are committed, so a
    test that reads the pool (or asks another engine) right after an answer waits for them here.
    """
    want = set(want)

    def committed() -> dict[int, dict] | None:
        found = pool_chunks(address, prompt)
        return found if want <= found.keys() else None

    return wait_until(committed, timeout, f"chunks {sorted(want)} of the prompt committed to the pool")


@pytest.fixture(scope="module")
def module_procs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessGroup]:
    group = ProcessGroup()
    yield group
    if request.session.testsfailed:
        print("\n" + group.log_tails(80))
    stop_leaving_nothing(group)


@pytest.fixture(scope="module")
def module_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


def start_engine(
    group: ProcessGroup,
    name: str,
    model: Path,
    core: int,
    log_dir: Path,
    kv: dict | None,
    tmp: Path,
    extra_args: list[str] | None = None,
) -> str:
    env = stack.StackEnv(discovery_dir=tmp / "discovery").build(cpu_thread=core)
    proc, url = stack.vllm_openai_server(
        name,
        model,
        env,
        log_dir,
        port=free_port(),
        kv_transfer_config=kv,
        extra_args=["--max-num-batched-tokens", "512", *(extra_args or [])],
    )
    group.start(proc)
    return url


def wait_engines(group: ProcessGroup, urls: dict[str, str]) -> None:
    by_name = {p.name: p for p in group}
    for name, url in urls.items():
        by_name[name].wait_for_http(f"{url}/v1/models", timeout=300)
