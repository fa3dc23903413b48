"""The supervisor's restart policy, and the supervisor itself on cheap fake processes.

The processes here are fakes named as such (a few lines of Python: one that holds a /dev/shm
segment like a vLLM engine and sleeps, one that crashes at once); the real graph is in
tests/e2e/test_graph_supervision.py.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from maru_vllm.launch import ManagedProcess, ProcessGroup
from maru_vllm.launch.supervisor import CrashHistory, RestartPolicy, ShmSegments, Supervisor, remove_dist_stores
from tests.waiting import wait_until


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy(first_delay_s=1, factor=2, max_delay_s=5)
    assert [policy.delay(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]


def test_a_crash_loop_backs_off_then_is_given_up_on() -> None:
    history = CrashHistory(RestartPolicy(first_delay_s=1, factor=2, max_delay_s=30, max_crashes=4, window_s=100))
    decisions = [history.exited(at=t, uptime_s=0.5) for t in (0, 2, 5, 10)]
    assert [d.delay_s for d in decisions[:3]] == [1, 2, 4]
    assert decisions[3].delay_s is None and decisions[3].reason == "it exited 4 times within 100 s"


def test_a_long_run_starts_a_new_row_and_old_crashes_leave_the_window() -> None:
    history = CrashHistory(RestartPolicy(first_delay_s=1, factor=2, max_crashes=3, window_s=100, stable_after_s=60))
    assert history.exited(at=0, uptime_s=1).delay_s == 1
    assert history.exited(at=2, uptime_s=1).delay_s == 2
    # It then ran 500 s: the backoff starts over, and the two old crashes no longer count.
    assert history.exited(at=502, uptime_s=500).delay_s == 1
    assert history.exited(at=504, uptime_s=1).delay_s == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"first_delay_s": -1}, "invalid restart delays first=-1 max=30.0: use 0 <= first <= max seconds"),
        ({"factor": 0.5}, "invalid restart backoff factor 0.5: use a number >= 1"),
        ({"max_crashes": 0}, "invalid max_crashes 0: use an integer >= 1"),
    ],
)
def test_a_bad_policy_is_one_clear_error(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as err:
        RestartPolicy(**kwargs)
    assert str(err.value) == message


# A fake engine: creates a /dev/shm segment and a semaphore file, holds the pool's region open,
# keeps all three in a child (like vLLM's engine core, which outlives its killed API server),
# prints ready and sleeps.
FAKE_ENGINE = """
import mmap, os, sys, time
path = sys.argv[1] + "-" + str(os.getpid())
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 4096)
segment = mmap.mmap(fd, 4096)
# A named semaphore as glibc's sem_open makes one: a temporary file, mapped, linked to its name,
# the temporary name unlinked (the maps show only a deleted path).
tmp = path + "-tmp"
sem_fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(sem_fd, 32)
semaphore = mmap.mmap(sem_fd, 32)
os.link(tmp, path + "-sem")
os.unlink(tmp)
os.close(sem_fd)
region = open(sys.argv[2], "rb")  # like a worker mapping the pool's region
if os.fork() == 0:
    time.sleep(600)
print("ready", path, flush=True)
time.sleep(600)
"""

FAKE_CRASHER = "import sys; print('fake worker crashing', flush=True); sys.exit(3)"


def fake(name: str, code: str, log_dir: Path, *args: str) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-c", code, *args], log_path=log_dir / f"{name}.log")


def segments_of(prefix: str) -> set[Path]:
    return {p for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)}


def test_a_killed_tree_is_restarted_and_only_its_segments_are_removed(tmp_path: Path) -> None:
    tag = f"maru-test-sup-{uuid.uuid4().hex[:8]}"
    prefix = f"/dev/shm/{tag}"
    neighbour = Path(f"{prefix}-neighbour")  # somebody else's segment, mapped by nobody: stays
    protected = Path(f"{prefix}-region")  # the pool's region, which the fake also maps: stays
    lines: list[str] = []
    group = ProcessGroup()
    try:
        neighbour.write_bytes(b"x")
        protected.write_bytes(b"x" * 4096)
        engine = group.start(fake("worker:fake-engine", FAKE_ENGINE, tmp_path, prefix, str(protected)))
        engine.wait_for_log("ready")
        held = segments_of(tag) - {neighbour, protected}
        assert len(held) == 2 and any(p.name.endswith("-sem") for p in held), held
        sup = Supervisor(
            group,
            policy=RestartPolicy(first_delay_s=0.2),
            protect=[protected],
            out=lines.append,
            scan_interval_s=0,
        )
        sup.poll()  # sees the live tree and its segment
        first = engine.pid
        os.kill(first, signal.SIGKILL)  # the leader only: its child still maps the segment
        wait_until(lambda: (sup.poll(), sup.restarts("worker:fake-engine") == 1)[1], timeout=20)
        assert engine.pid != first
        engine.wait_for_log("ready")
        assert not (held & segments_of(tag)), "the dead tree's segment is still in /dev/shm"
        assert neighbour.exists() and protected.exists()
        assert lines[0] == "[graph] worker:fake-engine exited with code -9; restarting it in 0 s"
        assert lines[1].startswith("[graph] worker:fake-engine restarted (pid ")
        assert sup.serving("worker:fake-engine")
        sup.stop()
    finally:
        group.stop_all(grace_s=1)
        for p in segments_of(tag):
            p.unlink()


def test_a_process_that_keeps_crashing_is_given_up_on_in_one_line(tmp_path: Path) -> None:
    lines: list[str] = []
    gave_up: list[str] = []
    group = ProcessGroup()
    try:
        crasher = group.start(fake("worker:fake-crasher", FAKE_CRASHER, tmp_path))
        sup = Supervisor(
            group,
            policy=RestartPolicy(first_delay_s=0.05, max_crashes=3, window_s=60),
            out=lines.append,
            on_give_up=gave_up.append,
        ).start(interval_s=0.05)
        wait_until(lambda: bool(sup.given_up()), timeout=30)
        sup.stop()
        assert sup.restarts("worker:fake-crasher") == 2
        assert gave_up == ["worker:fake-crasher"]
        assert lines[-1] == (
            "[graph] giving up on worker:fake-crasher: it exited 3 times within 60 s (last exit code 3); "
            f"log: {crasher.log_path}"
        )
        assert crasher.log_text().count("fake worker crashing") == 3
        time.sleep(0.3)
        assert not crasher.alive() and sup.restarts("worker:fake-crasher") == 2
    finally:
        group.stop_all(grace_s=1)


def test_segments_held_by_a_live_process_are_not_removed(tmp_path: Path) -> None:
    path = Path(f"/dev/shm/maru-test-sup-{uuid.uuid4().hex[:8]}")
    path.write_bytes(b"x")
    try:
        with open(path, "rb"):
            segments = ShmSegments()
            segments.seen = {path.stat().st_ino}
            assert segments.release() == []  # this test process holds it open
        segments.seen = {path.stat().st_ino}
        assert segments.release() == [path] and not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_a_stop_that_ends_in_sigkill_leaves_no_segments(tmp_path: Path) -> None:
    tag = f"maru-test-sup-{uuid.uuid4().hex[:8]}"
    prefix = f"/dev/shm/{tag}"
    region = Path(f"{prefix}-region")
    # The fake engine ignores SIGTERM, like an engine still starting: the stop has to SIGKILL it.
    stubborn = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + FAKE_ENGINE
    group = ProcessGroup()
    try:
        region.write_bytes(b"x" * 4096)
        engine = group.start(fake("worker:fake-stubborn", stubborn, tmp_path, prefix, str(region)))
        engine.wait_for_log("ready")
        held = segments_of(tag) - {region}
        assert len(held) == 2
        sup = Supervisor(group, protect=[region], out=lambda line: None)
        sup.stop()  # looks at the live trees one last time
        group.stop_all(grace_s=0.5)
        assert held <= segments_of(tag), "the fake engine removed its own segment: nothing left to test"
        assert sup.release_stopped() == sorted(held)
        assert not (held & segments_of(tag)) and region.exists()
    finally:
        group.stop_all(grace_s=0.5)
        for p in segments_of(tag):
            p.unlink()


def test_only_the_vllm_file_store_a_log_names_is_removed(tmp_path: Path) -> None:
    mine = tmp_path / "vllm_dist_0123abcd"
    theirs = tmp_path / "vllm_dist_4567ef01"
    mine.write_text("store")
    theirs.write_text("store")
    log = f"(Worker pid=1) INFO parallel_state.py world_size=1 distributed_init_method=file://{mine} backend=gloo\n"
    assert remove_dist_stores(log) == [mine]
    assert not mine.exists() and theirs.exists()
    assert remove_dist_stores(log) == []  # already gone: nothing to do


# A fake engine that dies at once: it makes a shared-memory queue the way vLLM names its own
# (`psm_*`), keeps it open and mapped, and exits before anyone looked at its tree.
FAKE_EARLY_CRASH = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 4096)
queue = mmap.mmap(fd, 4096)
print("queue made; crashing", flush=True)
os._exit(1)
"""


def test_a_worker_that_dies_before_it_was_looked_at_leaves_no_vllm_queue(tmp_path: Path) -> None:
    tag = f"psm_maru-test-{uuid.uuid4().hex[:8]}"
    before = Path(f"/dev/shm/{tag}-before")  # from before the tree started, held by nobody: not its
    held = Path(f"/dev/shm/{tag}-held")  # a live engine's queue (this test holds it open): stays
    made = Path(f"/dev/shm/{tag}-made")
    group = ProcessGroup()
    try:
        before.write_bytes(b"x")
        time.sleep(0.3)  # older than the tree by more than tmpfs's timestamp granularity
        with open(held, "wb") as keep:
            keep.write(b"x")
            keep.flush()
            crasher = group.start(fake("worker:fake-early-crash", FAKE_EARLY_CRASH, tmp_path, str(made)))
            crasher.proc.wait(30)
            assert made.exists() and crasher.log_text().count("queue made") == 1
            sup = Supervisor(group, policy=RestartPolicy(first_delay_s=30), out=lambda line: None)
            sup.poll()  # its first look: the tree is already dead, it never saw the queue held
            assert not made.exists(), "the early crash's queue is still in /dev/shm"
            assert before.exists() and held.exists()
            assert sup.removed_segments == [made]
            sup.stop()
    finally:
        group.stop_all(grace_s=0.5)
        for p in (before, held, made):
            p.unlink(missing_ok=True)


def test_the_test_helpers_leave_no_pool_region_behind(tmp_path: Path) -> None:
    """A pool killed in a test keeps its region for a warm restart; the fixtures' stop removes it."""
    from maru_vllm.launch.stack import PoolProcess
    from tests.cleanup import stop_leaving_nothing

    group = ProcessGroup()
    name = f"cleanup{uuid.uuid4().hex[:8]}"
    pool = PoolProcess(name, "4M", tmp_path / "pool.log", listen=[f"unix://{tmp_path}/p.sock"])
    group.add(pool)
    pool.serve()
    pool.kill()
    assert pool.region_path.exists()
    stop_leaving_nothing(group)
    assert not pool.region_path.exists()


# A fake worker that drains on SIGTERM: half a second, then exit 0 (a graceful stop).
FAKE_DRAINER = """
import signal, sys, time
def stop(signum, frame):
    print("draining", flush=True)
    time.sleep(0.5)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_planned_restart_drains_counts_no_crash_and_tells_on_death(tmp_path: Path) -> None:
    lines: list[str] = []
    deaths: list[str] = []
    group = ProcessGroup()
    try:
        worker = group.start(fake("worker:fake-drainer", FAKE_DRAINER, tmp_path))
        worker.wait_for_log("ready")
        sup = Supervisor(group, policy=RestartPolicy(first_delay_s=5), out=lines.append, on_death=deaths.append).start(
            interval_s=0.02
        )  # polls all through the stop: the stop must not look like a death
        first = worker.pid
        assert sup.restart("worker:fake-drainer", grace_s=10) == 0
        assert worker.pid != first and worker.alive()
        worker.wait_for_log("ready")
        assert "draining" in worker.log_text()
        assert deaths == ["worker:fake-drainer"]
        assert lines == [
            "[graph] worker:fake-drainer stopped with code 0; starting it again",
            f"[graph] worker:fake-drainer restarted (pid {worker.pid}, restart 1)",
        ]
        # A crash afterwards is the first of its row (the planned stop was no crash): the first delay.
        os.kill(worker.pid, signal.SIGKILL)
        wait_until(lambda: len(lines) == 3, timeout=20)
        assert lines[2] == "[graph] worker:fake-drainer exited with code -9; restarting it in 5 s"
        assert deaths == ["worker:fake-drainer", "worker:fake-drainer"]
        with pytest.raises(RuntimeError, match="is not serving now"):
            sup.restart("worker:fake-drainer", grace_s=1)  # waiting for its restart
        with pytest.raises(KeyError):
            sup.restart("worker:nobody", grace_s=1)
        sup.stop()
    finally:
        group.stop_all(grace_s=1)
