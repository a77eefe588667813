"""SharedState against a real redis-server: broadcast, sessions, idempotency, Redis killed and restarted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import redis

from membership.shared_state import ResponseMap, SharedState, SharedStateUnavailable
from tests.redis_server import RedisServer


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


async def _wait(cond: Callable[[], object], timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def _pair(url: str, **kw: object) -> tuple[SharedState, SharedState]:
    a = SharedState(url, router_id="router-a", retry_max_s=0.3, **kw)  # type: ignore[arg-type]
    b = SharedState(url, router_id="router-b", retry_max_s=0.3, **kw)  # type: ignore[arg-type]
    await a.start()
    await b.start()
    assert await a.wait_connected(5) and await b.wait_connected(5)
    return a, b


async def test_decisions_broadcast_to_peers_only(server: RedisServer) -> None:
    a, b = await _pair(server.url)
    got_a: list[tuple[str, list[int]]] = []
    got_b: list[tuple[str, list[int]]] = []
    a.on_decision(lambda r, k: got_a.append((r, k)))
    b.on_decision(lambda r, k: got_b.append((r, k)))
    try:
        keys = [0, 1, 2**63 + 5, 2**64 - 1]
        # the subscription may take a moment after connect: publish until the first one arrives
        for _ in range(50):
            assert a.publish_decision("vllm-1", keys)
            await asyncio.sleep(0.05)
            if got_b:
                break
        assert got_b and got_b[0] == ("vllm-1", keys)
        n = len(got_b)
        b.publish_decision("vllm-2", [7])
        await _wait(lambda: got_a == [("vllm-2", [7])], 3.0, "a receives b's decision")
        assert len(got_b) == n and b.stats.received_own >= 1  # nobody applies its own decisions twice
        redis.Redis.from_url(server.url).publish(a.channel, b"garbage")
        await _wait(
            lambda: a.stats.bad_messages >= 1 and b.stats.bad_messages >= 1, 3.0, "bad message counted"
        )
    finally:
        await a.stop()
        await b.stop()


async def test_sessions_shared_with_ttl_and_health(server: RedisServer) -> None:
    a, b = await _pair(server.url, session_ttl_s=30)
    try:
        await a.set_session("s1", "vllm-0")
        assert await b.get_session("s1") == "vllm-0"
        ttl = redis.Redis.from_url(server.url).ttl(f"{a.prefix}session:s1")
        assert 0 < ttl <= 30
        assert await b.session_replica("s1", lambda name: True) == "vllm-0"
        assert await b.session_replica("s1", lambda name: name != "vllm-0") is None  # replica unhealthy
        assert await a.get_session("s1") is None  # the mapping was dropped for everyone
        assert await a.get_session("unknown") is None
    finally:
        await a.stop()
        await b.stop()


async def test_idempotency_store(server: RedisServer) -> None:
    a, b = await _pair(server.url, idempotency_ttl_s=600)
    try:
        first = await a.idempotency_begin("k1", "fp1")
        assert first.state == "new"
        second = await b.idempotency_begin("k1", "fp1")
        assert second.state == "in_flight" and second.fingerprint == "fp1"
        await a.idempotency_finish("k1", {"status": 200, "body": "hello"}, "fp1")
        third = await b.idempotency_begin("k1")
        assert third.state == "done" and third.response == {"status": 200, "body": "hello"}
        ttl = redis.Redis.from_url(server.url).ttl(f"{a.prefix}idem:k1")
        assert 590 < ttl <= 600
        assert (await a.idempotency_begin("k2")).state == "new"
        await a.idempotency_abort("k2")  # failed before a response: the key can be claimed again
        assert (await b.idempotency_begin("k2")).state == "new"
    finally:
        await a.stop()
        await b.stop()
    nothing = SharedState(server.url)  # never started: no client
    with pytest.raises(SharedStateUnavailable, match="redis_url"):
        await nothing.idempotency_begin("k")


async def test_redis_killed_and_restarted(server: RedisServer) -> None:
    a, b = await _pair(server.url, session_ttl_s=60)
    resynced: list[int] = []
    a.on_reconnect(lambda: resynced.append(1))
    got_b: list[tuple[str, list[int]]] = []
    b.on_decision(lambda r, k: got_b.append((r, k)))
    try:
        await a.set_session("s-before", "vllm-3")
        server.stop()
        # local operations never raise while Redis is down, and never wait long
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(20):
            await a.set_session(f"s{i}", "vllm-1")
            assert await a.get_session(f"s{i}") == "vllm-1"
            a.publish_decision("vllm-1", [i])
        assert loop.time() - t0 < 3.0
        await _wait(lambda: not a.available and not b.available, 5.0, "outage detected")
        assert a.snapshot()["available"] is False and a.stats.errors >= 1
        with pytest.raises(SharedStateUnavailable, match="unreachable"):
            await a.idempotency_begin("k")
        server.start()  # same port, empty data
        await _wait(lambda: a.available and b.available, 10.0, "reconnected")
        await _wait(lambda: resynced == [1], 3.0, "on_reconnect ran")
        assert a.stats.reconnects == 1
        # local sessions were re-published to the new Redis, so peers see them again
        await _wait(
            lambda: redis.Redis.from_url(server.url).get(f"{a.prefix}session:s5") == b"vllm-1",
            3.0,
            "sessions re-published",
        )
        assert await b.get_session("s-before") == "vllm-3"
        # broadcasts resume
        for _ in range(50):
            a.publish_decision("vllm-2", [42])
            await asyncio.sleep(0.05)
            if ("vllm-2", [42]) in got_b:
                break
        assert ("vllm-2", [42]) in got_b
        assert (await a.idempotency_begin("k-after")).state == "new"
    finally:
        await a.stop()
        await b.stop()


async def test_response_ids_shared_by_router_replicas_with_ttl(server: RedisServer) -> None:
    a, b = await _pair(server.url)
    map_a = ResponseMap(a, ttl_s=120, local_max=100)
    map_b = ResponseMap(b, ttl_s=120, local_max=100)
    try:
        assert await map_a.remember("resp_0123abcd", "vllm-1")
        assert await map_b.lookup("resp_0123abcd") == "vllm-1"  # written by a, read by b through Redis
        assert map_b.stats.hits_shared == 1
        raw = redis.Redis.from_url(server.url)
        key = f"{a.prefix}resp:resp_0123abcd"
        assert raw.get(key) == b"vllm-1" and 100 < raw.ttl(key) <= 120
        raw.expire(key, 5)
        assert await map_b.lookup("resp_0123abcd") == "vllm-1"
        assert raw.ttl(key) > 100  # a lookup refreshes the lifetime for every router
        assert await map_b.lookup("resp_unknown") is None and map_b.stats.misses == 1
        await map_b.forget("resp_0123abcd")
        assert raw.get(key) is None
        assert await map_a.lookup("resp_0123abcd") == "vllm-1"  # a's own local copy (never wrong, only stale)
        assert map_a.stats.repaired == 1 and raw.get(key) == b"vllm-1"  # and written back
    finally:
        await a.stop()
        await b.stop()


async def test_response_ids_survive_a_redis_outage(server: RedisServer) -> None:
    a, b = await _pair(server.url)
    map_a = ResponseMap(a, ttl_s=300, local_max=1000)
    map_b = ResponseMap(b, ttl_s=300, local_max=1000)
    try:
        await map_a.remember("resp_before", "vllm-0")
        server.stop()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(20):  # never raises, never waits long
            assert await map_a.remember(f"resp_{i}", "vllm-2")
            assert await map_a.lookup(f"resp_{i}") == "vllm-2"
        assert loop.time() - t0 < 3.0
        await _wait(lambda: not a.available and not b.available, 5.0, "outage detected")
        assert await map_a.lookup("resp_before") == "vllm-0"
        assert await map_b.lookup("resp_7") is None  # b never saw it: nothing shared while Redis is down
        assert map_a.stats.local_fallbacks >= 1
        server.start()  # same port, empty data
        await _wait(lambda: a.available and b.available, 10.0, "reconnected")
        raw = redis.Redis.from_url(server.url)
        await _wait(
            lambda: raw.get(f"{a.prefix}resp:resp_7") == b"vllm-2", 5.0, "local response ids re-published"
        )
        assert await map_b.lookup("resp_7") == "vllm-2" and await map_b.lookup("resp_before") == "vllm-0"
        assert map_a.stats.republished == 21 and 0 < raw.ttl(f"{a.prefix}resp:resp_7") <= 300
    finally:
        await a.stop()
        await b.stop()
