"""A child's stdout, line by line, read on a thread so that a caller can wait with a deadline.

For children that answer on stdout (a router probe, a benchmark's worker stand-in, a test's
client process); servers that only log use `ManagedProcess.wait_for_log` instead.
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Iterable


class StdoutLines:
    """The lines `proc` writes to its stdout pipe (opened in text mode)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        if proc.stdout is None:
            raise ValueError("the process has no stdout pipe (start it with stdout=subprocess.PIPE)")
        self.proc = proc
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stdout: Iterable[str]) -> None:
        for line in stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for(self, prefix: str, timeout: float = 30.0) -> str:
        """The next line that starts with `prefix` (earlier lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line starting with {prefix!r} within {timeout}s")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"process exited (rc={self.proc.wait()}) before printing {prefix!r}")
            if line.startswith(prefix):
                return line
