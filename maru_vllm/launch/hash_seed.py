"""The PYTHONHASHSEED of every process of a Maru graph.

vLLM seeds its block hashes from Python's `hash` (NONE_HASH), so the pool keys one engine
writes and the block hashes Dynamo's router sees match those of another engine only when both
run with the same seed. Dynamo starts its workers with 0; the local graph, the Helm chart and
the Maru worker all use that value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

GRAPH_HASH_SEED = "0"


def check_hash_seed(env: Mapping[str, str] | None = None) -> None:
    """Raise unless PYTHONHASHSEED is unset or the graph's value (vLLM block hashes depend on it)."""
    env = os.environ if env is None else env
    seed = env.get("PYTHONHASHSEED")
    if seed is not None and seed != GRAPH_HASH_SEED:
        raise RuntimeError(
            f"PYTHONHASHSEED={seed!r}, but every process of a Maru graph must use "
            f"PYTHONHASHSEED={GRAPH_HASH_SEED}: vLLM's block hashes (pool keys, router events) only "
            f"match across workers with the same seed. Unset it or set it to {GRAPH_HASH_SEED}."
        )
