"""MaruKVConnector: a vLLM KV connector over the shared Maru pool.

vLLM loads it from `kv_connector_module_path="maru_vllm.connector"`; importing this package is
what makes `MaruKVConnector` resolvable by name.
"""

from maru_vllm.connector.connector import MaruKVConnector

__all__ = ["MaruKVConnector"]
