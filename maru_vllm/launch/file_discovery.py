"""Taking a dead worker out of Dynamo's file discovery (`DYN_DISCOVERY_BACKEND=file`) at once.

Dynamo's file store (ai-dynamo 1.6.1) keeps each registration as one JSON file under
`$DYN_FILE_KV/v1/<bucket>/...`: the instances of every endpoint (`instances/`), the model cards
(`mdc/`), the KV event sources (`event_sources/`) and channels (`event_channels/`). The process
that wrote a file touches it every few seconds and deletes it in its clean shutdown; any process
using the directory deletes files nobody touched for the store's TTL; every router watches the
directory and drops an instance when its file goes. A worker that dies without its clean
shutdown therefore stays routable until its files expire - requests keep being sent to it, fail
and are migrated.

`remove_instance` deletes what the dead worker's own shutdown would have deleted: the files of
its instance id (`instance_id`), its KV event sources (`metadata.worker.worker_id`) and their
channels (the sources' `publisher_id`). The routers' watch sees the deletions within
milliseconds. Only the two ids of that layout are read; a file that is not JSON is left alone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".tmp_"  # the file store's half-written files


def _entries(root: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    base = root / "v1"
    if not base.is_dir():
        return
    for path in sorted(base.rglob("*")):
        if path.name.startswith(TEMP_PREFIX) or not path.is_file():
            continue
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            yield path, data


def _worker_of(data: dict[str, Any]) -> Any:
    metadata = data.get("metadata")
    worker = metadata.get("worker") if isinstance(metadata, dict) else None
    return worker.get("worker_id") if isinstance(worker, dict) else None


def instance_files(root: Path, instance_id: int) -> list[Path]:
    """The files of `instance_id` under the discovery directory `root` (see the module docstring)."""
    entries = list(_entries(root))
    publishers = {data.get("publisher_id") for _, data in entries if _worker_of(data) == instance_id}
    publishers.discard(None)

    def ours(data: dict[str, Any]) -> bool:
        if data.get("instance_id") == instance_id or _worker_of(data) == instance_id:
            return True
        return data.get("type") == "EventChannel" and data.get("instance_id") in publishers

    return [path for path, data in entries if ours(data)]


def remove_instance(root: Path, instance_id: int) -> list[Path]:
    """Delete the discovery files of `instance_id`; returns those removed."""
    removed = []
    for path in instance_files(root, instance_id):
        try:
            path.unlink()
        except FileNotFoundError:  # its TTL expiry, or its own shutdown, was quicker
            continue
        except OSError as exc:
            logger.warning("cannot remove discovery entry %s: %s", path, exc)
            continue
        removed.append(path)
    return removed
