"""The two roles of a disaggregated Dynamo graph and the Dynamo endpoints each one serves."""

from __future__ import annotations

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)

# dynamo.vllm's component per `--disaggregation-mode` (dynamo/vllm/args.py, ai-dynamo 1.6.1).
COMPONENT = {PREFILL: "prefill", DECODE: "backend"}
GENERATE = "generate"  # the endpoint the frontend routes to
WATCH = "maru_watch"  # the liveness stream every disaggregated Maru worker serves (peers.py)


def other_role(role: str) -> str:
    """The role a worker of `role` stands in for."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    return DECODE if role == PREFILL else PREFILL


def endpoint_path(namespace: str, role: str, endpoint: str) -> str:
    """`namespace.component.endpoint` of `role`'s `endpoint` (Dynamo's endpoint path)."""
    return f"{namespace}.{COMPONENT[role]}.{endpoint}"
