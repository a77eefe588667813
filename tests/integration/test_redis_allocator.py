"""RedisIndexAllocator against a real redis-server: races between processes, ordinals, grace, outages."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis

from membership.replicas import RedisIndexAllocator, ReplicaTable
from tests.helpers import REPO, wait_until
from tests.redis_server import RedisServer

RACER = r"""
import json, random, sys, time
import redis
from membership.replicas import RedisIndexAllocator, ReplicaTable
url, seed, names = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
r = redis.Redis.from_url(url, socket_timeout=2)
alloc = RedisIndexAllocator(r, dynamic_base=100, release_grace_s=60)
table = ReplicaTable(alloc)
while not r.exists("go"):
    time.sleep(0.001)
random.Random(seed).shuffle(names)
for n in names:
    table.upsert(n, "http://127.0.0.1:1")
print(json.dumps({rep.name: rep.index for rep in table.all()}))
"""


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def _client(srv: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(srv.url, socket_timeout=0.5, socket_connect_timeout=0.5)


def test_three_processes_race_for_unique_stable_indices(server: RedisServer) -> None:
    names = [f"engine-{c}" for c in "abcdefghijklmnopqrst"] + ["vllm-0", "vllm-1", "vllm-7"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, server.url, str(seed), ",".join(names)],
            cwd=str(REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for seed in range(3)
    ]
    try:
        r = _client(server)
        wait_until(lambda: r.client_list() and len(r.client_list()) >= 4, 20.0, what="3 racers connected")
        r.set("go", "1")
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err.decode()
            outs.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    # every process sees the same mapping, indices are unique, ordinals kept, dynamic ones dense from 100
    assert outs[0] == outs[1] == outs[2]
    mapping = outs[0]
    assert len(set(mapping.values())) == len(names)
    assert mapping["vllm-0"] == 0 and mapping["vllm-1"] == 1 and mapping["vllm-7"] == 7
    assert sorted(v for k, v in mapping.items() if k.startswith("engine-")) == list(range(100, 120))
    # stable: a fresh allocator (router restart) gets the same answers
    fresh = RedisIndexAllocator(_client(server), dynamic_base=100)
    assert {n: fresh.allocate(n) for n in names} == mapping


def test_release_after_grace_and_reuse(server: RedisServer) -> None:
    r = _client(server)
    alloc = RedisIndexAllocator(r, release_grace_s=0.3)
    other = RedisIndexAllocator(r, release_grace_s=0.3)  # a second router
    assert alloc.allocate("pod-a") == 0 and other.allocate("pod-b") == 1
    alloc.release("pod-a")
    assert other.allocate("pod-c") == 2  # 0 is reserved during the grace period
    assert alloc.allocate("pod-a") == 0  # same pod back in time: same index, release cancelled
    alloc.release("pod-a")
    wait_until(lambda: r.zscore(alloc.keys[2], "pod-a") is not None, 1.0, what="release recorded")
    import time

    time.sleep(0.4)  # let the 0.3 s grace period pass (Redis server time)
    assert other.allocate("pod-d") == 0  # freed index reused (lowest free)
    assert alloc.allocate("pod-a") == 3
    assert alloc.snapshot() == {"pod-b": 1, "pod-c": 2, "pod-d": 0, "pod-a": 3}


def test_ordinal_taken_falls_back_and_custom_regex(server: RedisServer) -> None:
    r = _client(server)
    alloc = RedisIndexAllocator(r, ordinal_pattern=r"^gpu(\d+)\.", dynamic_base=50)
    assert alloc.allocate("gpu3.node-a") == 3
    assert alloc.allocate("vllm-2") == 50  # the default pattern is not in use
    assert alloc.allocate("gpu3.node-b") == 51  # ordinal already taken: lowest free dynamic index


def test_stale_names_are_freed_unless_touched(server: RedisServer) -> None:
    import time

    r = _client(server)
    alloc = RedisIndexAllocator(r, stale_s=0.3)
    assert alloc.allocate("kept") == 0 and alloc.allocate("crashed-router-pod") == 1
    for _ in range(4):
        time.sleep(0.1)
        assert alloc.touch(["kept"]) == 1
    assert alloc.allocate("new") == 1  # "crashed-router-pod" was never touched: freed
    assert alloc.snapshot()["kept"] == 0


def test_redis_down_provisional_then_reconciled(server: RedisServer) -> None:
    r = _client(server)
    alloc = RedisIndexAllocator(r, dynamic_base=10)
    table = ReplicaTable(alloc)
    assert table.upsert("a", "http://127.0.0.1:1").index == 10
    alloc.snapshot()
    server.stop()
    # Redis down: the known name keeps its index, a new one gets a provisional one; nothing raises
    assert table.upsert("a", "http://127.0.0.1:2").index == 10
    b = table.upsert("b", "http://127.0.0.1:3")
    assert b.index == 11 and alloc.available is False and alloc.provisional == {"b"}
    assert alloc.reconcile() == {}  # still down: nothing moves, nothing raises
    server.start()  # back, empty (no persistence): re-registration keeps the held indices
    assert alloc.reconcile() == {}
    assert alloc.available is True and alloc.provisional == set()
    assert alloc.snapshot() == {"a": 10, "b": 11}


def test_restart_race_moves_conflicting_replica(server: RedisServer) -> None:
    alloc = RedisIndexAllocator(_client(server), dynamic_base=10)
    table = ReplicaTable(alloc)
    cleared: list[int] = []
    table.on_remove(lambda rep: cleared.append(rep.index))
    table.upsert("a", "http://127.0.0.1:1")
    table.upsert("b", "http://127.0.0.1:2")
    server.restart()
    peer = RedisIndexAllocator(_client(server), dynamic_base=10)
    assert peer.allocate("zz") == 10  # a peer registered a new pod before we re-registered
    moved = alloc.reconcile()
    assert moved == {"a": (10, 12)}
    for name in moved:
        assert table.reindex(name) == (10, 12)
    assert cleared == [10]  # the old bit is cleared from the prefix index
    shared = peer.snapshot()
    assert {rep.name: rep.index for rep in table.all()} == {k: v for k, v in shared.items() if k != "zz"}
    assert table.by_index(12) is table.get("a") and table.by_index(10) is None
