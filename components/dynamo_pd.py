"""MaruKVConnector in Dynamo's prefill/decode (PD) connector-protocol registry.

`dynamo.vllm` (ai-dynamo 1.6.1) coordinates a disaggregated request per KV connector: its
prefill handler looks the engine's `kv_transfer_config.kv_connector` up in
`dynamo.vllm.kv_connector_protocols.KV_CONNECTOR_PROTOCOLS` and asks the protocol object for

* `prefill_request_kv_transfer_params()`: the `kv_transfer_params` put on the prefill engine
  request (NIXL: `do_remote_decode=True`, so vLLM keeps the blocks for a remote pull);
* `decode_request_kv_transfer_params(prefill_response)`: what travels to the decode worker as
  `prefill_result.disaggregated_params.kv_transfer_params` (NIXL: block ids, host, port).

A connector name missing from that dict fails every prefill request with
"Unsupported kv_connector=... for PD". The decode handler copies whatever it receives into the
decode request's `kv_transfer_params` and otherwise runs a normal generate over the same prompt.

Maru is cache-mediated: the prefill engine (`kv_producer`) stores every full prompt chunk in the
pool synchronously at the end of the step that computed it, i.e. before the prefill response
exists, and the decode engine (`kv_consumer`) finds those chunks by their vLLM block hashes when
it schedules the prompt. Nothing per request has to cross the PD boundary, so this protocol
sends empty params both ways. Decode's `{}` is deliberately not `None`: with `None` (and no
multimodal handoff) the prefill response carries no `disaggregated_params` at all, which
Dynamo's frontend rejects ("No disaggregated params in prefill response"). Whatever decode
cannot load (the trailing partial chunk, an evicted or corrupt object, an unreachable pool) it
computes itself: a miss degrades to local prefill, never to a failed request.

`produces_kv_transfer_params = False` marks the entry cache-mediated for Dynamo's wrapper
resolution: in a `MultiConnector`/`PdConnector` beside a transport connector (NIXL, Mooncake),
the transport child owns PD coordination and Maru rides along.

`register_maru_pd_protocol()` adds the entry in this process (no installed file is changed);
`components/maru_worker.py` calls it before it runs `dynamo.vllm`. The registry is read per
request, so registering any time before the first request works. Only the Dynamo module is
imported: neither vLLM nor the rest of `dynamo.vllm`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "MaruKVConnector"
PROTOCOLS_MODULE = "dynamo.vllm.kv_connector_protocols"
# The registry API this module was written against (ai-dynamo 1.6.1).
_ABSTRACT_METHODS = frozenset({"prefill_request_kv_transfer_params", "decode_request_kv_transfer_params"})

_protocol_class: type | None = None


class DynamoPdApiError(RuntimeError):
    """Dynamo's PD connector-protocol registry does not have the shape this module expects."""


def _protocols_module() -> Any:
    import importlib

    try:
        mod = importlib.import_module(PROTOCOLS_MODULE)
    except ImportError as exc:
        raise DynamoPdApiError(
            f"{PROTOCOLS_MODULE} cannot be imported ({exc}); MaruKVConnector's disaggregated mode is "
            "written for ai-dynamo 1.6.1 (pip install 'maru-dynamo[dynamo]')"
        ) from exc
    check_registry_api(mod)
    return mod


def check_registry_api(mod: Any) -> None:
    """Raise `DynamoPdApiError` unless `mod` has the 1.6.1 registry shape we rely on."""
    problems = []
    base = getattr(mod, "KvConnectorProtocol", None)
    registry = getattr(mod, "KV_CONNECTOR_PROTOCOLS", None)
    if not inspect.isclass(base):
        problems.append("no class KvConnectorProtocol")
    else:
        abstract = set(getattr(base, "__abstractmethods__", ()))
        if abstract != _ABSTRACT_METHODS:
            problems.append(
                f"KvConnectorProtocol's abstract methods are {sorted(abstract)}, expected {sorted(_ABSTRACT_METHODS)}"
            )
        if not isinstance(getattr(base, "produces_kv_transfer_params", None), bool):
            problems.append("KvConnectorProtocol has no bool produces_kv_transfer_params")
        params = list(inspect.signature(base.__init__).parameters)
        if params != ["self", "vllm_config"]:
            problems.append(f"KvConnectorProtocol.__init__ takes {params}, expected ['self', 'vllm_config']")
    if not isinstance(registry, dict):
        problems.append("no dict KV_CONNECTOR_PROTOCOLS")
    if not callable(getattr(mod, "make_kv_connector_protocol", None)):
        problems.append("no make_kv_connector_protocol()")
    if problems:
        raise DynamoPdApiError(
            f"{PROTOCOLS_MODULE} changed ({'; '.join(problems)}); MaruKVConnector's PD registration "
            "supports ai-dynamo 1.6.1 only"
        )


def maru_pd_protocol_class() -> type:
    """The protocol class for MaruKVConnector (built once, on Dynamo's base class)."""
    global _protocol_class
    if _protocol_class is not None:
        return _protocol_class
    base = _protocols_module().KvConnectorProtocol

    class MaruPoolProtocol(base):  # type: ignore[misc, valid-type]  # a base class found at run time
        """Cache-mediated PD through the Maru pool: no per-request params either way."""

        produces_kv_transfer_params = False

        def prefill_request_kv_transfer_params(self) -> dict[str, Any]:
            # The prefill engine stores its prompt chunks unconditionally (kv_producer) and frees
            # its blocks when the one-token request finishes: nothing to hold for a remote pull.
            return {}

        def decode_request_kv_transfer_params(self, prefill_response: Any) -> dict[str, Any]:
            # Empty but present: the frontend requires the disaggregated_params envelope. Decode
            # re-sends the prompt and its connector loads the stored chunks by block hash.
            return {}

    MaruPoolProtocol.__module__ = __name__
    MaruPoolProtocol.__qualname__ = "MaruPoolProtocol"
    _protocol_class = MaruPoolProtocol
    return MaruPoolProtocol


def register_maru_pd_protocol() -> type:
    """Register MaruKVConnector in Dynamo's PD registry of this process; idempotent.

    Returns the registered class. Raises `DynamoPdApiError` when the installed Dynamo has no
    registry of the expected shape (then disaggregated Maru workers could not serve a request).
    """
    mod = _protocols_module()
    cls = maru_pd_protocol_class()
    current = mod.KV_CONNECTOR_PROTOCOLS.get(CONNECTOR_NAME)
    if current is cls:
        return cls
    if current is not None:
        logger.warning(
            "replacing Dynamo's PD protocol %r for %s with Maru's cache-mediated one", current, CONNECTOR_NAME
        )
    mod.KV_CONNECTOR_PROTOCOLS[CONNECTOR_NAME] = cls
    logger.debug("registered %s in %s.KV_CONNECTOR_PROTOCOLS (cache-mediated)", CONNECTOR_NAME, PROTOCOLS_MODULE)
    return cls
