"""The second tier against a real mooncake_master: two pool services (two domains) over one
Mooncake Store and one nats-server, as separate processes.

What a user of two domains would notice: an object stored in domain A is fetched by domain B on
its lookup's hint, with the same bytes, metadata and part keys; an object that is missing,
corrupt or of another namespace is a miss; a stopped, killed or restarted master costs the pools
nothing but the tier (their own ops keep answering), a restarted master is an empty tier, and
nothing stays pinned or reserved.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from pool_helpers import pool_cli

from maru_vllm.launch import ProcessGroup
from maru_vllm.launch.mooncake import MooncakeMaster
from maru_vllm.launch.stack import PoolProcess
from maru_vllm.pool import PoolClient
from maru_vllm.pool.objects import payload_checksum
from maru_vllm.pool.tier2 import codec
from maru_vllm.pool.tier2.announce import KEYS_SUBJECT, Tier2Announcement, Tier2Entry
from tests.waiting import wait_until

NS = "tier2-test"
pytestmark = pytest.mark.slow


class Domains:
    def __init__(self, procs: ProcessGroup, log_dir: Path, nats_url: str) -> None:
        self.procs, self.log_dir, self.nats_url = procs, log_dir, nats_url
        self.master = procs.add(MooncakeMaster(log_dir / "mooncake-master.log")).serve()
        self.pools = [self._pool(n) for n in ("a", "b")]

    def _pool(self, domain: str) -> PoolProcess:
        name = f"t2{domain}{os.getpid()}{time.monotonic_ns() % 100000}"
        p = PoolProcess(
            name,
            "64M",
            self.log_dir / f"pool-{domain}.log",
            listen=[f"unix:///tmp/{name}.sock"],
            nats=self.nats_url,
            extra_args=[*self.master.pool_args(), "--mooncake-segment-size", "64M", "--metrics-port", "0"],
        )
        self.procs.add(p)
        return p.serve()

    def client(self, i: int, **kw: object) -> PoolClient:
        return PoolClient.connect(self.pools[i].address, checksum=True, **kw)  # type: ignore[arg-type]


@pytest.fixture
def domains(procs: ProcessGroup, log_dir: Path, nats) -> Iterator[Domains]:
    d = Domains(procs, log_dir, nats[1])
    yield d
    procs.stop_all()
    for p in d.pools:
        p.region_path.unlink(missing_ok=True)


def _tier(c: PoolClient) -> dict:
    return {k: v for k, v in c.stats().items() if k.startswith("tier2")}


def _put(c: PoolClient, keys: list[bytes], size: int = 1 << 20) -> dict[bytes, bytes]:
    out = {}
    for k in keys:
        data = os.urandom(size)
        assert c.put(k, data, namespace=NS, meta={"key": k.hex()}, parts=[k + b"/p0"])
        out[k] = data
    return out


def _fetch(b: PoolClient, keys: list[bytes], ns: str = NS) -> tuple[int, int]:
    """Ask for `keys` the way the connector's scheduler does, step after step: a lookup, and a
    promote of what only the tier holds (a fetch in flight is not started twice; one that failed,
    say on a connection to a master that has since restarted, is asked for again). The lookup
    once nothing is left only in the tier."""

    def settled() -> bool:
        present, lower = b.lookup_tiers(keys, ns)
        if lower:
            b.promote(keys[present : present + lower], ns)
        return lower == 0

    wait_until(settled, timeout=30, what="the fetch settles", interval=0.2)
    return b.lookup_tiers(keys, ns)


def _settled(c: PoolClient) -> bool:
    st = c.stats()
    return st["pinned"] == 0 and st["reserved"] == 0 and st["tier2_fetching"] == 0 and st["tier2_held"] == 0


def test_an_object_stored_in_one_domain_is_fetched_by_another(domains: Domains):
    a, b = domains.client(0), domains.client(1, local_lookups=True)
    keys = [b"chunk-%d" % i for i in range(3)]
    stored = _put(a, keys)
    wait_until(lambda: _tier(b)["tier2_keys"] == 3, timeout=30, what="B learns A's three tier-2 keys")
    assert _tier(a)["tier2_puts"] == 3
    assert b.lookup_prefix(keys, NS) == 0  # a hint is not a pool hit
    assert b.lookup_tiers(keys, NS) == (0, 3)
    assert b.lookup_tiers(keys, "another-namespace") == (0, 0)  # namespaces never mix

    assert _fetch(b, keys) == (3, 0)
    pins = b.acquire(keys, NS)  # checksum=True: every payload verified
    assert [p is not None and bytes(p.data) == stored[k] for p, k in zip(pins, keys)] == [True] * 3
    b.release(pins)
    assert b.lookup_parts([keys[0] + b"/p0"], NS) == [1]  # part keys came along
    snap = {o["key"]: o["meta"] for o in b.snapshot(NS)}
    assert snap == {k.hex(): {"key": k.hex()} for k in keys}  # metadata too: B's events announce them
    st = _tier(b)
    assert (st["tier2_gets"], st["tier2_hits"], st["tier2_misses"], st["tier2_corrupt"]) == (3, 3, 0, 0)
    assert st["tier2_puts"] == 0  # fetched objects are not written back
    wait_until(lambda: _settled(b), timeout=30, what="B holds no pin or reservation after the load")

    status = pool_cli("status", "--address", domains.pools[1].address)
    assert status.returncode == 0, status.stderr
    assert "tier 2" in status.stdout and "3 hits" in status.stdout
    metrics_port = int(b.stats().get("metrics_port", 0) or 0) or _metrics_port(domains.pools[1])
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert "maru_pool_tier2_hits_total" in body and "maru_pool_tier2_up" in body


def test_a_put_is_announced_with_its_chunk_metadata(domains: Domains):
    """What a worker's tier-2 credit reads: the put's key announcement carries the ChunkMeta the
    client committed (binary, as the connector commits it)."""
    from maru_vllm.pool import chunk_codec
    from tests.events.helpers import chunk_meta

    meta = msgspec.convert(chunk_meta(9, 0), chunk_codec.ChunkMeta)
    heard: list[Tier2Entry] = []

    async def listen_while_putting() -> None:
        import nats

        nc = await nats.connect(domains.nats_url)
        both = asyncio.Event()

        async def on(msg) -> None:
            heard.extend(msgspec.msgpack.decode(msg.data, type=Tier2Announcement).stored)
            if len(heard) >= 2:
                both.set()

        await nc.subscribe(KEYS_SUBJECT, cb=on)
        await nc.flush()
        a = domains.client(0)
        assert a.put(b"with-meta", os.urandom(4096), namespace=NS, meta=chunk_codec.encode(meta))
        assert a.put(b"without", os.urandom(4096), namespace=NS, meta={"key": "x"})
        try:
            await asyncio.wait_for(both.wait(), 30)
        finally:
            await nc.close()

    asyncio.run(listen_while_putting())
    by_key = {e.key: e for e in heard}
    assert set(by_key) == {b"with-meta", b"without"}, heard
    assert by_key[b"with-meta"].meta == meta
    assert by_key[b"without"].meta is None  # not a connector chunk: keys only


def _metrics_port(p: PoolProcess) -> int:
    m = wait_until(lambda: __import__("re").search(r"metrics port (\d+)", p.output()), timeout=10, what="metrics")
    return int(m.group(1))


def test_missing_corrupt_or_foreign_objects_are_misses(domains: Domains):
    """Hints come from NATS and objects from a store without authentication: anyone can announce a
    key or write an object. Whatever does not verify is a miss, and its hint goes away."""
    from mooncake.store import MooncakeDistributedStore

    b = domains.client(1, local_lookups=True)
    rogue = MooncakeDistributedStore()
    assert (
        rogue.setup("127.0.0.1", domains.master.metadata_url, 16 << 20, 16 << 20, "tcp", "", domains.master.address)
        == 0
    )
    payload = os.urandom(4096)
    good = codec.encode(NS, b"good", payload_checksum(payload), None, [], memoryview(payload))
    bad = bytearray(good)
    bad[-1] ^= 1
    assert rogue.put(codec.object_name(NS, b"corrupt"), bytes(bad)) == 0
    # an object of another namespace under this namespace's name for the key
    foreign = codec.encode("other", b"foreign", payload_checksum(payload), None, [], memoryview(payload))
    assert rogue.put(codec.object_name(NS, b"foreign"), bytes(foreign)) == 0
    entries = [Tier2Entry(NS, k, len(payload), len(good)) for k in (b"missing", b"corrupt", b"foreign")]
    _announce(domains, entries)
    keys = [b"missing", b"corrupt", b"foreign"]
    wait_until(lambda: b.lookup_tiers(keys[:1], NS) == (0, 1), timeout=30, what="B takes the announced hints")
    for k in keys:
        assert _fetch(b, [k]) == (0, 0)
    st = _tier(b)
    assert st["tier2_misses"] == 1 and st["tier2_corrupt"] == 2 and st["tier2_hits"] == 0
    assert b.stats()["objects"] == 0
    wait_until(lambda: _settled(b), timeout=30, what="nothing pinned or reserved")
    rogue.close()


def _announce(domains: Domains, entries: list[Tier2Entry]) -> None:
    import nats as nats_py

    async def send() -> None:
        nc = await nats_py.connect(domains.nats_url)
        msg = Tier2Announcement(domains.master.address, "rogue", "x", entries)
        await nc.publish(KEYS_SUBJECT, msgspec.msgpack.encode(msg))
        await nc.flush()
        await nc.close()

    asyncio.run(send())


def test_a_stopped_killed_or_restarted_master_costs_only_the_tier(domains: Domains):
    a, b = domains.client(0), domains.client(1, local_lookups=True)
    old = [b"old-%d" % i for i in range(3)]
    _put(a, old)
    wait_until(lambda: _tier(b)["tier2_keys"] == 3, timeout=30, what="B learns the keys")

    # SIGSTOP: the pools' own ops answer as before; the tier notices and withdraws its hints
    os.kill(domains.master.pid, signal.SIGSTOP)
    try:
        # (the clients' 5 s request deadline would raise here if an op waited on the tier)
        _put(a, [b"during-stop-%d" % i for i in range(3)])
        assert a.lookup_prefix([b"during-stop-0"], NS) == 1
        _, lower = b.lookup_tiers(old, NS)
        if lower:
            b.promote(old, NS)  # the fetch misses its deadline and trips B's tier
        wait_until(lambda: _tier(a)["tier2_state"] == "down", timeout=30, what="A's tier marked down")
        wait_until(lambda: _tier(b)["tier2_state"] == "down", timeout=30, what="B's tier marked down")
        assert b.lookup_tiers(old, NS) == (0, 0)  # no hint while the tier is down
    finally:
        os.kill(domains.master.pid, signal.SIGCONT)
    wait_until(lambda: _tier(a)["tier2_state"] == "up", timeout=60, what="A's tier back after SIGCONT")
    wait_until(lambda: _tier(b)["tier2_state"] == "up", timeout=60, what="B's tier back after SIGCONT")
    assert _fetch(b, old) == (3, 0)  # a stopped master kept its objects

    # SIGKILL and a new master on the same ports: an empty tier, never a stale read
    fresh = [b"after-restart-%d" % i for i in range(2)]
    domains.master.proc.kill()  # type: ignore[union-attr]
    domains.master.proc.wait()  # type: ignore[union-attr]
    _put(a, [b"during-kill"])  # the write-through fails fast and trips the tier
    wait_until(lambda: _tier(a)["tier2_state"] == "down", timeout=30, what="A's tier down without a master")
    domains.master.restart()
    domains.master.wait_ready()
    wait_until(lambda: _tier(a)["tier2_state"] == "up", timeout=60, what="A's tier up on the new master")
    assert _tier(a)["tier2_dropped_keys"] >= 3  # the keys the old master had are gone
    b.remove(old, NS)  # B no longer holds them; only the tier could supply them
    wait_until(lambda: b.lookup_tiers(old, NS) == (0, 0), timeout=30, what="no hint for keys of the old master")
    stored = _put(a, fresh)
    wait_until(lambda: b.lookup_tiers(fresh, NS) == (0, 2), timeout=60, what="B hinted the new master's keys")
    assert _fetch(b, fresh) == (2, 0)
    pins = b.acquire(fresh, NS)
    assert all(p is not None and bytes(p.data) == stored[k] for p, k in zip(pins, fresh))
    b.release(pins)
    # A generous bound: beside other heavy work on the machine, settling after the outages has
    # taken longer than 30 s (alone the whole test takes ~18 s).
    for c in (a, b):
        wait_until(lambda c=c: _settled(c), timeout=120, what="nothing pinned or reserved after the outages")
