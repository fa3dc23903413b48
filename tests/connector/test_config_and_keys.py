"""Connector configuration, KV namespace and chunk keys (no engine needed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from maru_vllm.connector.chunks import ChunkGeometry, chunk_key
from maru_vllm.connector.config import MaruConfigError, parse_config
from tests.connector.identity import IDENTITY

POOL = {"maru_pool_address": "unix:///tmp/pool.sock"}


def test_defaults() -> None:
    cfg = parse_config(POOL, block_size=128)
    assert (cfg.chunk_tokens, cfg.blocks_per_chunk, cfg.use_lmcache_kernels, cfg.enable_fused_load) == (
        256,
        2,
        True,
        False,
    )
    assert cfg.checksum is True and cfg.namespace == ""
    # requests in the scheduling loop wait milliseconds for the pool, not the start-up connect's seconds
    assert (cfg.pool_deadline_s, cfg.pool_timeout_s) == (0.25, 5.0)
    assert parse_config({**POOL, "maru_pool_deadline_ms": "250"}, block_size=128).pool_deadline_s == 0.25
    assert cfg.store_inline is False  # write-behind unless asked (a disaggregated prefill worker asks)
    assert parse_config({**POOL, "maru_store_inline": True}, block_size=128).store_inline is True


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "maru_pool_address=None: set it to the pool service address"),
        ({"maru_pool_address": "http://x"}, "maru_pool_address='http://x': use unix:///path.sock"),
        ({**POOL, "maru_kv_chunk_tokens": 0}, "maru_kv_chunk_tokens=0 must be a positive integer"),
        ({**POOL, "maru_kv_chunk_tokens": "lots"}, "maru_kv_chunk_tokens='lots' is not an integer"),
        ({**POOL, "maru_use_lmcache_kernels": "maybe"}, "maru_use_lmcache_kernels='maybe' is not a boolean"),
        ({**POOL, "maru_namespace": 7}, "maru_namespace=7 must be a string"),
        ({**POOL, "maru_pool_timeout_s": -1}, "maru_pool_timeout_s=-1 must be > 0"),
        ({**POOL, "maru_pool_deadline_ms": 0}, "maru_pool_deadline_ms=0 must be > 0 milliseconds"),
        ({**POOL, "maru_pool_deadline_ms": "soon"}, "maru_pool_deadline_ms='soon' is not a number"),
        ({**POOL, "maru_pool_deadline_ms": True}, "maru_pool_deadline_ms=True is not a number"),
        ({**POOL, "maru_store_inline": "sometimes"}, "maru_store_inline='sometimes' is not a boolean"),
        ({**POOL, "maru_chunk_tokens": 256}, "unknown key(s) ['maru_chunk_tokens']"),
        (
            {**POOL, "maru_pool_token_file": "/nonexistent/token"},
            "maru_pool_token_file='/nonexistent/token': cannot read token file",
        ),
    ],
)
def test_bad_values_name_the_key_value_and_what_is_allowed(extra: dict, message: str) -> None:
    with pytest.raises(MaruConfigError) as err:
        parse_config(extra, block_size=128)
    assert message in str(err.value)


def test_chunk_rounds_to_block_multiple(caplog: pytest.LogCaptureFixture) -> None:
    cfg = parse_config({**POOL, "maru_kv_chunk_tokens": 300}, block_size=128)
    assert cfg.chunk_tokens == 256
    assert parse_config({**POOL, "maru_kv_chunk_tokens": 64}, block_size=128).chunk_tokens == 128


def test_token_file_and_env_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-s3cret-s3cret\n")
    token.chmod(0o600)
    monkeypatch.setenv("MARU_POOL_ADDRESS", "tcp://127.0.0.1:9999")
    cfg = parse_config({"maru_pool_token_file": str(token), "maru_checksum": "false"}, block_size=16)
    assert (cfg.pool_address, cfg.pool_token, cfg.checksum) == ("tcp://127.0.0.1:9999", "s3cret-s3cret-s3cret", False)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "/models/other"},
        {"revision": "abc"},
        {"dtype": "torch.float16"},
        {"kv_cache_dtype": "fp8"},
        {"block_size": 16},
        {"num_layers": 3},
        {"num_kv_heads": 4},
        {"head_size": 128},
        {"attention": "MLAAttentionSpec:mla@cuda"},
        {"rank_named_tp": 2},
        {"pp_size": 2},
        {"hash_algo": "sha256_cbor"},
        {"salt": "tenant-b"},
    ],
)
def test_every_incompatibility_changes_the_namespace(change: dict) -> None:
    assert dataclasses.replace(IDENTITY, **change).namespace() != IDENTITY.namespace()


def test_namespace_is_stable_and_readable() -> None:
    assert IDENTITY.namespace() == dataclasses.replace(IDENTITY).namespace()
    assert IDENTITY.namespace().startswith("kv:llama:")


def test_chunk_keys_come_from_the_last_block_hash_of_each_chunk() -> None:
    hashes = [bytes([i]) * 32 for i in range(7)]
    g = ChunkGeometry(block_size=128, blocks_per_chunk=2, ranks=2)
    assert g.full_chunks(7 * 128, len(hashes)) == 3
    assert g.full_chunks(5 * 128 + 3, len(hashes)) == 2
    assert g.keys_all_ranks(hashes, 2) == [
        chunk_key(hashes[1], 0),
        chunk_key(hashes[1], 1),
        chunk_key(hashes[3], 0),
        chunk_key(hashes[3], 1),
    ]
    tokens = list(range(6 * 128))
    meta = g.chunk_meta(hashes, tokens, 1, lora_name=None)
    assert meta.block_hashes == [hashes[2].hex(), hashes[3].hex()]
    assert meta.parent_block_hash == hashes[1].hex()
    assert meta.token_ids == [tokens[256:384], tokens[384:512]]
    assert g.chunk_meta(hashes, tokens, 0, "lora-a").parent_block_hash is None
