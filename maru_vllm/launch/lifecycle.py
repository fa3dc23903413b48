"""A `dynamo.vllm` worker's planned stop, and its identity for whoever supervises it.

**Stopping: drain, then migrate what is left.** `dynamo.vllm` (ai-dynamo 1.6.1) installs
Dynamo's own SIGTERM/SIGINT handler, `dynamo.common.utils.graceful_shutdown.
install_signal_handlers`: it unregisters the worker's endpoints from discovery (no router picks
the worker any more), sleeps a fixed grace period (`DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS`,
5 s), awaits an optional drain callback (at most 30 s, Dynamo's drain timeout), then sets the
worker's shutdown event - every request still running ends with `EngineShutdown`, which the
frontend migrates to another worker (request migration) - and shuts the runtime and the engine
down.

The Maru worker keeps that handler and gives it `WorkerLifecycle.drain` as its drain callback
in place of the fixed sleep (the worker's hook into `dynamo.vllm`, on the Dynamo side): once
unregistered, the worker waits until nothing has run on its engine for a quiet second (a
frontend that has not yet seen the worker leave discovery may still route a request to it), for
at most the grace period (`DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS`, 20 s by default here, 0 to
30). A request that finishes within it finishes where it is, with no migration and no
recompute; only what is left is migrated. The engine's shutdown then closes MaruKVConnector,
whose store writer commits the stores still queued (`StoreWriter.close`), and the process exits
0.

**Identity.** With `MARU_WORKER_INSTANCE_FILE` set (the local graph runner sets it per worker),
the worker writes its Dynamo instance id there as it registers. A supervisor that sees the
process die takes that instance out of discovery at once (`maru_vllm.launch.file_discovery`)
instead of leaving it routable until its registration expires.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GRACE_ENV = "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS"  # Dynamo's own variable
INSTANCE_FILE_ENV = "MARU_WORKER_INSTANCE_FILE"
DEFAULT_GRACE_S = 20.0
# Dynamo 1.6.1 awaits a drain callback for at most this long (`_DEFAULT_DRAIN_TIMEOUT_SECS`).
MAX_GRACE_S = 30.0
POLL_S = 0.1
# A stopping worker is drained once nothing has run on it for this long (within the grace period).
QUIET_S = 1.0


def grace_seconds(environ: Mapping[str, str] | None = None) -> float:
    """The drain's grace period from `DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS` (default 20 s).

    Raises ValueError with one line naming the value and what is allowed.
    """
    env = os.environ if environ is None else environ
    text = env.get(GRACE_ENV, "").strip()
    if not text:
        return DEFAULT_GRACE_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= MAX_GRACE_S:
        raise ValueError(
            f"{GRACE_ENV}={text!r}: use seconds from 0 to {MAX_GRACE_S:g} (how long a stopping worker lets its "
            f"running requests finish before the rest are migrated; Dynamo waits at most {MAX_GRACE_S:g} s)"
        )
    return value


@dataclasses.dataclass
class DrainReport:
    running_at_stop: int
    left: int  # still running when the grace period ended: migrated
    seconds: float


class WorkerLifecycle:
    """What a worker's stop drains (its engines) and the instance it announces."""

    def __init__(
        self, grace_s: float, instance_file: Path | None = None, poll_s: float = POLL_S, quiet_s: float = QUIET_S
    ) -> None:
        self.grace_s = grace_s
        self.instance_file = instance_file
        self.poll_s = poll_s
        self.quiet_s = quiet_s
        self.engines: list[Any] = []  # vLLM AsyncLLM clients of the worker
        self.report: DrainReport | None = None

    def running(self) -> int:
        """Requests the worker's engines have not finished (vLLM's own count)."""
        total = 0
        for engine in self.engines:
            try:
                total += int(engine.get_num_unfinished_requests())
            except Exception as exc:  # an engine that is gone runs nothing
                logger.debug("maru_worker: cannot count an engine's requests: %s", exc)
        return total

    async def drain(self) -> None:
        """Wait until nothing has run for `quiet_s`, at most `grace_s` (Dynamo awaits this after
        unregistering). The quiet window catches requests a frontend routed here in the moment
        before it saw the worker leave discovery: they arrive after the stop began, and end here
        instead of being migrated."""
        start = time.monotonic()
        at_stop = left = self.running()
        logger.info(
            "maru_worker: stopping: out of discovery; %d request(s) running, letting them finish (grace %.0f s)",
            at_stop,
            self.grace_s,
        )
        quiet_since = start if left == 0 else None
        while time.monotonic() - start < self.grace_s:
            now = time.monotonic()
            if left > 0:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= self.quiet_s:
                break
            await asyncio.sleep(self.poll_s)
            left = self.running()
        took = time.monotonic() - start
        self.report = DrainReport(at_stop, left, took)
        if left:
            logger.warning(
                "maru_worker: grace period over after %.1f s with %d request(s) running: they are migrated",
                took,
                left,
            )
        else:
            logger.info("maru_worker: drained in %.1f s (%d request(s) finished here)", took, at_stop)

    def registered(self, engine_client: Any, generate_endpoint: Any) -> None:
        """The worker is about to register `generate_endpoint`, served by `engine_client`."""
        if all(e is not engine_client for e in self.engines):
            self.engines.append(engine_client)
        if self.instance_file is None:
            return
        try:
            instance = int(generate_endpoint.connection_id())
            write_instance_file(self.instance_file, instance)
        except (OSError, AttributeError, TypeError, ValueError) as exc:  # supervision only loses a shortcut
            logger.warning("maru_worker: cannot record the instance id in %s: %s", self.instance_file, exc)


def write_instance_file(path: Path, instance_id: int) -> None:
    """{"instance_id": N, "pid": P}, written whole (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"instance_id": instance_id, "pid": os.getpid()}))
    tmp.replace(path)


def read_instance_file(path: Path) -> int | None:
    """The instance id a worker recorded, or None when there is none (yet)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    value = data.get("instance_id") if isinstance(data, dict) else None
    return value if isinstance(value, int) else None
