"""Where an engine's prompt tokens came from: the connector's split of vLLM's external tokens.

vLLM counts every prompt token it serves once, by source, in
`vllm:prompt_tokens_by_source_total{source}`: `local_cache_hit` (its own prefix cache),
`local_compute` (prefilled) and `external_kv_transfer` (what a KV connector supplied). The last
one is this connector's: `TokenSources` splits it into tokens from the pool and tokens from the
pool's second tier, exported beside vLLM's as
`vllm:maru_connector_prompt_tokens_by_source_total{source="pool"|"tier2"}`, so that

    local_cache_hit + local_compute + pool + tier2 = the prompt tokens served

per engine, exactly. It counts what vLLM counts, where vLLM counts it: the external tokens vLLM
grants a request when it first schedules it (`update_state_after_alloc`), once per request; a
request resumed after a preemption is not counted again. A granted load that then fails is
recomputed, and still counted here as vLLM counts it (`vllm:maru_connector_load_failures_total`
counts the failures). Tokens are tier 2's when their chunk was not in the pool when the request
was looked up and the pool fetched it from its second tier for that lookup; once fetched it is a
pool chunk like any other, for every later request.
"""

from __future__ import annotations

import threading
from typing import Any

# The sources the connector adds to vLLM's, as their `source` label says them.
POOL = "pool"
TIER2 = "tier2"
SOURCES = (POOL, TIER2)


class TokenSources:
    """Per request, from vLLM's scheduler calls: where its external tokens start and whether part
    of them came up from the second tier; `take()` hands the counts to the stats, once each."""

    def __init__(self, chunk_tokens: int, objects_per_chunk: int) -> None:
        self.chunk_tokens = chunk_tokens
        self.objects_per_chunk = max(1, objects_per_chunk)  # keys a lookup asks per chunk
        self._local: dict[str, int] = {}  # req_id -> its local prefix-cache hit when vLLM asked
        self._tier_from: dict[str, int] = {}  # req_id -> first prompt token fetched from tier 2
        self._counted: set[str] = set()
        self._lock = threading.Lock()  # take() may run on another thread than the scheduler
        self._tokens = dict.fromkeys(SOURCES, 0)

    def asked(self, req_id: str, num_local_tokens: int, tier_from_key: int | None) -> None:
        """vLLM asked for `req_id`'s external tokens beyond its local hit; the pool's lookups for it
        found the second tier holding keys from key index `tier_from_key` on (None: they did not)."""
        self._local[req_id] = num_local_tokens
        if tier_from_key is not None:
            first = tier_from_key // self.objects_per_chunk * self.chunk_tokens
            self._tier_from[req_id] = min(first, self._tier_from.get(req_id, first))

    def granted(self, request: Any, num_external_tokens: int) -> None:
        """vLLM scheduled `request` with `num_external_tokens` from the connector."""
        req_id = request.request_id
        if req_id in self._counted or getattr(request, "num_preemptions", 0) > 0:
            return
        self._counted.add(req_id)
        if num_external_tokens <= 0:
            return
        start = self._local.get(req_id, 0)
        end = start + num_external_tokens
        tier_from = self._tier_from.get(req_id)
        tier2 = 0 if tier_from is None else max(0, end - max(start, tier_from))
        with self._lock:
            self._tokens[TIER2] += tier2
            self._tokens[POOL] += num_external_tokens - tier2

    def forget(self, req_id: str) -> None:
        """The request finished or was aborted."""
        self._local.pop(req_id, None)
        self._tier_from.pop(req_id, None)
        self._counted.discard(req_id)

    def take(self) -> dict[str, int]:
        """The tokens counted since the last take, by source (only sources with any)."""
        with self._lock:
            out = {source: n for source, n in self._tokens.items() if n}
            self._tokens = dict.fromkeys(SOURCES, 0)
        return out
