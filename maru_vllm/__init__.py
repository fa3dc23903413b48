"""maru-dynamo: vLLM workers under NVIDIA Dynamo sharing one KV-cache pool (Maru).

`maru_vllm` holds the engine-side pieces (the pool client and service, the vLLM KV connector,
the KV-event relay, process launching, the what-if replay, the fixtures tests and benchmarks run
on). The Dynamo side (`components/`, `graphs/`: the graph components, the graph descriptions and
the `maru-dynamo` command line) builds on it; this package never imports that side
(`tests/test_import_layers.py`).
"""

__version__ = "0.1.0"
