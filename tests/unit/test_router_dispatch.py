"""router/core/dispatch.py: the async side of the gate (futures, cancellation, expiry, replicas leaving, shutdown)."""

from __future__ import annotations

import asyncio

import pytest

from index.hashing import block_keys
from index.prefix_index import PrefixIndex
from policies.dispatch import DispatchSettings
from router.core.dispatch import DispatchGate, ReplicaGone
from tests.helpers import FakeClock

BS = 16


def make(
    limit: int = 10, patience: float = 5.0, max_wait: float = 60.0, routable: set[int] | None = None
) -> tuple[DispatchGate, PrefixIndex, FakeClock]:
    index = PrefixIndex(block_size=BS)
    clock = FakeClock()
    ok = routable if routable is not None else {0, 1}
    gate = DispatchGate(
        DispatchSettings(limit_tokens=limit, patience_s=patience, max_wait_s=max_wait),
        index,
        BS,
        routable=lambda i: i in ok,
        clock=clock,
    )
    return gate, index, clock


def keys(seed: int, blocks: int) -> list[int]:
    return block_keys([seed * 100_000 + i for i in range(blocks * BS)], BS, 1)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_warm_request_goes_first_and_gets_its_uncached_count_now() -> None:
    async def run() -> None:
        gate, index, clock = make()
        assert await gate.wait(0, keys(1, 40), 640, 640, stream=True) == 640  # sent at once
        cold_keys, warm_keys = keys(2, 20), keys(3, 20)
        cold = asyncio.create_task(gate.wait(0, cold_keys, 320, 320, stream=True))
        warm = asyncio.create_task(gate.wait(0, warm_keys, 320, 320, stream=True))
        await settle()
        assert gate.queues.waiting(0) == 2
        index.store(0, None, warm_keys[:12])  # 12 of its 20 blocks became cached while it waited
        clock.now += 1
        gate.done(0, 640)
        await settle()
        assert warm.done() and not cold.done()
        assert warm.result() == 320 - 12 * BS  # what the gate counts: the uncached part now
        gate.done(0, warm.result())
        await settle()
        assert cold.result() == 320
        assert gate.queues.reordered_total == 1

    asyncio.run(run())


def test_non_streamed_and_gate_off_are_never_held() -> None:
    async def run() -> None:
        gate, _, _ = make()
        assert await gate.wait(0, keys(1, 4), 64, 64, stream=True) == 64
        assert await gate.wait(0, keys(2, 4), 64, 64, stream=False) is None
        off, _, _ = make(limit=0)
        for i in range(3):
            assert await off.wait(0, keys(i, 4), 64, 64, stream=True) is None

    asyncio.run(run())


def test_a_cancelled_waiter_leaves_the_queue_and_a_released_one_gives_its_slot_back() -> None:
    async def run() -> None:
        gate, _, _ = make()
        await gate.wait(0, keys(1, 4), 64, 64, stream=True)
        a = asyncio.create_task(gate.wait(0, keys(2, 4), 64, 64, stream=True))
        b = asyncio.create_task(gate.wait(0, keys(3, 4), 64, 64, stream=True))
        await settle()
        a.cancel()
        await settle()
        assert gate.queues.waiting(0) == 1
        gate.done(0, 64)  # b is released ...
        b.cancel()  # ... and cancelled before it runs: its tokens must not stay counted
        await settle()
        with pytest.raises(asyncio.CancelledError):
            await b
        assert gate.queues.queue(0).sent_tokens == 0
        assert await gate.wait(0, keys(4, 4), 64, 64, stream=True) == 64  # the gate is open again

    asyncio.run(run())


def test_expired_and_gone_requests_leave_the_queue() -> None:
    async def run() -> None:
        routable = {0, 1}
        gate, _, clock = make(max_wait=3.0, routable=routable)
        await gate.wait(0, keys(1, 4), 64, 64, stream=True)
        await gate.wait(1, keys(2, 4), 64, 64, stream=True)
        late = asyncio.create_task(gate.wait(0, keys(3, 4), 64, 64, stream=True))
        orphan = asyncio.create_task(gate.wait(1, keys(4, 4), 64, 64, stream=True))
        await settle()
        clock.now += 3.0
        routable.discard(1)
        gate.check(clock.now)
        await settle()
        assert late.result() == 64 and gate.queues.expired_total == 1
        with pytest.raises(ReplicaGone):
            await orphan
        assert gate.gone_total == 1 and gate.queues.waiting() == 0

    asyncio.run(run())


def test_the_timer_sends_expired_requests_without_any_first_token() -> None:
    async def run() -> None:
        gate = DispatchGate(
            DispatchSettings(limit_tokens=10, max_wait_s=0.3),
            PrefixIndex(block_size=BS),
            BS,
            routable=lambda i: True,
        )
        await gate.wait(0, keys(1, 4), 64, 64, stream=True)
        got = await asyncio.wait_for(gate.wait(0, keys(2, 4), 64, 64, stream=True), timeout=5)
        assert got == 64 and gate.queues.expired_total == 1
        await gate.aclose()

    asyncio.run(run())


def test_shutdown_fails_waiting_requests_over() -> None:
    async def run() -> None:
        gate, _, _ = make()
        await gate.wait(0, keys(1, 4), 64, 64, stream=True)
        w = asyncio.create_task(gate.wait(0, keys(2, 4), 64, 64, stream=True))
        await settle()
        await gate.aclose()
        with pytest.raises(ReplicaGone):
            await w

    asyncio.run(run())
