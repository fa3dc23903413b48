"""Rate limits for what hostile peers can make the service do: log lines and auth guesses.

A peer that fails in a loop (garbage frames, wrong tokens, connections past the cap) must not
turn into a log flood: `ThrottledLog` lets a few lines of each kind through per interval and
reports how many it held back with the next one. `AuthThrottle` spaces failed authentications
out service-wide, so guessing a token runs at a handful of tries per second however many
connections a guesser opens; a correct token is never delayed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Window:
    start: float
    emitted: int = 0
    suppressed: int = 0


@dataclass
class ThrottledLog:
    """At most `burst` lines per `kind` every `interval_s`; the rest are counted, then reported."""

    logger: logging.Logger
    burst: int = 5
    interval_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _windows: dict[str, _Window] = field(default_factory=dict)

    def log(self, level: int, kind: str, msg: str, *args: object, exc_info: bool | BaseException | None = None) -> bool:
        """Log `msg % args` unless `kind` is over its budget; True when the line was written."""
        now = self.clock()
        w = self._windows.get(kind)
        if w is None or now - w.start >= self.interval_s:
            held = w.suppressed if w is not None else 0
            w = self._windows[kind] = _Window(now)
            if held:
                msg = f"{msg} ({held} similar messages suppressed in the last {self.interval_s:.0f} s)"
        if w.emitted >= self.burst:
            w.suppressed += 1
            return False
        w.emitted += 1
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True


@dataclass
class AuthThrottle:
    """Failed authentications are answered at most once per `interval_s`, service-wide."""

    interval_s: float = 0.1
    clock: Callable[[], float] = time.monotonic
    failures: int = 0
    _next: float = 0.0

    def delay_for_failure(self) -> float:
        """Seconds to wait before answering this failure (and book its slot)."""
        now = self.clock()
        slot = max(now, self._next)
        self._next = slot + self.interval_s
        self.failures += 1
        return slot - now
