"""ResponseMap without Redis: the local map alone (bounded LRU, lifetime refreshed on use, ids checked), and a
configured Redis that is down (the local map answers, counted as fallbacks, nothing raises)."""

from __future__ import annotations

import pytest

from membership.shared_state import MAX_RESPONSE_ID_CHARS, ResponseMap, SharedState
from tests.helpers import FakeClock


async def test_local_map_remembers_and_expires_after_its_ttl() -> None:
    clock = FakeClock()
    m = ResponseMap(None, ttl_s=60, local_max=10, clock=clock)
    assert await m.remember("resp_a", "r0")
    assert await m.lookup("resp_a") == "r0"
    clock.now += 50
    assert await m.lookup("resp_a") == "r0"  # used: its lifetime starts again
    clock.now += 50
    assert await m.lookup("resp_a") == "r0"
    clock.now += 61
    assert await m.lookup("resp_a") is None
    assert m.snapshot()["local_entries"] == 0 and m.stats.misses == 1 and m.stats.hits_local == 3


async def test_local_map_is_bounded_least_recently_used_first() -> None:
    m = ResponseMap(None, ttl_s=600, local_max=3, clock=FakeClock())
    for i in range(3):
        await m.remember(f"resp_{i}", f"r{i}")
    assert await m.lookup("resp_0") == "r0"  # resp_1 is now the least recently used
    await m.remember("resp_3", "r3")
    assert await m.lookup("resp_1") is None
    assert [await m.lookup(f"resp_{i}") for i in (0, 2, 3)] == ["r0", "r2", "r3"]
    assert m.stats.evicted == 1 and m.snapshot()["local_entries"] == 3


@pytest.mark.parametrize(
    "bad", ["", "x" * (MAX_RESPONSE_ID_CHARS + 1), "resp a", "resp_\n", "resp_é", "resp_\x00"]
)
async def test_unacceptable_ids_are_neither_stored_nor_looked_up(bad: str) -> None:
    m = ResponseMap(None, ttl_s=60, local_max=10)
    assert await m.remember(bad, "r0") is False
    assert await m.lookup(bad) is None
    assert m.stats.rejected_ids == 2 and m.snapshot()["local_entries"] == 0


async def test_forget_drops_an_entry() -> None:
    m = ResponseMap(None, ttl_s=60, local_max=10)
    await m.remember("resp_a", "r0")
    await m.forget("resp_a")
    assert await m.lookup("resp_a") is None


async def test_redis_configured_but_down_answers_from_the_local_map() -> None:
    shared = SharedState("redis://127.0.0.1:1/0", timeout_s=0.1)  # never started: no client, not available
    m = ResponseMap(shared, ttl_s=60, local_max=10)
    assert await m.remember("resp_a", "r0")
    assert await m.lookup("resp_a") == "r0"
    assert await m.lookup("resp_b") is None
    await m.forget("resp_b")
    snap = m.snapshot()
    assert snap["shared"] is False and snap["local_fallbacks"] == 2 and snap["hits_local"] == 1


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        ResponseMap(None, ttl_s=0, local_max=10)
    with pytest.raises(ValueError):
        ResponseMap(None, ttl_s=1, local_max=0)
