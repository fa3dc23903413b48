"""Test-side view of Dynamo's KV router: per-tier overlap of a prompt, and its routing log."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from maru_vllm.launch import ManagedProcess

BLOCK = 128


class RouterProbe:
    """`python -m maru_dynamo.components.router_probe`: overlap per tier, without routing."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "maru_dynamo.components.router_probe", "--block-size", str(BLOCK)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log_path, "ab"),
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.log_path = log_path

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def _next(self, timeout: float) -> str:
        line = self.lines.get(timeout=timeout)
        if line is None:
            raise AssertionError(f"router probe exited:\n{self.log_path.read_text()[-3000:]}")
        return line

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while self._next(max(1.0, deadline - time.monotonic())) != "ready":
            pass

    def scores(self, tokens: list[int], **keys: str | None) -> dict[str, Any]:
        """Dynamo's overlap scores of `tokens`; `keys`: `lora_name`, `cache_namespace` (a request's
        adapter and tenant salt, as the frontend's router hashes them)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"token_ids": tokens, **keys}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self._next(60)
            if line.startswith("{"):
                return json.loads(line)

    def tiers_by_worker(self, tokens: list[int], **keys: str | None) -> dict[int, tuple[int, int, int]]:
        """worker_id -> (device_blocks, host_pinned_blocks, host_pinned_extension_blocks)."""
        rows = self.scores(tokens, **keys).get("workers") or []
        return {
            int(r["worker_id"]): (
                int(r.get("device_blocks") or 0),
                int(r.get("host_pinned_blocks") or 0),
                int(r.get("host_pinned_extension_blocks") or 0),
            )
            for r in rows
        }

    def extensions_by_worker(self, tokens: list[int]) -> dict[int, tuple[int, int, int]]:
        """worker_id -> (device_blocks, host_pinned_extension_blocks, disk_extension_blocks): the
        blocks each tier adds beyond the tiers above it (Dynamo scores a block once, at the first
        tier that continues the prefix)."""
        rows = self.scores(tokens).get("workers") or []
        return {
            int(r["worker_id"]): (
                int(r.get("device_blocks") or 0),
                int(r.get("host_pinned_extension_blocks") or 0),
                int(r.get("disk_extension_blocks") or 0),
            )
            for r in rows
        }

    def wait_for(
        self, tokens: list[int], predicate: Any, timeout: float = 60.0, read: Any = None
    ) -> dict[int, tuple[int, int, int]]:
        """Poll `read(tokens)` (default tiers_by_worker) until `predicate(view)` holds; return the
        last view either way."""
        deadline = time.monotonic() + timeout
        while True:
            view = (read or self.tiers_by_worker)(tokens)
            if predicate(view) or time.monotonic() > deadline:
                return view
            time.sleep(0.5)

    def tiers(self, tokens: list[int]) -> tuple[int, int, int]:
        """(device_blocks, host_pinned_blocks, host_pinned_extension_blocks) of the single worker.

        Dynamo reports tiers cumulatively: host_pinned_blocks is the prefix matched on the device
        or the host tier; the extension is what the host tier adds beyond the device.
        """
        rows = self.scores(tokens).get("workers") or []
        if not rows:
            return (0, 0, 0)
        row = rows[0]
        return (
            int(row.get("device_blocks") or 0),
            int(row.get("host_pinned_blocks") or 0),
            int(row.get("host_pinned_extension_blocks") or 0),
        )

    def wait_tiers(self, tokens: list[int], want: tuple[int, int, int], timeout: float = 60.0) -> tuple[int, int, int]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.tiers(tokens)
            if got == want or time.monotonic() > deadline:
                return got
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def selected_lines(frontend: ManagedProcess) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;]*m", "", frontend.log_text())
    return [line for line in text.splitlines() if "Selected worker" in line]
