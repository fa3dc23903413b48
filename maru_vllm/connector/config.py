"""`kv_connector_extra_config` of MaruKVConnector: parsed once, validated, typed.

Every key is prefixed `maru_`. A bad value stops the engine at start-up with a message that
names the key, the value and what is allowed; an unknown `maru_*` key is an error too (a typo
would otherwise silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from vllm.logger import init_logger

from maru_vllm.pool.auth import read_token_file
from maru_vllm.pool.chunk_codec import DEFAULT_CHUNK_TOKENS
from maru_vllm.pool.errors import InvalidArgument

logger = init_logger(__name__)

DEFAULT_POOL_ADDRESS_ENV = "MARU_POOL_ADDRESS"
# Far above a healthy pool's answer (well under 1 ms; tens of ms on a machine loaded many times
# over), small next to the step it may hold once when the pool hangs.
DEFAULT_POOL_DEADLINE_MS = 250.0


class MaruConfigError(ValueError):
    """A `maru_*` key of kv_connector_extra_config has a bad value."""


@dataclasses.dataclass(frozen=True)
class MaruConnectorConfig:
    pool_address: str
    pool_token: str | None
    chunk_tokens: int
    use_lmcache_kernels: bool
    enable_fused_load: bool
    namespace: str
    pool_timeout_s: float
    checksum: bool
    block_size: int
    log_stats_interval_s: float
    pool_deadline_ms: float = DEFAULT_POOL_DEADLINE_MS
    store_inline: bool = False

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def pool_deadline_s(self) -> float:
        return self.pool_deadline_ms / 1000.0


# key -> (default, description); the README's "Configuration" table lists the same keys and defaults.
KEYS: dict[str, tuple[Any, str]] = {
    "maru_pool_address": (
        None,
        f"pool service address: unix:///path.sock or tcp://host:port (default: ${DEFAULT_POOL_ADDRESS_ENV})",
    ),
    "maru_pool_token_file": (None, "file holding the shared-secret token for a TCP pool"),
    "maru_kv_chunk_tokens": (DEFAULT_CHUNK_TOKENS, "tokens per pool object; a multiple of the KV block size"),
    "maru_use_lmcache_kernels": (True, "use LMCache's compiled copy kernels when they resolve"),
    "maru_enable_fused_load": (False, "fused multi-layer load (needs the LMCache kernels)"),
    "maru_namespace": ("", "extra isolation salt mixed into every key's namespace"),
    "maru_pool_deadline_ms": (
        DEFAULT_POOL_DEADLINE_MS,
        "how long the engine waits for any one pool request (scheduler lookups, loads, stores), "
        "milliseconds; a pool that misses it counts as down for the whole engine process (requests "
        "are served without it, nothing waits for it) until a background probe sees it answer again",
    ),
    "maru_pool_timeout_s": (5.0, "how long connecting to the pool may take when the engine starts, seconds"),
    "maru_checksum": (
        True,
        "require and verify an XXH3 checksum on every load (a mismatch or a missing checksum "
        "is a miss); stores always carry one",
    ),
    "maru_log_stats_interval_s": (
        10.0,
        "seconds between the connector's INFO summaries in the engine log (hits, misses, tokens "
        "loaded and stored, pool state); an idle interval logs nothing; 0 turns them off",
    ),
    "maru_store_inline": (
        False,
        "commit each step's chunks before the step returns instead of behind it (a disaggregated "
        "prefill worker, whose response sends the decode worker to the pool); a producer-only "
        "engine (kv_producer) always stores inline",
    ),
}


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    raise MaruConfigError(f"{key}={value!r} is not a boolean; use true or false")


def _as_positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise MaruConfigError(f"{key}={value!r} is not an integer; use a positive integer")
    try:
        n = int(value)
    except ValueError:
        raise MaruConfigError(f"{key}={value!r} is not an integer; use a positive integer") from None
    if n <= 0:
        raise MaruConfigError(f"{key}={value!r} must be a positive integer")
    return n


def _as_positive_number(key: str, value: Any, unit: str) -> float:
    if isinstance(value, bool):
        raise MaruConfigError(f"{key}={value!r} is not a number; use {unit} > 0")
    try:
        n = float(value)
    except (TypeError, ValueError):
        raise MaruConfigError(f"{key}={value!r} is not a number; use {unit} > 0") from None
    if not (n > 0 and n != float("inf")):
        raise MaruConfigError(f"{key}={value!r} must be > 0 {unit} and finite")
    return n


def parse_config(extra: Mapping[str, Any] | None, block_size: int) -> MaruConnectorConfig:
    """Validate the `maru_*` keys of kv_connector_extra_config for an engine of `block_size`."""
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k.startswith("maru_") and k not in KEYS)
    if unknown:
        raise MaruConfigError(f"unknown key(s) {unknown} in kv_connector_extra_config; known keys: {sorted(KEYS)}")

    address = extra.get("maru_pool_address") or os.environ.get(DEFAULT_POOL_ADDRESS_ENV)
    if not address or not isinstance(address, str):
        raise MaruConfigError(
            f"maru_pool_address={extra.get('maru_pool_address')!r}: set it to the pool service address "
            f"(unix:///path.sock or tcp://host:port), or set ${DEFAULT_POOL_ADDRESS_ENV}"
        )
    if not (address.startswith(("unix://", "tcp://", "/"))):
        raise MaruConfigError(f"maru_pool_address={address!r}: use unix:///path.sock, /path.sock or tcp://host:port")

    token = None
    token_file = extra.get("maru_pool_token_file")
    if token_file is not None:
        try:
            token = read_token_file(str(token_file))
        except InvalidArgument as exc:
            raise MaruConfigError(f"maru_pool_token_file={str(token_file)!r}: {exc}") from None

    chunk = _as_positive_int("maru_kv_chunk_tokens", extra.get("maru_kv_chunk_tokens", KEYS["maru_kv_chunk_tokens"][0]))
    if chunk % block_size:
        rounded = max(block_size, round(chunk / block_size) * block_size)
        logger.warning(
            "maru_kv_chunk_tokens=%d is not a multiple of the KV block size %d; using %d", chunk, block_size, rounded
        )
        chunk = rounded

    namespace = extra.get("maru_namespace", "")
    if not isinstance(namespace, str) or len(namespace) > 128:
        raise MaruConfigError(f"maru_namespace={namespace!r} must be a string of at most 128 characters")

    timeout = _as_positive_number(
        "maru_pool_timeout_s", extra.get("maru_pool_timeout_s", KEYS["maru_pool_timeout_s"][0]), "seconds"
    )
    deadline_ms = _as_positive_number(
        "maru_pool_deadline_ms", extra.get("maru_pool_deadline_ms", KEYS["maru_pool_deadline_ms"][0]), "milliseconds"
    )

    raw_interval = extra.get("maru_log_stats_interval_s", KEYS["maru_log_stats_interval_s"][0])
    try:
        log_interval = float(raw_interval)
    except (TypeError, ValueError):
        raise MaruConfigError(
            f"maru_log_stats_interval_s={raw_interval!r} is not a number; use seconds >= 0 (0: no summaries)"
        ) from None
    if not log_interval >= 0 or log_interval == float("inf"):
        raise MaruConfigError(
            f"maru_log_stats_interval_s={raw_interval!r} must be a finite number of seconds >= 0 (0: no summaries)"
        )

    return MaruConnectorConfig(
        pool_address=address,
        pool_token=token,
        chunk_tokens=chunk,
        use_lmcache_kernels=_as_bool("maru_use_lmcache_kernels", extra.get("maru_use_lmcache_kernels", True)),
        enable_fused_load=_as_bool("maru_enable_fused_load", extra.get("maru_enable_fused_load", False)),
        namespace=namespace,
        pool_timeout_s=timeout,
        checksum=_as_bool("maru_checksum", extra.get("maru_checksum", True)),
        block_size=block_size,
        log_stats_interval_s=log_interval,
        pool_deadline_ms=deadline_ms,
        store_inline=_as_bool("maru_store_inline", extra.get("maru_store_inline", False)),
    )
