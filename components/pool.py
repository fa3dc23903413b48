"""`python -m maru_dynamo.components.pool --name N --size S [pool serve options]`: the pool service.

The per-host KV pool as a graph component: the same options as ``maru-dynamo pool serve``
(docs/pool.md), handled by `maru_vllm.pool.cli` so that the graph runner, the Kubernetes
DaemonSet and a person at a shell all start exactly the same service. A leading ``serve`` is
accepted too, for symmetry with the CLI.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from maru_vllm.cli_parser import StrictArgumentParser
from maru_vllm.pool.cli import register


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        args = args[1:]
    # prog "maru-dynamo" so usage and errors read "maru-dynamo pool serve ...", as in docs/pool.md.
    parser = StrictArgumentParser(prog="maru-dynamo")
    register(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["pool", "serve", *args])
    return int(ns.func(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
