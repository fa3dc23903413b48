"""Waiting for a state change in a test (a correctness deadline, never a speed requirement)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 20.0, what: str = "condition", interval: float = 0.05) -> T:
    """Poll `predicate` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout}s (last value {last!r})")
