"""`python -m maru_dynamo.components.vllm_worker ARGS`: run `dynamo.vllm` on this install.

A thin entry point, and the start-up every worker of this package shares (the Maru worker runs
the same steps, `start_worker_process` then `engine_args`): it applies the text-only stand-ins
(see `maru_dynamo.components.text_only`), gives the engine's IPC sockets a directory removed at
exit (`maru_vllm.launch.rpc_dir`), picks a KV space on CPU installs where none is given
(`maru_vllm.launch.cpu_kv`), and then hands every argument to `dynamo.vllm` unchanged.
"""

from __future__ import annotations

import sys

from maru_dynamo.components.text_only import install_text_only_stand_ins
from maru_vllm.launch.cpu_kv import NotEnoughMemory, apply_default_kv_space
from maru_vllm.launch.handoff import run_module_as_main
from maru_vllm.launch.rpc_dir import use_private_rpc_dir


def start_worker_process() -> None:
    """A worker process's first steps, before anything imports vLLM or Dynamo."""
    install_text_only_stand_ins()
    use_private_rpc_dir()  # vLLM's IPC socket files: in a dir of this worker's, removed at exit


def engine_args(prog: str, args: list[str]) -> list[str]:
    """`args` for `dynamo.vllm`, with a KV space picked on CPU installs where none is given;
    SystemExit in one line (`prog: ...`) when the host has too little memory for one."""
    try:
        apply_default_kv_space(args)
    except NotEnoughMemory as exc:
        sys.exit(f"{prog}: {exc}")
    return args


def main(argv: list[str] | None = None) -> None:
    start_worker_process()
    args = sys.argv[1:] if argv is None else list(argv)
    run_module_as_main("dynamo.vllm", engine_args("vllm_worker", args))


if __name__ == "__main__":
    main()
