"""KV capacity a Maru engine keeps with vLLM's hybrid KV cache manager, against the manager off.

For each model and context length, one engine with MaruKVConnector starts twice in the same KV
space (`VLLM_CPU_KVCACHE_SPACE`, 1 GiB by default): as it runs (the connector declares
SupportsHMA, so vLLM keeps its hybrid manager) and with `--disable-hybrid-kv-cache-manager` (what
a connector without SupportsHMA gets: sliding-window layers then hold KV for the whole
context). The figure is vLLM's own start-up line, "Maximum concurrency for N tokens per
request": how many requests of that length fit. Nothing is timed.

    python benchmarks/bench_hma_capacity.py                   # gemma3 and gpt-oss, 4k and 8k
    python benchmarks/bench_hma_capacity.py --models gemma3 --context 4096 --json out.json
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from harness import write_json
from maru_vllm.cli_parser import StrictArgumentParser
from maru_vllm.fixtures.models import SHAPES, ensure_model
from maru_vllm.launch import ProcessGroup, free_port, stack

CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def max_concurrency(model: str, context: int, hma: bool, pool_address: str, log_dir: Path) -> float:
    """vLLM's start-up figure for one engine with the connector (hybrid manager on or off)."""
    env = stack.StackEnv(discovery_dir=log_dir / "discovery").build(cpu_thread=0)
    extra = ["--max-num-seqs", "4"] + ([] if hma else ["--disable-hybrid-kv-cache-manager"])
    kv = {
        "kv_connector": "MaruKVConnector",
        "kv_connector_module_path": "maru_vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"maru_pool_address": pool_address},
    }
    name = f"{model}-{context}-{'hma' if hma else 'nohma'}"
    proc, _ = stack.vllm_openai_server(
        name,
        ensure_model(model),
        env,
        log_dir,
        port=free_port(),
        max_model_len=context,
        kv_transfer_config=kv,
        extra_args=extra,
    )
    group = ProcessGroup()
    group.start(proc)
    try:
        proc.wait_until(lambda: CONCURRENCY.search(proc.log_text()) is not None, 300, "vLLM's concurrency line")
        found = CONCURRENCY.search(proc.log_text())
        assert found is not None
        return float(found.group(2))
    finally:
        group.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = StrictArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gemma3", "gpt-oss"], choices=sorted(SHAPES))
    parser.add_argument("--context", nargs="+", type=int, default=[4096, 8192], help="max_model_len values")
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    args = parser.parse_args(argv)
    if any(c < 256 for c in args.context):
        parser.error(f"--context {min(args.context)}: each context must be at least 256 tokens")
    rows = []
    with tempfile.TemporaryDirectory(prefix="maru-hma-") as tmp:
        log_dir = Path(tmp)
        procs = ProcessGroup()
        pool = stack.PoolProcess(f"hma{free_port()}", "64M", log_dir / "pool.log")
        procs.start(pool)
        try:
            pool.wait_ready()
            for model in args.models:
                for context in args.context:
                    on = max_concurrency(model, context, True, pool.address, log_dir)
                    off = max_concurrency(model, context, False, pool.address, log_dir)
                    rows.append({"model": model, "context": context, "hma_on": on, "hma_off": off, "ratio": on / off})
                    print(
                        f"{model:10s} {context:6d} tokens: {on:8.2f} requests with the hybrid manager, "
                        f"{off:8.2f} without ({on / off:.2f}x)",
                        flush=True,
                    )
        finally:
            procs.stop_all()
            pool.region_path.unlink(missing_ok=True)  # a pool's region outlives it; this one is done
    if args.json:
        write_json(args.json, {"kv_cache_space_gib": 1, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
