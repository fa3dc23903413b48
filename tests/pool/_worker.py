"""Client processes the pool tests start (real processes on real sockets).

Modes:
  mixed ADDRESS WORKER NWORKERS COUNT SEED  - put COUNT objects of mixed sizes and read back
                                              random ones (own and other workers'), verifying
                                              every byte; prints one JSON result line.
  reserve-hang ADDRESS KEY SIZE            - reserve, write half the payload, print RESERVED, hang.
  pin-hang ADDRESS KEY                     - pin KEY, print PINNED, hang.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time

from maru_vllm.pool import PoolClient


def payload(key: bytes, size: int) -> bytes:
    block = hashlib.blake2b(key, digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


def key_for(worker: int, i: int, size: int) -> bytes:
    return f"w{worker}-{i}-{size}".encode()


def size_of(key: bytes) -> int:
    return int(key.decode().rsplit("-", 1)[1])


def mixed(address: str, worker: int, nworkers: int, count: int, seed: int) -> None:
    rng = random.Random(seed)
    sizes = [1, 100, 4000, 4096, 30_000, 65_536, 200_000, 600_000]
    stored = puts = reads = verified = corrupt = misses = 0
    written: list[list[bytes]] = [[] for _ in range(nworkers)]
    with PoolClient.connect(address) as c:
        for i in range(count):
            size = rng.choice(sizes) + rng.randrange(0, 64)
            key = key_for(worker, i, size)
            puts += 1
            if c.put(key, payload(key, size), meta={"worker": worker, "i": i}):
                stored += 1
            written[worker].append(key)
            # read back two of this worker's recent keys (they may have been evicted: a miss)
            for k in rng.sample(written[worker][-50:], min(2, len(written[worker]))):
                reads += 1
                with c.get(k) as view:
                    if view is None:
                        misses += 1
                    elif bytes(view) == payload(k, size_of(k)):
                        verified += 1
                    else:
                        corrupt += 1
            # batched acquire of keys other workers stored (found through the snapshot now and then)
            if i % 200 == 199:
                others = [
                    bytes.fromhex(o["key"])
                    for o in c.snapshot()
                    if not o["key"].startswith(f"w{worker}-".encode().hex())
                ]
                pins = c.acquire(others[:64])
                for k, pin in zip(others[:64], pins):
                    reads += 1
                    if pin is None:
                        misses += 1
                    elif bytes(pin.data) == payload(k, size_of(k)):
                        verified += 1
                    else:
                        corrupt += 1
                c.release(pins)
    print(
        json.dumps(
            {"puts": puts, "stored": stored, "reads": reads, "verified": verified, "corrupt": corrupt, "misses": misses}
        ),
        flush=True,
    )


def reserve_hang(address: str, key: bytes, size: int) -> None:
    c = PoolClient.connect(address)
    (res,) = c.reserve([(key, size)])
    assert res is not None, "reserve failed"
    res.buffer[: size // 2] = payload(key, size)[: size // 2]
    print("RESERVED", flush=True)
    time.sleep(3600)


def pin_hang(address: str, key: bytes) -> None:
    c = PoolClient.connect(address)
    (pin,) = c.acquire([key])
    assert pin is not None, "key not present"
    print("PINNED", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    mode, address, *rest = sys.argv[1:]
    if mode == "mixed":
        mixed(address, *(int(x) for x in rest))
    elif mode == "reserve-hang":
        reserve_hang(address, rest[0].encode(), int(rest[1]))
    elif mode == "pin-hang":
        pin_hang(address, rest[0].encode())
    else:
        sys.exit(f"unknown mode {mode!r}")
