"""maru-dynamo: vLLM workers under NVIDIA Dynamo sharing one KV-cache pool (Maru).

`maru_vllm` holds the engine-side pieces (the pool client and service, the vLLM KV connector,
the offline model fixture); `maru_dynamo.components` / `maru_dynamo.graphs` hold the Dynamo
graph components and graph descriptions.
"""

__version__ = "0.1.0"
