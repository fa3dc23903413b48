"""Trace-driven what-if: would a shared KV pool pay off on this traffic, at this scale?

`maru-dynamo whatif TRACE` replays a Mooncake-format trace for several worker counts under four
configurations (round-robin, KV routing on the device cache, KV routing with per-worker host
tiers, KV routing with one pool shared by every worker) and reports TTFT and prefill tokens.

Why two simulators. Dynamo 1.6.1's offline replay (`dynamo.replay.run_trace_replay`, the Rust
KV router and the mocker engines) models the shared tier (``native_host_offload`` with
``scope: "cluster_shared"``) but aborts such replays once GPUs evict: the replay router is asked
to remove device blocks its radix tree no longer holds for that worker and turns the radix
tree's "Failed to find block" into a fatal error (Dynamo's live indexer logs the same error and
skips the event). It is not about onboarding: one worker, a 160k-token GPU cache, requests
[20k-token prefix, 148k unrelated, another 148k unrelated] abort with the shared scope (the
prefix is evicted in two steps) and pass with ``dp_rank_local``; nothing hits the shared tier
there. No configuration of
1.6.1 avoids it: approximate routing (``use_kv_events=False``, TTL or LRU), ``emit_kv_events``
off, active-block tracking off, predicted TTL, one event thread, one worker, any host size or
event lag - all abort the same way (checked with the first 300 requests of the synthetic trace,
8 workers, 2,500 GPU blocks, 1 TB pool). It needs the shared scope, KV routing and GPU eviction,
so it cannot be configured away without changing what is modelled.

So `pool_model` replays the pool on Dynamo's own parts - its radix tree (``dynamo._core.
RadixTree``) as the router index, its router cost formula, the mocker's timing measured from its
replay - and runs all four configurations the same way; ``--simulator dynamo`` runs Dynamo's
replay as shipped (its kv-pool rows count as failed runs until Dynamo fixes the shared tier).
The README's What-if section compares the two where both run.
"""
