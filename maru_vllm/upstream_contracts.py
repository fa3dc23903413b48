"""What this package relies on in vLLM, LMCache and Dynamo beyond the names it imports.

An import shows that `SchedulerOutput` exists; it does not show that our scheduler side reads
`SchedulerOutput.scheduled_cached_reqs` or that the connector's `start_load_kv` overrides a hook
of that name taking `forward_context`. Each `Contract` below declares such facts: the fields,
methods (with the parameters we call or override them with) and module attributes our code
reads on upstream objects. The compatibility matrix's static level
(`scripts/compat/static.py`) checks every contract, and every import, against the released
sources of each supported version (`maru_vllm.versions`).

`attrs` entries:

* `name` - an attribute, method, field or module-level name that must be there;
* `name?` - one our code reads with a fallback (a `getattr` default): its absence is handled;
* `name(a, b)` - a function or method whose leading parameters (after `self`/`cls`) are `a, b`;
  `name(*, a, b)` - one that accepts `a` and `b` by keyword.

`optional=True` means the whole symbol may be absent and our code copes (it takes another
path); `alternatives` names other places (`module` or `module:qualname`) that serve the same
purpose in other releases: a symbol found at one of them counts as moved and handled.

Pure data: importing this module imports nothing upstream.

Size: one declaration per upstream symbol the code relies on, kept together so that the static
level, the start-up check and a reader see every dependency on vLLM, LMCache and Dynamo in one
place; split by upstream, the three lists would still be read as one.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Contract:
    dist: str  # the distribution whose releases ship it: vllm, lmcache, ai-dynamo
    module: str
    qualname: str = ""  # a class (or function) in `module`; "" for module-level attributes
    attrs: tuple[str, ...] = ()
    optional: bool = False
    alternatives: tuple[str, ...] = ()
    why: str = ""
    used_in: tuple[str, ...] = ()  # our files that rely on it (repository paths)


_SCHED = "maru_vllm/connector/scheduler.py"
_GROUPS = "maru_vllm/connector/scheduler_groups.py"
_CONN = "maru_vllm/connector/connector.py"
_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
_OUTPUT = "vllm.v1.core.sched.output"
_KVI = "vllm.v1.kv_cache_interface"
_DM = "dynamo.vllm.main"

VLLM_CONTRACTS: tuple[Contract, ...] = (
    Contract(
        "vllm",
        _OUTPUT,
        "SchedulerOutput",
        ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens")
        + ("preempted_req_ids",),
        why="the step's requests, read by both scheduler sides and the load guard",
        used_in=("maru_vllm/connector/scheduled.py", "maru_vllm/connector/load_guard.py", _SCHED, _GROUPS),
    ),
    Contract(
        "vllm",
        _OUTPUT,
        "NewRequestData",
        ("req_id", "num_computed_tokens", "block_ids"),
        why="a new (or, from 0.34, resumed) request's whole block table",
        used_in=("maru_vllm/connector/scheduled.py", "maru_vllm/connector/load_guard.py"),
    ),
    Contract(
        "vllm",
        _OUTPUT,
        "CachedRequestData",
        ("req_ids", "new_block_ids", "num_computed_tokens", "resumed_req_ids?"),
        why="running requests' new blocks; resumed_req_ids is read with a fallback (a resumed request "
        "comes in scheduled_new_reqs where it is gone)",
        used_in=("maru_vllm/connector/scheduled.py", "maru_vllm/connector/load_guard.py"),
    ),
    Contract(
        "vllm",
        "vllm.v1.core.kv_cache_manager",
        "KVCacheBlocks",
        ("get_block_ids",),
        why="the blocks vLLM allocated for a request, per KV cache group",
        used_in=(_SCHED, _GROUPS),
    ),
    Contract(
        "vllm",
        "vllm.v1.request",
        "Request",
        ("request_id", "block_hashes", "num_prompt_tokens", "prompt_token_ids", "lora_request", "cache_salt"),
        why="what the scheduler side plans chunks from",
        used_in=(_SCHED, _GROUPS),
    ),
    Contract("vllm", "vllm.lora.request", "LoRARequest", ("lora_name",), used_in=(_SCHED, _GROUPS)),
    Contract(
        "vllm",
        _BASE,
        "KVConnectorBase_V1",
        (
            "register_kv_caches(kv_caches)",
            "start_load_kv(forward_context)",
            "wait_for_layer_load(layer_name)",
            "save_kv_layer(layer_name, kv_layer, attn_metadata)",
            "wait_for_save()",
            "handle_preemptions(kv_connector_metadata)",
            "get_finished(finished_req_ids)",
            "get_transfer_results(finished_req_ids)",
            "get_block_ids_with_load_errors()",
            "get_kv_connector_stats()",
            "shutdown()",
            "get_num_new_matched_tokens(request, num_computed_tokens)",
            "update_state_after_alloc(request, blocks, num_external_tokens)",
            "build_connector_meta(scheduler_output)",
            "request_finished(request, block_ids)",
            "requires_kv_delivery",
            "build_kv_connector_stats(data)",
            "build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)",
            "supports_sleep_mode(kv_transfer_config)?",
            "role",
        ),
        why="the hooks MaruKVConnector overrides: a renamed hook or parameter would never be called; "
        "supports_sleep_mode is only asked by releases that have it",
        used_in=(_CONN,),
    ),
    Contract("vllm", _BASE, "SupportsHMA", ("request_finished_all_groups(request, block_ids)",), used_in=(_CONN,)),
    Contract("vllm", _BASE, "KVConnectorRole", ("SCHEDULER", "WORKER"), used_in=(_CONN,)),
    Contract(
        "vllm",
        _BASE,
        "KVConnectorTransferResults",
        ("finished_sending", "finished_recving", "failed_recving"),
        used_in=(_CONN,),
    ),
    Contract(
        "vllm",
        _METRICS,
        "KVConnectorStats",
        ("__init__(data)", "data", "aggregate(other)", "reduce()", "is_empty()", "reset()"),
        used_in=("maru_vllm/connector/stats.py",),
    ),
    Contract(
        "vllm",
        _METRICS,
        "KVConnectorPromMetrics",
        ("__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)", "observe(transfer_stats_data)")
        + ("_counter_cls",),
        used_in=("maru_vllm/connector/stats.py",),
    ),
    Contract(
        "vllm",
        "vllm.config.vllm",
        "VllmConfig",
        ("kv_transfer_config", "cache_config", "model_config", "parallel_config", "scheduler_config")
        + ("compilation_config", "logging_config"),
        used_in=(_CONN, "maru_vllm/connector/namespace.py", "maru_vllm/connector/engine_support.py"),
    ),
    Contract(
        "vllm",
        "vllm.config.kv_transfer",
        "KVTransferConfig",
        ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_connector_module_path", "is_kv_consumer")
        + ("is_kv_producer", "kv_load_failure_policy?"),
        why="the connector's own configuration; the load-failure policy is read with a fallback",
        used_in=(_CONN, "components/maru_worker.py"),
    ),
    Contract(
        "vllm",
        "vllm.config.cache",
        "CacheConfig",
        ("block_size", "enable_prefix_caching", "cache_dtype", "prefix_caching_hash_algo?")
        + ("get_resolved_kv_cache_layout()",),
        used_in=(_CONN, "maru_vllm/connector/namespace.py", "maru_vllm/connector/engine_support.py"),
    ),
    Contract(
        "vllm",
        "vllm.config.model",
        "ModelConfig",
        ("model", "dtype", "revision?", "max_model_len", "get_vocab_size()", "get_diff_sampling_param()")
        + ("runner_type?",),
        used_in=("maru_vllm/connector/namespace.py", "maru_vllm/launch/warmup.py", "components/disagg/standby.py"),
    ),
    Contract(
        "vllm",
        "vllm.config.parallel",
        "ParallelConfig",
        ("tensor_parallel_size", "pipeline_parallel_size"),
        used_in=(_CONN, "maru_vllm/connector/namespace.py"),
    ),
    Contract(
        "vllm",
        "vllm.config.scheduler",
        "SchedulerConfig",
        ("enable_chunked_prefill?",),
        used_in=("maru_vllm/connector/engine_support.py",),
    ),
    Contract(
        "vllm",
        "vllm.config.speculative",
        "SpeculativeConfig",
        ("method", "uses_draft_kv_cache()"),
        why="whether a speculative drafter keeps KV layers of its own beside the target's",
        used_in=("maru_vllm/connector/engine_support.py",),
    ),
    Contract(
        "vllm",
        "vllm.config.model",
        "ModelConfig",
        ("get_num_layers_by_block_type(parallel_config, block_type)",),
        why="the target model's attention layers on this stage, against the KV cache's",
        used_in=("maru_vllm/connector/engine_support.py",),
    ),
    Contract("vllm", "vllm.config.logging", "LoggingConfig", ("configure_logging",), used_in=(_CONN,)),
    Contract(
        "vllm",
        "vllm.config.compilation",
        "CompilationConfig",
        ("static_forward_context?",),
        why="attention layers by name, to name the attention backend (read with a fallback)",
        used_in=(_CONN,),
    ),
    Contract(
        "vllm",
        _KVI,
        "KVCacheConfig",
        ("kv_cache_groups", "num_blocks"),
        used_in=("maru_vllm/connector/kv_groups.py", "maru_vllm/connector/namespace.py", _CONN),
    ),
    Contract(
        "vllm",
        _KVI,
        "KVCacheGroupSpec",
        ("kv_cache_spec", "layer_names"),
        used_in=("maru_vllm/connector/kv_groups.py",),
    ),
    Contract(
        "vllm",
        _KVI,
        "AttentionSpec",
        ("block_size", "num_kv_heads", "head_size"),
        used_in=("maru_vllm/connector/kv_groups.py", "maru_vllm/connector/namespace.py"),
    ),
    Contract(
        "vllm",
        _KVI,
        "FullAttentionSpec",
        why="matched by class name: blocks live as long as the request",
        used_in=("maru_vllm/connector/kv_groups.py",),
    ),
    Contract("vllm", _KVI, "MLAAttentionSpec", used_in=("maru_vllm/connector/kv_groups.py",)),
    Contract(
        "vllm",
        _KVI,
        "SinkFullAttentionSpec",
        optional=True,
        why="matched by class name where it exists",
        used_in=("maru_vllm/connector/kv_groups.py",),
    ),
    Contract(
        "vllm",
        _KVI,
        "SlidingWindowSpec",
        ("sliding_window",),
        used_in=("maru_vllm/connector/kv_groups.py",),
    ),
    Contract(
        "vllm",
        _KVI,
        "UniformTypeKVCacheSpecs",
        ("kv_cache_specs",),
        why="a group of several layer specs of one type (read with a fallback)",
        used_in=("maru_vllm/connector/kv_groups.py", "maru_vllm/connector/namespace.py"),
    ),
    Contract(
        "vllm",
        "vllm.distributed.parallel_state",
        "GroupCoordinator",
        ("rank_in_group", "world_size"),
        used_in=(_CONN,),
    ),
    Contract("vllm", "vllm.platforms.interface", "Platform", ("device_type",), used_in=(_CONN,)),
    Contract(
        "vllm",
        "vllm.envs",
        attrs=("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES",),
        used_in=("maru_vllm/events/vllm_format.py",),
    ),
    Contract(
        "vllm",
        "vllm.distributed.kv_events",
        "BlockStored",
        ("block_hashes", "parent_block_hash", "token_ids", "block_size")
        + ("lora_id", "medium", "lora_name", "extra_keys"),
        why="the pool's chunks are announced as vLLM's own events (encoded field by field)",
        used_in=("maru_vllm/events/vllm_format.py",),
    ),
    Contract(
        "vllm",
        "vllm.distributed.kv_events",
        "BlockRemoved",
        ("block_hashes", "medium"),
        used_in=("maru_vllm/events/vllm_format.py",),
    ),
    Contract(
        "vllm",
        "vllm.distributed.kv_events",
        "KVEventBatch",
        ("ts", "events", "data_parallel_rank"),
        why="the relay decodes vLLM's batches and builds its own in the same layout",
        used_in=("maru_vllm/events/vllm_format.py",),
    ),
    Contract(
        "vllm",
        "vllm.v1.attention.backend",
        "AttentionBackend",
        ("get_name()",),
        why="the attention backend's name, part of the object layout's identity",
        used_in=(_CONN,),
    ),
    Contract(
        "vllm",
        "vllm.engine.protocol",
        "EngineClient",
        ("generate(prompt, sampling_params, request_id)",),
        used_in=("maru_vllm/launch/warmup.py",),
    ),
)

_KERNELS = "maru_vllm/connector/kernels.py"
_GPU_UTILS = "lmcache.v1.gpu_connector.utils"

# LMCache serves the CUDA kernel path only. kernels.py resolves each piece wherever the installed
# release has it; these contracts name every such place, so each supported release must have one
# of them (a release lacking all of them would silently fall back to the torch copies).
LMCACHE_CONTRACTS: tuple[Contract, ...] = (
    Contract(
        "lmcache",
        "lmcache.cuda_ops",
        attrs=("multi_layer_kv_transfer", "single_layer_kv_transfer", "load_and_reshape_flash")
        + ("reshape_and_cache_back_flash", "multi_layer_block_kv_transfer?"),
        alternatives=("lmcache.c_ops",),
        why="compiled transfer kernels: lmcache.c_ops up to 0.5.3, lmcache.cuda_ops from 0.5.4",
        used_in=(_KERNELS,),
    ),
    Contract(
        "lmcache",
        "lmcache.lmcache_native",
        attrs=("EngineKVFormat|GPUKVFormat", "TransferDirection"),
        alternatives=("lmcache.c_ops",),
        why="the kernels' enums: on lmcache.c_ops (EngineKVFormat first named GPUKVFormat) up to "
        "0.5.3, on lmcache.lmcache_native from 0.5.4",
        used_in=(_KERNELS,),
    ),
    Contract(
        "lmcache",
        "lmcache.lmcache_native",
        "TransferDirection",
        ("H2D", "D2H"),
        alternatives=("lmcache.c_ops:TransferDirection",),
        why="the block copier's transfer direction",
        used_in=(_KERNELS, "maru_vllm/connector/transfer.py"),
    ),
    Contract(
        "lmcache",
        "lmcache.lmcache_native",
        "PageBufferShapeDesc",
        ("kv_size", "nh", "hs"),
        alternatives=("lmcache.c_ops:PageBufferShapeDesc",),
        why="the page geometry the block copier reads",
        used_in=(_KERNELS, "maru_vllm/connector/transfer.py"),
    ),
    Contract(
        "lmcache",
        "lmcache.v1.gpu_connector.kv_format.detection",
        "detect_format",
        alternatives=(f"{_GPU_UTILS}:normalize_kv_and_discover_format", f"{_GPU_UTILS}:discover_gpu_kv_format"),
        why="LMCache's KV layout detection, under three names across releases",
        used_in=(_KERNELS,),
    ),
    Contract(
        "lmcache",
        _GPU_UTILS,
        attrs=("make_page_buffer_shape_desc|is_mla+get_num_heads+get_head_size", "get_group_data_ptrs?"),
        why="the block copier's page descriptor (made by LMCache, or composed from its getters) and "
        "pointer table (the caches' own pointers where LMCache has no helper)",
        used_in=(_KERNELS,),
    ),
    Contract(
        "lmcache",
        "lmcache.v1.platform.torch_ops.mp_mem_kernels",
        "multi_layer_block_kv_transfer",
        optional=True,
        alternatives=(
            "lmcache.v1.platform.torch_ops:multi_layer_block_kv_transfer",
            "lmcache.python_ops_fallback:multi_layer_block_kv_transfer",
        ),
        why="LMCache's torch block kernel, the copier's fallback when a compiled launch fails (on a "
        "release without one, every later copy of that worker is a miss)",
        used_in=(_KERNELS,),
    ),
    Contract(
        "lmcache",
        "lmcache.integration.vllm.utils",
        attrs=("translate_vllm_kv_cache_layout",),
        optional=True,
        why="vLLM's layout name in LMCache's terms; without it kernels.py maps the names it knows",
        used_in=(_KERNELS,),
    ),
    Contract("lmcache", "lmcache.utils", "EngineType", ("VLLM",), used_in=(_KERNELS,)),
)

DYNAMO_CONTRACTS: tuple[Contract, ...] = (
    Contract(
        "ai-dynamo",
        _DM,
        attrs=(
            "setup_kv_event_publisher(config, generate_endpoint, vllm_config)",
            "KvEventPublisher",
            "register_vllm_model(model_input, model_type, generate_endpoint, config, engine_client, vllm_config)",
            "install_signal_handlers",
            "create_runtime",
            "shutdown_endpoints",
        ),
        why="the module attributes the Maru worker wraps before dynamo.vllm runs (the one module that "
        "does, checking these parameters at start-up)",
        used_in=("components/dynamo_hooks.py",),
    ),
    Contract(
        "ai-dynamo",
        "dynamo.common.utils.graceful_shutdown",
        attrs=(
            "install_signal_handlers(loop, runtime, endpoints, shutdown_event, grace_period_s, drain_callback)",
            "_shutdown_started?",
        ),
        used_in=("components/dynamo_hooks.py", "components/disagg/hook.py"),
    ),
    Contract(
        "ai-dynamo",
        "dynamo.vllm.kv_connector_protocols",
        "KvConnectorProtocol",
        (
            "__init__(vllm_config)",
            "produces_kv_transfer_params",
            "prefill_request_kv_transfer_params()",
            "decode_request_kv_transfer_params(prefill_response)",
        ),
        why="the PD registry's base class the Maru protocol subclasses",
        used_in=("components/dynamo_pd.py",),
    ),
    Contract(
        "ai-dynamo",
        "dynamo.vllm.kv_connector_protocols",
        attrs=("KV_CONNECTOR_PROTOCOLS", "make_kv_connector_protocol"),
        used_in=("components/dynamo_pd.py",),
    ),
    Contract(
        "ai-dynamo",
        "dynamo.vllm.handlers",
        "DecodeWorkerHandler",
        (
            "__init__(runtime, config, engine, default_sampling_params, model_max_len)",
            "__init__(*, model_config, enable_multimodal, generate_endpoint, use_vllm_tokenizer, shutdown_event)",
            "__init__(*, enable_frontend_decoding)",
            "generate",
        ),
        why="a stand-in worker builds dynamo.vllm's own handler of the other role",
        used_in=("components/disagg/standby.py",),
    ),
    Contract(
        "ai-dynamo",
        "dynamo.vllm.handlers",
        "PrefillWorkerHandler",
        (
            "__init__(runtime, config, engine, default_sampling_params, model_max_len)",
            "__init__(*, model_config, enable_multimodal, generate_endpoint, use_vllm_tokenizer, shutdown_event)",
            "__init__(*, enable_frontend_decoding)",
            "generate",
        ),
        used_in=("components/disagg/standby.py",),
    ),
    Contract(
        "ai-dynamo",
        "dynamo.vllm.args",
        "Config",
        ("namespace", "component", "disaggregation_mode", "use_kv_events", "enable_local_indexer")
        + ("endpoint_types", "use_vllm_tokenizer", "enable_multimodal", "frontend_decoding"),
        why="the worker's configuration, copied and re-aimed for a stand-in role",
        used_in=("components/disagg/standby.py", "components/disagg/hook.py"),
    ),
    Contract(
        "ai-dynamo",
        "dynamo._core",
        "Endpoint",
        ("connection_id()", "client()", "serve_endpoint(*, graceful_shutdown)"),
        used_in=("components/disagg/standby.py", "components/disagg/hook.py", "maru_vllm/launch/lifecycle.py"),
    ),
    Contract(
        "ai-dynamo",
        "dynamo._core",
        "DistributedRuntime",
        ("endpoint(path)",),
        used_in=("components/disagg/standby.py",),
    ),
    Contract(
        "ai-dynamo",
        "dynamo.common.utils.prometheus",
        attrs=("register_engine_metrics_callback(*, endpoint, registry, metric_prefix_filters)",),
        used_in=("components/disagg/standby.py",),
    ),
)

CONTRACTS: tuple[Contract, ...] = VLLM_CONTRACTS + LMCACHE_CONTRACTS + DYNAMO_CONTRACTS
