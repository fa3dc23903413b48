"""`python -m maru_dynamo.components.vllm_worker ARGS`: run `dynamo.vllm` on this install.

A thin entry point: it applies the text-only stand-ins (see `maru_dynamo.components.text_only`), gives
the engine's IPC sockets a directory removed at exit (`maru_vllm.launch.rpc_dir`), picks a KV
space on CPU installs where none is given (`maru_vllm.launch.cpu_kv`), and then hands every
argument to `dynamo.vllm` unchanged. The Maru worker component builds on it.
"""

from __future__ import annotations

import sys

from maru_dynamo.components.text_only import install_text_only_stand_ins
from maru_vllm.launch.cpu_kv import NotEnoughMemory, apply_default_kv_space
from maru_vllm.launch.handoff import run_module_as_main
from maru_vllm.launch.rpc_dir import use_private_rpc_dir


def main(argv: list[str] | None = None) -> None:
    install_text_only_stand_ins()
    use_private_rpc_dir()  # vLLM's IPC socket files: in a dir of this worker's, removed at exit
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        apply_default_kv_space(args)  # on CPU installs with no KV size given
    except NotEnoughMemory as exc:
        sys.exit(f"vllm_worker: {exc}")
    run_module_as_main("dynamo.vllm", args)


if __name__ == "__main__":
    main()
