"""MaruKVConnector's scheduler side under vLLM's real v1 Scheduler (no model, no workers).

vLLM builds the connector from a real `VllmConfig` (kv_connector="MaruKVConnector"); a real pool
service answers its lookups. The harness (`sched_harness.py`) plays the model runner: it feeds
`ModelRunnerOutput`s back into `update_from_output`, optionally plays the worker's stores into the
pool, and reports failed loads through `invalid_block_ids`. Every step is checked against vLLM's
real block tables (`check_step`), every finished run against the "each prompt chunk stored once,
nothing left behind" contract (`check_run`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from vllm.v1.request import RequestStatus

from maru_vllm.connector.chunks import chunk_key, hash_bytes
from maru_vllm.connector.metadata import ChunkLoad
from maru_vllm.launch.stack import PoolProcess
from maru_vllm.pool import PoolClient
from tests.connector.sched_harness import (
    BLOCK_SIZE,
    BPC,
    CHUNK_TOKENS,
    SLOT,
    Sim,
    StepRecord,
    make_request,
    make_scheduler,
    pool_keys,
    tokens,
)


# ---- fixtures ------------------------------------------------------------------------------
@pytest.fixture
def new_sim(tiny_model: Path, pool: PoolProcess, client: PoolClient):
    """Factory: a scheduler with a fresh salt (so every test has its own pool namespace)."""
    made: list[Sim] = []

    def make(*, play_worker_stores: bool = False, play_part_keys: bool = True, address: str | None = None, **kw) -> Sim:
        extra = kw.pop("extra", {})
        extra.setdefault("maru_namespace", f"t{len(made)}-{id(made)}")
        sched = make_scheduler(tiny_model, address or pool.address, extra=extra, **kw)
        sim = Sim(sched, play_worker_stores=play_worker_stores, pool_client=client, play_part_keys=play_part_keys)
        made.append(sim)
        return sim

    yield make
    for sim in made:
        sim.conn.shutdown()


# ---- checks --------------------------------------------------------------------------------
def check_step(sim: Sim, rec: StepRecord, client: PoolClient | None = None) -> None:
    """Loads and stores of one step against vLLM's real block tables and block hashes."""
    meta = rec.meta
    # -- stores: complete prompt chunks, the request's real blocks, hashes = the key's prefix
    for s in meta.stores:
        assert s.req_id in rec.scheduled, f"store for {s.req_id}, which is not scheduled this step"
        req = sim.requests[s.req_id]
        c = sim.chunk_index(req, s.key)
        assert (c + 1) * CHUNK_TOKENS <= req.num_prompt_tokens, "store of a chunk beyond the prompt"
        assert (c + 1) * CHUNK_TOKENS <= rec.computed_before[s.req_id] + rec.scheduled[s.req_id], (
            f"{s.req_id} chunk {c} stored before its tokens are computed"
        )
        real = rec.blocks[s.req_id][c * BPC : (c + 1) * BPC]
        assert s.block_ids == real, f"{s.req_id} chunk {c}: store blocks {s.block_ids} != block table {real}"
        want = [hash_bytes(req.block_hashes[b]) for b in range(c * BPC, (c + 1) * BPC)]
        assert [rec.block_hashes[s.req_id][b] for b in range(c * BPC, (c + 1) * BPC)] == want
        assert s.meta.chunk == c and s.meta.block_hashes == [h.hex() for h in want]
        assert s.meta.token_ids == [
            req.prompt_token_ids[b * BLOCK_SIZE : (b + 1) * BLOCK_SIZE] for b in range(c * BPC, (c + 1) * BPC)
        ]
    # -- loads: only for requests vLLM just admitted with external tokens
    loaded_reqs = {ld.req_id for ld in meta.loads}
    with_external = {rid for rid, ext in rec.allocs.items() if ext > 0}
    assert loaded_reqs == with_external, f"loads for {loaded_reqs}, external tokens for {with_external}"
    for rid, ext in rec.allocs.items():
        local = rec.match[rid].local_tokens
        assert rec.computed_before[rid] == local + ext, (rid, rec.computed_before[rid], local, ext)
        loads = [ld for ld in meta.loads if ld.req_id == rid]
        if not ext:
            continue
        req = sim.requests[rid]
        end = local + ext
        # Block-granular: the last chunk may be loaded in part; one prompt token is left to compute.
        assert end % BLOCK_SIZE == 0 and ext > 0 and end < req.num_tokens
        chunks = [sim.load_chunk(req, ld) for ld in loads]
        assert chunks == list(range(local // CHUNK_TOKENS, -(-end // CHUNK_TOKENS))), (rid, local, ext, chunks)
        for ld, c in zip(loads, chunks):
            first = max(c * BPC, local // BLOCK_SIZE)
            last = min((c + 1) * BPC, end // BLOCK_SIZE)
            assert ld.skip_blocks == first - c * BPC
            assert ld.block_ids == rec.blocks[rid][first:last]
            if last == (c + 1) * BPC:
                assert ld.chunk_blocks == 0
            else:  # a part: keyed by its last block, which is the request's own block
                assert ld.chunk_blocks == BPC and ld.key == hash_bytes(req.block_hashes[last - 1])
        assert sum(len(ld.block_ids) for ld in loads) * BLOCK_SIZE == ext
        if client is not None:
            # Every object of every whole chunk, under the split the load names.
            splits = sim.conn.scheduler_side.geometry.splits
            keys = [chunk_key(ld.key, sl.name) for ld in loads if not ld.chunk_blocks for sl in splits[ld.split].slices]
            present = client.lookup(keys, sim.namespace)
            assert all(present), f"{rid} loads chunks the pool does not hold: {present}"
            parts = [ld for ld in loads if ld.chunk_blocks]
            units = client.lookup_parts([chunk_key(ld.key, SLOT) for ld in parts], sim.namespace)
            assert units == [ld.skip_blocks + len(ld.block_ids) for ld in parts], (rid, units)


def check_run(sim: Sim) -> None:
    """After the run: all finished, no state left, every prompt chunk stored exactly once
    (unless the pool already had it when the request looked)."""
    assert sim.sched.get_num_unfinished_requests() == 0
    assert set(sim.finished) == set(sim.requests)
    # Requests whose blocks were held for write-behind stores were all released: none leaks.
    assert sim.sched.requests == {}, f"held forever: {list(sim.sched.requests)}"
    pool = sim.sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block
    held = {rid for rid in sim.requests if sim.stores and any(k[0] == rid for k in sim.stores)}
    assert set(sim.finished_sending) == held, "held exactly the requests that had stores"
    assert sim.side.requests == {}, f"state left behind: {list(sim.side.requests)}"
    assert sim.conn.load_guard.failed_loads == 0, "the load guard refused a plan the scheduler side made"
    assert sorted(sim.probe.finished) == sorted(sim.requests), "request_finished not called once per request"
    for key, n in sim.stores.items():
        # A chunk computed in the step whose load failed (on top of bad KV) is planned again
        # once vLLM recomputed it; the worker must drop the first store (see test 5).
        again = [i for i in sim.store_steps[key] if i not in sim.failed_load_steps.get(key[0], ())]
        assert len(again) == 1, f"chunk {key} planned for store {n} times, in steps {sim.store_steps[key]}"
    for rid, req in sim.requests.items():
        if req.status == RequestStatus.FINISHED_ABORTED:
            continue
        for c in range(req.num_prompt_tokens // CHUNK_TOKENS):
            if c >= sim.probe.pool_chunks_seen.get(rid, 0):
                assert sim.stores.get((rid, c)), f"{rid} chunk {c} never stored"


def run_checked(sim: Sim, client: PoolClient | None = None, max_steps: int = 600) -> None:
    for _ in range(max_steps):
        if not sim.sched.has_requests():
            break
        check_step(sim, sim.step(), client)
    check_run(sim)


# ---- 1. many concurrent requests -----------------------------------------------------------
@pytest.mark.parametrize("play_worker_stores", [False, True], ids=["no-worker", "worker-stores"])
def test_concurrent_requests_store_every_chunk_once(new_sim, client, play_worker_stores):
    sim = new_sim(num_blocks=400, max_num_seqs=8, play_worker_stores=play_worker_stores)
    # 4 shared prefixes (one ends mid-block, one mid-chunk, one on a chunk boundary) x 5 suffixes.
    prefixes = [tokens(1, 300), tokens(2, 128 * 3), tokens(3, 512), tokens(4, 77)]
    for i in range(20):
        prompt = prefixes[i % 4] + tokens(100 + i, 150 + 61 * i)
        sim.add(make_request(f"c{i}", prompt, max_tokens=2 + i % 4))
    run_checked(sim, client if play_worker_stores else None)
    assert sum(sim.preemptions.values()) == 0
    # Chunked prefill really happened: a long prompt was planned over several steps.
    steps_with_stores = {rec.index for rec in sim.steps for s in rec.meta.stores if s.req_id == "c19"}
    assert len(steps_with_stores) >= 2
    expected = sum(len(r.prompt_token_ids) // CHUNK_TOKENS for r in sim.requests.values())
    if not play_worker_stores:
        assert len(sim.stores) == expected  # nothing was in the pool: every chunk once
        assert not any(rec.meta.loads for rec in sim.steps)
    else:
        # Distinct keys reached the pool; the requests that came later skipped what it held.
        assert len(sim.stores) < expected
        keys = {chunk_key(s.key, SLOT) for rec in sim.steps for s in rec.meta.stores}
        assert all(client.lookup(sorted(keys), sim.namespace))
    # One lookup per request (none of them waited twice or was preempted).
    assert dict(sim.probe.lookups_by_req) == dict.fromkeys(sim.requests, 1)


# ---- 2. pool hits --------------------------------------------------------------------------
def _put_chunks(client: PoolClient, sim: Sim, req, n: int, parts: bool = False) -> None:
    """Put `req`'s first `n` chunks; with `parts`, with the part keys the worker commits."""
    for c, key in enumerate(pool_keys(req, n)):
        part_keys = [chunk_key(req.block_hashes[b], SLOT) for b in range(c * BPC, (c + 1) * BPC - 1)]
        assert client.put(key, b"x" * 64, sim.namespace, parts=part_keys if parts else None)


def _admit(sim: Sim, req, client: PoolClient | None) -> StepRecord:
    """Run steps until `req` is admitted; return that step."""
    for _ in range(100):
        rec = sim.step()
        check_step(sim, rec, client)
        if req.request_id in rec.allocs:
            return rec
    raise AssertionError(f"{req.request_id} never admitted")


def test_pool_hit_loads_chunks_beyond_nothing(new_sim, client):
    sim = new_sim()
    req = make_request("hit", tokens(11, 1000), max_tokens=2)
    _put_chunks(client, sim, req, 3)
    sim.add(req)
    rec = _admit(sim, req, client)
    assert rec.allocs["hit"] == 3 * CHUNK_TOKENS
    assert rec.scheduled["hit"] == 1000 - 3 * CHUNK_TOKENS
    assert [(ld.skip_blocks, ld.block_ids) for ld in rec.meta.loads] == [
        (0, rec.blocks["hit"][0:2]),
        (0, rec.blocks["hit"][2:4]),
        (0, rec.blocks["hit"][4:6]),
    ]
    assert not rec.meta.stores  # the only full chunks are the pool's
    run_checked(sim, client)
    assert not sim.stores


@pytest.mark.parametrize(
    "writers", [("own", "tp2", "tp2"), ("tp2", "own", "tp2"), ("tp2", "tp2", "tp2")], ids=lambda w: "-".join(w)
)
def test_a_prefix_written_by_engines_of_two_tp_sizes_loads_whole(new_sim, client, writers):
    # The tiny model has 2 KV heads: a TP 1 engine's split is one slice, a TP 2 engine's two.
    # Each chunk is in the pool under one of them only (a conversation whose turns ran on
    # engines of both sizes): every chunk loads, each under the split that holds it.
    sim = new_sim()
    req = make_request("mixed", tokens(14, 1000), max_tokens=2)
    slots = {"own": [SLOT], "tp2": ["p0h0-1", "p0h1-2"]}
    for c, writer in enumerate(writers):
        for slot in slots[writer]:
            assert client.put(pool_keys(req, c + 1, slot)[c], b"x" * 64, sim.namespace)
    sim.add(req)
    rec = _admit(sim, req, client)
    assert rec.allocs["mixed"] == 3 * CHUNK_TOKENS
    assert [ld.split for ld in rec.meta.loads] == [0 if w == "own" else 1 for w in writers]
    assert [ld.block_ids for ld in rec.meta.loads] == [rec.blocks["mixed"][2 * c : 2 * c + 2] for c in range(3)]
    run_checked(sim, client)


def test_pool_hit_beyond_a_local_hit_that_ends_mid_chunk(new_sim, client):
    sim = new_sim()
    prompt = tokens(12, 900)
    # A shares exactly one block with B: B gets a local prefix-cache hit of 128 tokens.
    sim.add(make_request("a", prompt[:BLOCK_SIZE] + tokens(13, 200), max_tokens=1))
    run_checked(sim)
    b = make_request("b", prompt, max_tokens=2)
    _put_chunks(client, sim, b, 3)
    sim.add(b)
    rec = _admit(sim, b, client)
    assert rec.match["b"].local_tokens == BLOCK_SIZE
    assert rec.allocs["b"] == 3 * CHUNK_TOKENS - BLOCK_SIZE
    blocks = rec.blocks["b"]
    assert [(ld.skip_blocks, ld.block_ids) for ld in rec.meta.loads] == [
        (1, blocks[1:2]),
        (0, blocks[2:4]),
        (0, blocks[4:6]),
    ]
    assert rec.computed_before["b"] == 3 * CHUNK_TOKENS
    run_checked(sim, client)


def test_pool_hit_leaves_one_token_to_compute(new_sim, client):
    sim = new_sim()
    whole = make_request("whole", tokens(14, 3 * CHUNK_TOKENS), max_tokens=2)
    one = make_request("one", tokens(15, CHUNK_TOKENS), max_tokens=2)
    _put_chunks(client, sim, whole, 3, parts=True)
    _put_chunks(client, sim, one, 1, parts=True)
    sim.add(whole)
    sim.add(one)
    rec = sim.step()
    check_step(sim, rec, client)
    # Every block is in the pool, but vLLM must compute at least one prompt token: the last
    # chunk is loaded in part (all its blocks but the last), a one-chunk prompt loads block 0.
    assert rec.allocs == {"whole": 3 * CHUNK_TOKENS - BLOCK_SIZE, "one": CHUNK_TOKENS - BLOCK_SIZE}
    assert rec.scheduled == {"whole": BLOCK_SIZE, "one": BLOCK_SIZE}
    assert [
        (sim.load_chunk(whole, ld), ld.chunk_blocks, len(ld.block_ids)) for ld in rec.meta.loads if ld.req_id == "whole"
    ] == [(0, 0, BPC), (1, 0, BPC), (2, BPC, BPC - 1)]
    assert [(ld.key, ld.chunk_blocks, ld.block_ids) for ld in rec.meta.loads if ld.req_id == "one"] == [
        (hash_bytes(one.block_hashes[0]), BPC, rec.blocks["one"][:1])
    ]
    run_checked(sim, client)
    # The last chunks were computed; their stores are planned once (the pool dedups the commit).
    assert dict(sim.stores) == {("whole", 2): 1, ("one", 0): 1}


def test_whole_chunk_prompts_without_part_keys_load_whole_chunks_only(new_sim, client):
    """Chunks committed without part keys load as whole chunks, and only those."""
    sim = new_sim()
    whole = make_request("whole", tokens(14, 3 * CHUNK_TOKENS), max_tokens=2)
    _put_chunks(client, sim, whole, 3)
    sim.add(whole)
    rec = sim.step()
    check_step(sim, rec, client)
    assert rec.allocs == {"whole": 2 * CHUNK_TOKENS}
    run_checked(sim, client)


def test_prompt_sharing_part_of_a_pool_chunk_loads_the_shared_blocks(new_sim, client):
    """Two engines on one pool: B shares A's first 2.5 chunks; it loads those 5 blocks and
    computes only the rest, and its own chunk 2 (which differs from A's after block 4) is stored."""
    salt = {"maru_namespace": f"part-{id(client)}"}
    engine_a = new_sim(play_worker_stores=True, extra=dict(salt))
    prompt_a = tokens(70, 3 * CHUNK_TOKENS + 40)
    engine_a.add(make_request("a", prompt_a, max_tokens=2))
    run_checked(engine_a, client)
    assert {c for (_, c) in engine_a.stores} == {0, 1, 2}

    engine_b = new_sim(play_worker_stores=True, extra=dict(salt))
    assert engine_b.namespace == engine_a.namespace
    # A local prefix-cache hit of one block first, so B's load starts mid-chunk.
    engine_b.add(make_request("c", prompt_a[:BLOCK_SIZE] + tokens(72, 60), max_tokens=1))
    run_checked(engine_b, client)
    shared = 5 * BLOCK_SIZE
    b = make_request("b", prompt_a[:shared] + tokens(71, 200), max_tokens=2)
    engine_b.add(b)
    rec = _admit(engine_b, b, client)
    assert rec.match["b"].local_tokens == BLOCK_SIZE
    assert rec.allocs["b"] == shared - BLOCK_SIZE
    blocks = rec.blocks["b"]
    assert [(ld.skip_blocks, ld.chunk_blocks, ld.block_ids) for ld in rec.meta.loads] == [
        (1, 0, blocks[1:2]),
        (0, 0, blocks[2:4]),
        (0, BPC, blocks[4:5]),
    ]
    assert rec.meta.loads[2].key == hash_bytes(b.block_hashes[4])
    assert rec.computed_before["b"] == shared
    run_checked(engine_b, client)
    assert ("b", 2) in engine_b.stores and ("b", 1) not in engine_b.stores


def test_part_keys_raise_the_pool_hit_rate_on_the_chat_workload(new_sim, client):
    """The routing comparison's workload (docs/performance.md; 2 system prompts of 2.5 chunks,
    5 sessions x 3 turns), round robin over four engines sharing one pool. A session's system
    prompt ends mid-chunk; once a longer prompt stored that chunk, an engine new to the system
    prompt loads its shared first block with part keys instead of computing it (measured here:
    5248 -> 4992 prompt tokens computed of 13440)."""
    from maru_vllm.fixtures.workload import WorkloadSpec, build_workload

    workload = build_workload(WorkloadSpec())
    supplied: dict[bool, dict[str, int]] = {}
    for parts in (False, True):
        salt = {"maru_namespace": f"wl{int(parts)}-{id(client)}"}
        engines = [new_sim(play_worker_stores=True, play_part_keys=parts, extra=dict(salt)) for _ in range(4)]
        local = pool = 0
        for r in workload:
            sim = engines[r.index % len(engines)]
            rid = f"w{r.index}"
            sim.add(make_request(rid, list(r.prompt), max_tokens=1))
            run_checked(sim, client)
            admitted = next(rec for rec in sim.steps if rid in rec.allocs)
            local += admitted.match[rid].local_tokens
            pool += admitted.allocs[rid]
        supplied[parts] = {"local": local, "pool": pool, "computed": workload.total_prompt_tokens - local - pool}
    print(
        f"workload of {workload.total_prompt_tokens} prompt tokens: whole chunks {supplied[False]}, "
        f"with part keys {supplied[True]}"
    )
    assert supplied[True]["pool"] > supplied[False]["pool"]
    assert supplied[True]["computed"] < supplied[False]["computed"]


def test_one_lookup_while_waiting_for_memory(new_sim, client, pool):
    sim = new_sim(num_blocks=12, max_num_seqs=4)  # 11 usable blocks
    big = make_request("big", tokens(16, 1100), max_tokens=30)  # 9-10 blocks
    sim.add(big)
    for _ in range(3):
        check_step(sim, sim.step(), client)
    waiter = make_request("waiter", tokens(17, 700), max_tokens=2)
    _put_chunks(client, sim, waiter, 2)
    before = client.stats()
    link = sim.probe.side.pool.client
    local_before, asked_before = link.lookups_local, link.lookups_asked
    sim.add(waiter)
    rec = _admit(sim, waiter, None)  # (check_step's own lookups would count as pool hits)
    after = client.stats()
    check_step(sim, rec, client)
    asked = [m for m in sim.probe.match_calls if m.req_id == "waiter"]
    assert len(asked) >= 5, "the waiter should have waited several steps for memory"
    assert sim.probe.lookups_by_req["waiter"] == 1, [m.lookups for m in asked]
    assert all(m.answer == 2 * CHUNK_TOKENS for m in asked)
    # One lookup (of the 2 whole chunks, then the next chunk's part keys), answered from the
    # pool's presence table in the region: the service never saw it.
    assert (link.lookups_local - local_before, link.lookups_asked - asked_before) == (2, 0)
    assert after["hits"] - before["hits"] == 0 and after["misses"] - before["misses"] == 0
    assert rec.allocs["waiter"] == 2 * CHUNK_TOKENS
    run_checked(sim, client)


# ---- 3. preemption and resume --------------------------------------------------------------
def test_preemption_and_resume(new_sim, client):
    # 23 usable blocks; 8 requests whose decodes grow by ~6 blocks each: decodes preempt others.
    sim = new_sim(num_blocks=24, max_num_seqs=8, play_worker_stores=True)
    for i in range(8):
        sim.add(make_request(f"p{i}", tokens(30 + i, 520 + 41 * i), max_tokens=700))
    run_checked(sim, client, max_steps=4000)
    assert sum(sim.preemptions.values()) >= 3, dict(sim.preemptions)
    preempted = {rid for rid, n in sim.preemptions.items() if n}
    # Resumed requests were admitted again, looked the pool up again (once per admission)...
    admissions = {rid: sum(1 for rec in sim.steps if rid in rec.allocs) for rid in sim.requests}
    for rid in preempted:
        assert admissions[rid] == sim.preemptions[rid] + 1
        assert sim.probe.lookups_by_req[rid] <= admissions[rid]
    # ...and some of them got their own stored chunks back from the pool (checked by check_step).
    resumed_loads = [ld for rec in sim.steps for ld in rec.meta.loads if ld.req_id in preempted]
    assert resumed_loads, "no resumed request loaded from the pool"


def test_preemption_and_aborts_with_a_real_write_behind_worker(new_sim, client, pool):
    # The worker side copies real pages behind every step; preempted requests' copies finish
    # before their freed blocks can be reused, finished and aborted ones hold their blocks until
    # reported, and in the end every request and block is released (check_run).
    from tests.connector.worker_side import model_worker

    sim = new_sim(num_blocks=24, max_num_seqs=8)
    worker, _ = model_worker(pool.address, sim.namespace, num_blocks=24)
    sim.worker = worker
    waited: list[set[str]] = []
    real_wait = worker.writer.wait

    def wait(req_ids=None, timeout=None):
        if req_ids is not None and timeout is None:
            waited.append(set(req_ids))
        return real_wait(req_ids, timeout)

    worker.writer.wait = wait
    for i in range(8):
        sim.add(make_request(f"w{i}", tokens(60 + i, 520 + 41 * i), max_tokens=700))
    for _ in range(40):
        check_step(sim, sim.step(), client)
    sim.sched.finish_requests(["w7"], RequestStatus.FINISHED_ABORTED)
    run_checked(sim, client, max_steps=4000)
    preempted = {rid for rid, n in sim.preemptions.items() if n}
    assert preempted and set().union(*waited) >= preempted
    assert worker.take_counters().chunks_stored > 0
    worker.shutdown()


# ---- 4. aborts -----------------------------------------------------------------------------
def test_abort_mid_prefill(new_sim, client):
    # 128 tokens per request and step: all four prefill side by side, over 16 steps.
    sim = new_sim(num_blocks=200, max_num_batched_tokens=512, long_prefill_token_threshold=128)
    for i in range(4):
        sim.add(make_request(f"x{i}", tokens(40 + i, 2000), max_tokens=3))
    for _ in range(5):
        check_step(sim, sim.step(), client)
    victims = {"x0", "x2"}
    for rid in victims:
        r = sim.requests[rid]
        assert rid in sim.side.requests and r.status == RequestStatus.RUNNING
        assert 0 < r.num_computed_tokens < r.num_prompt_tokens, "must still be prefilling"
        assert any(k[0] == rid for k in sim.stores), "some of its chunks were already stored"
    aborted = sim.sched.finish_requests(sorted(victims), RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in aborted} == victims
    assert not set(sim.side.requests) & victims
    n_steps = len(sim.steps)
    run_checked(sim, client)
    later = [s for rec in sim.steps[n_steps:] for s in rec.meta.stores]
    assert later and not {s.req_id for s in later} & victims
    assert {sim.requests[r].status for r in ("x1", "x3")} == {RequestStatus.FINISHED_LENGTH_CAPPED}


def test_abort_while_waiting_for_memory(new_sim, client):
    sim = new_sim(num_blocks=12, max_num_seqs=4)
    sim.add(make_request("big", tokens(18, 1100), max_tokens=30))
    waiter = make_request("waiter", tokens(19, 700), max_tokens=2)
    _put_chunks(client, sim, waiter, 2)
    sim.add(waiter)
    for _ in range(6):
        check_step(sim, sim.step(), client)
    assert waiter.status == RequestStatus.WAITING and "waiter" in sim.side.requests  # looked up, waiting
    sim.sched.finish_requests("waiter", RequestStatus.FINISHED_ABORTED)
    assert "waiter" not in sim.side.requests
    run_checked(sim, client)
    assert not any(k[0] == "waiter" for k in sim.stores)


# ---- 5. load failures ----------------------------------------------------------------------
def test_failed_load_is_recomputed_not_failed(new_sim, client):
    sim = new_sim()
    assert sim.sched.recompute_kv_load_failures, "the connector must force kv_load_failure_policy=recompute"
    req = make_request("lf", tokens(50, 1400), max_tokens=3)
    _put_chunks(client, sim, req, 3)
    sim.add(req)
    rec = sim.step(invalid_block_ids=None, invalid_load_chunks={1})  # chunk 1's load fails
    check_step(sim, rec, client)
    assert rec.allocs["lf"] == 3 * CHUNK_TOKENS
    failed_first_block = rec.blocks["lf"][2]
    assert failed_first_block in rec.invalid
    # vLLM rolled the request back to the first failed block and keeps it running.
    assert req.num_computed_tokens == 2 * BLOCK_SIZE
    assert req.status == RequestStatus.RUNNING and not req.output_token_ids
    nxt = sim.step()
    check_step(sim, nxt, client)
    assert nxt.computed_before["lf"] == 2 * BLOCK_SIZE
    run_checked(sim, client)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(req.output_token_ids) == 3
    # Chunk 0 loaded fine and is never stored. Chunks 3 and 4 were computed in the failed step,
    # on top of the bad chunk 1: the worker must drop those stores (it knows the load failed).
    # Once vLLM recomputed from chunk 1 on, chunks 1.. are planned for store once each.
    failed_step = rec.index
    assert sim.failed_load_steps["lf"] == {failed_step}
    assert ("lf", 0) not in sim.stores
    assert {c for (r, c), steps in sim.store_steps.items() if failed_step in steps} == {3, 4}
    after = {c: [i for i in steps if i > failed_step] for (r, c), steps in sim.store_steps.items()}
    assert after == {1: [after[1][0]], 2: [after[2][0]], 3: [after[3][0]], 4: [after[4][0]]}


# ---- 6. pool service down ------------------------------------------------------------------
def test_pool_down_requests_still_finish(new_sim, caplog, tmp_path):
    dead = f"unix://{tmp_path}/no-pool.sock"
    sim = new_sim(address=dead, max_num_seqs=4)
    caplog.set_level(logging.DEBUG, logger="maru_vllm.connector")
    for i in range(6):
        sim.add(make_request(f"d{i}", tokens(60 + i, 700 + 50 * i), max_tokens=2))
    run_checked(sim)
    assert sum(sim.probe.lookups_by_req.values()) >= 6
    assert sim.side.pool.failures >= 6
    assert not any(rec.meta.loads for rec in sim.steps)
    assert sim.conn.contained_errors == 0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "unavailable" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


# ---- 7. a load hook fails: its blocks are recomputed, never trusted ----------------------------
def _break(sim: Sim, fault: str) -> None:
    """Make one scheduler-side load hook fail the way a bug would (inside the connector)."""
    side = sim.side

    def raises(*args, **kwargs):
        raise KeyError(f"injected {fault}")

    if fault == "update_state_after_alloc-raises":
        real_state = side._state
        calls = []

        def state(request):  # the lookup's call passes, update_state_after_alloc's raises
            calls.append(request.request_id)
            if calls.count(request.request_id) == 2:
                raise KeyError(f"injected {fault}")
            return real_state(request)

        side._state = state
    elif fault == "build_connector_meta-raises":
        side.build_connector_meta = raises
    elif fault == "plan-forgets-a-chunk":  # no exception at all: a load silently left out
        real = side.build_connector_meta

        def forgets(out):
            meta = real(out)
            meta.loads = meta.loads[:-1]
            return meta

        side.build_connector_meta = forgets
    else:
        raise AssertionError(fault)


@pytest.mark.parametrize(
    "fault", ["update_state_after_alloc-raises", "build_connector_meta-raises", "plan-forgets-a-chunk"]
)
def test_failed_load_hook_fails_every_granted_block(new_sim, client, fault):
    sim = new_sim()
    req = make_request("hf", tokens(70, 1400), max_tokens=3)
    other = make_request("ok", tokens(71, 600), max_tokens=3)  # a bystander without a pool hit
    _put_chunks(client, sim, req, 3)
    sim.add(req)
    sim.add(other)
    _break(sim, fault)
    rec = sim.step()
    assert rec.allocs["hf"] == 3 * CHUNK_TOKENS  # vLLM counted 768 tokens as loaded
    assert not rec.meta.loads  # all or nothing: no partial load of a broken plan
    assert [(f.req_id, f.block_ids) for f in rec.meta.load_failures] == [("hf", rec.blocks["hf"][:6])]
    # The worker reports them (the harness plays it): vLLM rolls the request back to token 0.
    assert req.num_computed_tokens == 0 and not req.output_token_ids
    assert sim.sched.connector.contained_errors == (0 if fault == "plan-forgets-a-chunk" else 1)
    sim.side.__dict__.pop("build_connector_meta", None)
    sim.side.__dict__.pop("_state", None)
    sim.run()
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(req.output_token_ids) == 3
    assert other.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sim.side.requests == {}


def test_loads_for_requests_granted_nothing_are_dropped(new_sim, client):
    sim = new_sim()
    req = make_request("stray", tokens(72, 700), max_tokens=2)
    sim.add(req)
    real = sim.side.build_connector_meta

    def strays(out):
        meta = real(out)
        blocks = list(sim.sched.kv_cache_manager.get_block_ids("stray")[0])
        meta.loads.append(ChunkLoad("stray", b"k" * 16, blocks[:2]))  # would overwrite computed blocks
        return meta

    sim.side.build_connector_meta = strays
    rec = sim.step()
    assert rec.allocs == {"stray": 0} and not rec.meta.loads and not rec.meta.load_failures
