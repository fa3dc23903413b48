"""Taking a dead worker's entries out of Dynamo's file discovery, and nobody else's.

The directory is laid out as Dynamo 1.6.1's file store lays it out for two workers (file names
and fields as a running graph writes them, shortened); that the real frontend drops a worker
whose files go is checked in tests/e2e/test_restarts_e2e.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from maru_dynamo.graphs.plan import DISCOVERY_DIR, build_plan, instance_file
from maru_dynamo.graphs.run import out_of_discovery
from maru_dynamo.graphs.spec import load_graph, resolve_graph_path
from maru_vllm.launch.file_discovery import instance_files, remove_instance
from maru_vllm.launch.lifecycle import INSTANCE_FILE_ENV, write_instance_file

A, B = 0xB8D6CF7A15567DD, 0xFEB0A5DF44C28A3
A_EVENTS, B_EVENTS = 8687204339085041, 132727821476014  # their KV-event publishers
SEQUENCES = 8581360821727752  # an active-sequences channel: tied to no worker id


def write(root: Path, bucket: str, name: str, data: object) -> Path:
    path = root / "v1" / bucket / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def endpoint(instance: int, name: str) -> dict[str, object]:
    return {
        "type": "Endpoint",
        "component": "backend",
        "endpoint": name,
        "namespace": "dynamo",
        "instance_id": instance,
        "transport": {"tcp": f"127.0.0.1:35759/{instance:x}/dynamo/backend/{name}"},
    }


def layout(root: Path) -> dict[int, list[Path]]:
    files: dict[int, list[Path]] = {A: [], B: []}
    for inst, events in ((A, A_EVENTS), (B, B_EVENTS)):
        for ep in ("generate", "clear_kv_blocks"):
            files[inst].append(write(root, "instances", f"dynamo%2Fbackend%2F{ep}%2F{inst:x}", endpoint(inst, ep)))
        files[inst].append(
            write(root, "mdc", f"dynamo%2Fbackend%2Fgenerate%2F{inst:x}", {"type": "Model", "instance_id": inst})
        )
        files[inst].append(
            write(
                root,
                "event_sources",
                f"namespace%2Fdynamo%2Ftopic%2Fkv%2Devents%2F{events:x}",
                {"type": "EventSource", "publisher_id": events, "metadata": {"worker": {"worker_id": inst}}},
            )
        )
        files[inst].append(
            write(
                root,
                "event_channels",
                f"namespace%2Fdynamo%2Ftopic%2Fkv%2Devents%2F{events:x}",
                {"type": "EventChannel", "topic": "kv-events", "instance_id": events},
            )
        )
    return files


def test_only_the_dead_instances_files_go(tmp_path: Path) -> None:
    files = layout(tmp_path)
    unrelated = write(
        tmp_path,
        "event_channels",
        f"namespace%2Fdynamo%2Ftopic%2Factive%5Fsequences%5Fevents%2F{SEQUENCES:x}",
        {"type": "EventChannel", "topic": "active_sequences_events", "instance_id": SEQUENCES},
    )
    half_written = tmp_path / "v1" / "instances" / ".tmp_0123456789abcdef"
    half_written.write_text(json.dumps(endpoint(A, "generate")))
    not_json = tmp_path / "v1" / "instances" / "garbage"
    not_json.write_text("{not json")

    assert sorted(instance_files(tmp_path, A)) == sorted(files[A])
    assert sorted(remove_instance(tmp_path, A)) == sorted(files[A])
    assert not any(p.exists() for p in files[A])
    assert all(p.exists() for p in files[B]) and unrelated.exists()
    assert half_written.exists() and not_json.exists()  # not the store's entries: left alone
    assert remove_instance(tmp_path, A) == []  # nothing more of it


def test_a_directory_without_entries_is_nothing_to_do(tmp_path: Path) -> None:
    assert remove_instance(tmp_path / "nowhere", A) == []
    assert remove_instance(tmp_path, A) == []


def test_the_graph_takes_a_dead_worker_out_by_the_instance_it_recorded(tmp_path: Path) -> None:
    plan = build_plan(load_graph(resolve_graph_path("agg")), model="/models/fake", work_dir=tmp_path)
    worker = plan.workers[0]
    assert worker.env[INSTANCE_FILE_ENV] == str(instance_file(tmp_path, worker.name))
    files = layout(tmp_path / DISCOVERY_DIR)
    lines: list[str] = []
    assert out_of_discovery(plan, worker.name, lines.append) == []  # it never registered: nothing
    write_instance_file(instance_file(tmp_path, worker.name), A)
    assert sorted(out_of_discovery(plan, worker.name, lines.append)) == sorted(files[A])
    assert lines == [f"[graph] {worker.name}: instance {A:x} taken out of discovery (5 entries)"]
    assert all(p.exists() for p in files[B])
    assert not instance_file(tmp_path, worker.name).exists()  # the next start records its own


def test_only_maru_workers_are_told_where_to_record_their_instance(tmp_path: Path) -> None:
    spec = load_graph(resolve_graph_path("agg"))
    plain = dataclasses.replace(spec.workers[0], name="plain", replicas=1, engine="vllm")
    plan = build_plan(dataclasses.replace(spec, workers=(*spec.workers, plain)), model="/m", work_dir=tmp_path)
    recording = {p.name: INSTANCE_FILE_ENV in p.env for p in plan.workers}
    assert recording == {"worker:worker-0": True, "worker:worker-1": True, "worker:plain-0": False}
