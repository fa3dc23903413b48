"""`python -m maru_vllm.pool serve|status ...` - the same commands as `maru-dynamo pool`."""

from __future__ import annotations

import sys

from maru_vllm.cli_parser import StrictArgumentParser
from maru_vllm.pool.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = StrictArgumentParser(prog="python -m maru_vllm.pool")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register(sub)
    args = parser.parse_args(["pool", *(sys.argv[1:] if argv is None else argv)])
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
