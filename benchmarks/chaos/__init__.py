"""The chaos soak's parts (benchmarks/chaos_soak.py): load, faults, samplers, graph probes."""
