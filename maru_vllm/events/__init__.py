"""Pool blocks in Dynamo's KV router: every worker announces the shared pool at the host tier.

Dynamo's router learns what a worker can serve from that worker's KV events, and it accepts
one event source per worker. So each `dynamo.vllm` worker publishes ONE merged stream: vLLM's
own events (unchanged) plus the Maru pool's objects as vLLM `BlockStored`/`BlockRemoved`
events at medium `CPU_PINNED` (Dynamo's host tier, weighted by the frontend's
`--router-host-cache-hit-weight`). See docs in each module:

* `types`       - typed pool events/snapshots/chunk metadata and the announcements made from them
* `vllm_format` - vLLM's KVEventBatch msgpack and ZMQ frames, with vLLM's own classes
* `pool_view`   - the per-worker set of announced pool chunks; diffs against snapshots
* `announced_order` - with an announce cap: the announced chunks in use order
* `nats_source` - the pool's NATS events, gap/restart/outage detection and snapshot resync
* `tier2_credit` - opt-in: the cluster's tier-2 chunks announced at the disk tier (capped view)
* `relay`       - ZMQ in (vLLM) + pool events -> one sequenced ZMQ stream out (to Dynamo)
* `downstream`  - the relay's flow-controlled, gap-free sends to Dynamo's publisher
* `publisher_relay` - a relay in front of each KV publisher a worker sets up (the options below)

The relay's options, as the Maru worker gives them (`relay_options`; the Dynamo side's hook
puts the relay in front of `dynamo.vllm`'s publisher)::

    relay_options(
        *,
        pool_name: str,                      # the pool's --name (NATS subjects maru.<name>.*)
        nats_url: str | None = None,         # default: $NATS_SERVER, else nats://127.0.0.1:4222
        pool_address: str | None = None,     # pool socket; snapshots of any size (else NATS request)
        pool_token: str | None = None,       # token for a tcp:// pool address
        medium: str = "CPU_PINNED",          # tier of pool blocks: CPU_PINNED/CPU, DISK/EXTERNAL/SHARED
        namespace: str | None = None,        # exact pool namespace of this worker's connector
        namespace_prefix: str | None = None, # or: any namespace with this prefix
        probe_interval_s: float = 10.0,      # idle check for pool restarts / missed events
        max_announced_chunks: int | None = None,  # announce at most this many pool objects (most recently used)
        tier2_credit_max_chunks: int | None = None,  # also the tier-2's chunks at DISK, at most this many (None: off)
    ) -> PoolEventRelayOptions

Namespace choice: MaruKVConnector's namespace (`kv:<model>:<digest of the KV layout>`) is
computed inside the engine core from its `KVCacheConfig`, which the worker's main process does
not have. So by default a worker accepts every namespace of its model (`kv:<model base name>:`)
whose chunk metadata has the engine's block size; pass `namespace=` when the exact value is
known (it then also narrows the snapshot requests). Engines of one model with different KV
layouts (dtype, TP size, `maru_namespace` salt) sharing one pool would over-credit each other
in the router under the default; the connector simply misses on such chunks, so this costs a
routing choice, never correctness.

Importing this package imports no relay module, and nothing here imports Dynamo.
"""
