"""`python -m maru_dynamo.components.vllm_worker ARGS`: run `dynamo.vllm` on this install.

A thin entry point: it applies the text-only stand-ins (see `maru_vllm.text_only`), picks a KV
space on CPU installs where none is given (`maru_vllm.launch.cpu_kv`), and then hands every
argument to `dynamo.vllm` unchanged. The Maru worker component builds on it.
"""

from __future__ import annotations

import runpy
import sys

from maru_vllm.launch.cpu_kv import NotEnoughMemory, apply_default_kv_space
from maru_vllm.text_only import install_text_only_stand_ins


def main(argv: list[str] | None = None) -> None:
    install_text_only_stand_ins()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        apply_default_kv_space(sys.argv[1:])  # on CPU installs with no KV size given
    except NotEnoughMemory as exc:
        sys.exit(f"vllm_worker: {exc}")
    runpy.run_module("dynamo.vllm", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
