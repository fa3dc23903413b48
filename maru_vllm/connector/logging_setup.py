"""The connector's log lines go where vLLM's go, at vLLM's level.

vLLM configures one logger tree, `vllm` (`vllm/logger.py`: its handler, its format, the level
of `VLLM_LOGGING_LEVEL` / `--log-level`), and only when its `LoggingConfig.configure_logging` is
on (`VLLM_CONFIGURE_LOGGING`, default on; Dynamo's `dynamo.vllm` turns it on for its engines).
A connector loaded from another package logs under its own name (`maru_vllm.*`), outside that
tree: in an engine process nobody configured those loggers, so Python's last-resort handler
shows WARNING and above and every INFO line (the start-up line, the periodic summary) is lost.

`follow_vllm_logging()` makes the `maru_vllm` logger tree behave as part of vLLM's: its records
are handed to the `vllm` logger's handlers (looked up per record, so a later re-configuration of
vLLM's logging is followed) at the level of the `vllm` logger. It changes nothing when
vLLM's logging configuration is off (the application owns logging then) or when the `maru_vllm`
logger has been configured by someone else (a handler or a level of its own).
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "maru_vllm"
VLLM_LOGGER = "vllm"


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the `vllm` logger's current handlers (their levels and filters apply)."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(VLLM_LOGGER).callHandlers(record)


def follow_vllm_logging(configure_logging: bool) -> bool:
    """Route `maru_vllm.*` records through vLLM's logging set-up; True when it was done (or is).

    `configure_logging` is the engine's `vllm_config.logging_config.configure_logging`.
    Idempotent; call it in the engine process before the first INFO line.
    """
    ours = logging.getLogger(PACKAGE_LOGGER)
    if any(isinstance(h, _ToVllmHandlers) for h in ours.handlers):
        ours.setLevel(logging.getLogger(VLLM_LOGGER).getEffectiveLevel())
        return True
    if not configure_logging or ours.handlers or ours.level != logging.NOTSET:
        return False
    vllm_logger = logging.getLogger(VLLM_LOGGER)
    if not vllm_logger.handlers:
        return False  # vLLM's logging is not configured in this process: leave ours alone too
    ours.addHandler(_ToVllmHandlers())
    ours.setLevel(vllm_logger.getEffectiveLevel())
    ours.propagate = False
    return True
