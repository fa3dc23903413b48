"""The parser of our own commands: long options spelled in full only."""

from __future__ import annotations

import argparse
from typing import Any


class StrictArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that takes only options spelled in full.

    argparse accepts any unambiguous prefix of a long option by default, so a mistyped or
    shortened option silently means another one (`whatif --trace FILE` would be taken as
    `--trace-block-size FILE`). Every `maru-dynamo` command refuses that instead; the class is
    inherited by every sub-command's parser (argparse builds sub-parsers of the parent's class).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
