"""No exception from the connector reaches vLLM: every hook is contained and fails closed.

The e2e counterpart (tests/e2e/test_connector_faults_e2e.py) injects a failure into each hook of
a real engine in turn; these check the pieces it relies on: that every hook vLLM calls is
wrapped, and what each fallback reports.
"""

from __future__ import annotations

import inspect

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from maru_vllm.connector import MaruKVConnector
from maru_vllm.connector.load_guard import SchedulerLoadGuard

# Not hooks of a running engine: the class's own declarations.
NOT_HOOKS = {"__init__", "supports_sleep_mode", "requires_kv_delivery"}


def _hooks() -> list[str]:
    return sorted(
        name
        for name, member in vars(MaruKVConnector).items()
        if hasattr(KVConnectorBase_V1, name) and name not in NOT_HOOKS and not name.startswith("_")
    )


def test_every_hook_vllm_calls_is_contained() -> None:
    hooks = _hooks()
    assert {"build_connector_meta", "register_kv_caches", "handle_preemptions", "get_transfer_results"} <= set(hooks)
    for name in hooks:
        member = inspect.getattr_static(MaruKVConnector, name)
        fn = member.__func__ if isinstance(member, classmethod) else member
        assert getattr(fn, "__maru_contained__", False), f"MaruKVConnector.{name} is not contained"


def test_sleep_mode_is_declared_unsupported() -> None:
    """vLLM's config check (0.33+) then refuses --enable-sleep-mode with this connector."""
    assert MaruKVConnector.supports_sleep_mode(None) is False


def _blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(blocks=([KVCacheBlock(block_id=i) for i in ids],))


def test_a_failed_seal_fails_every_granted_block_from_vllms_calls_alone() -> None:
    guard = SchedulerLoadGuard(block_size=16)
    guard.asked("r1", 32)  # local prefix-cache hit: two blocks
    guard.granted_load("r1", 40, _blocks([10, 11, 12, 13, 14]))  # tokens 32..72: blocks 2..4
    guard.asked("r2", 0)
    guard.granted_load("r2", 0, _blocks([20]))  # nothing granted: nothing to fail
    meta = guard.fail_step()
    assert [(f.req_id, f.block_ids) for f in meta.load_failures] == [("r1", [12, 13, 14])]
    assert not meta.loads and not meta.stores
    assert guard.granted == {} and guard.granted_blocks == {}
    # The next step starts clean.
    assert guard.fail_step().load_failures == []


def test_the_guard_keeps_nothing_of_a_request_that_was_asked_but_never_admitted() -> None:
    guard = SchedulerLoadGuard(block_size=16)
    guard.asked("waiting-then-aborted", 32)
    guard.forget("waiting-then-aborted")
    assert guard.local_tokens == {}


def test_a_failed_seal_fails_every_asynchronous_load_by_request() -> None:
    guard = SchedulerLoadGuard(block_size=16, asynchronous=True)
    guard.asked("r1", 0)
    guard.granted_load("r1", 32, _blocks([1, 2]))
    meta = guard.fail_step()
    assert meta.async_loads == {"r1"} and meta.async_failed == {"r1"}
    assert not meta.loads


# ---- the start-up check of what the connector relies on in vLLM ------------------------------
def test_the_installed_vllm_has_every_declared_contract() -> None:
    from maru_vllm.connector.upstream_check import moved_contracts

    assert moved_contracts() == []


def test_a_moved_field_method_or_module_is_named() -> None:
    from maru_vllm.connector.upstream_check import moved_contracts
    from maru_vllm.upstream_contracts import Contract

    output = "vllm.v1.core.sched.output"
    contracts = (
        Contract("vllm", output, "SchedulerOutput", ("scheduled_new_reqs", "scheduled_requests_v2")),
        Contract("vllm", output, "CachedRequestData", ("resumed_req_ids?",)),  # read with a fallback
        Contract("vllm", output, "NoSuchClass"),
        Contract("vllm", "vllm.no_such_module"),
        Contract("vllm", "vllm.v1.request", "Request", ("request_id", "num_tokens_v2")),  # set in __init__
        Contract(
            "vllm",
            "vllm.distributed.kv_transfer.kv_connector.v1.base",
            "KVConnectorBase_V1",
            ("get_num_new_matched_tokens(request, num_computed_tokens)", "start_load_kv(context)"),
        ),
        Contract("vllm", output, "GoneButHandled", optional=True),
    )
    assert moved_contracts(contracts) == [
        f"{output}:SchedulerOutput.scheduled_requests_v2",
        f"{output}:NoSuchClass",
        "vllm.no_such_module",
        "vllm.v1.request:Request.num_tokens_v2",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.start_load_kv(context)",
    ]


def test_a_vllm_that_moved_a_contract_gets_a_connector_that_stands_aside_in_one_line(
    tiny_model, pool, monkeypatch, caplog
) -> None:
    """The real scheduler builds the connector; with one contract moved it looks nothing up."""
    import logging

    from maru_vllm.connector import connector as connector_module
    from tests.connector.sched_harness import make_scheduler

    monkeypatch.setattr(connector_module, "moved_contracts", lambda: ["vllm.v1.core.sched.output:X.y"])
    with caplog.at_level(logging.WARNING):
        sched = make_scheduler(tiny_model, pool.address)
    connector = sched.connector
    assert connector is not None
    assert not connector.can_load and not connector.can_store
    aside = [r.getMessage() for r in caplog.records if "stands aside" in r.getMessage()]
    assert len(aside) == 1
    assert "vllm.v1.core.sched.output:X.y" in aside[0] and "supported releases: 0.31.0 - 0.34.0" in aside[0]
