"""``membership.ticks``: periodic work due at whole multiples of its period, so tasks of related periods share
wake-ups; at least one round per period, never two within one (after the step onto the grid at the start); the
loops that use it (``run_every``, the health probes, the loop-lag probe) keep to it."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from membership.health import HealthChecker
from membership.replicas import ReplicaTable
from membership.tasks import cancel_and_wait, run_every
from membership.ticks import next_due, sleep_until
from router.serve.loop_lag import LoopLag


def _on_grid(t: float, period: float) -> bool:
    return abs(t / period - round(t / period)) < 1e-9


def test_due_times_are_multiples_of_the_period_one_period_apart() -> None:
    assert next_due(41.23, 0.5) == 41.5  # a start: the first multiple after now
    assert next_due(41.5, 0.5) == 42.0  # strictly after now
    assert next_due(41.52, 0.5, prev_due=41.5) == 42.0  # a period after the last due time
    assert next_due(41.5004, 0.1, prev_due=41.5) == pytest.approx(41.6)
    # a round that ran past its next due times: the missed ones are skipped, the first one min_gap_s on is next
    assert next_due(42.71, 0.5, prev_due=41.5) == 43.0
    assert next_due(42.98, 0.5, prev_due=41.5, min_gap_s=0.05) == 43.5
    assert next_due(42.9, 0.5, prev_due=42.5, min_gap_s=0.05) == 43.0  # on time: min_gap_s does not delay it


def test_tasks_of_related_periods_are_due_at_the_same_instants() -> None:
    """A 0.1 s, a 0.5 s and a 1 s task started at unrelated instants: every due time of the slower ones is exactly
    (the same float: the same timer tick of the loop) a due time of the faster ones."""
    rng = random.Random(7)
    dues: dict[float, set[float]] = {}
    for period in (0.1, 0.5, 1.0):
        now = 1000.0 + rng.random()
        due = next_due(now, period)
        seen = set()
        while due < 1010.0:
            seen.add(due)
            now = due + rng.random() * 0.2 * period  # the round ran late and took a while
            due = next_due(now, period, due)
        dues[period] = seen
    assert dues[1.0] <= dues[0.5] <= dues[0.1]
    assert len(dues[0.5]) >= 17 and len(dues[1.0]) >= 8


@pytest.mark.parametrize("period", [0.1, 0.25, 1.0, 2.0, 0.37])
def test_at_least_one_round_per_period_and_never_two_within_one(period: float) -> None:
    """Simulated rounds that start late (loop lag) and take up to 90 % of the period: after the first, consecutive
    due times are exactly one period apart; the first comes within one period of the start."""
    rng = random.Random(period)
    start = 5000.0 + rng.random() * 10
    due = next_due(start, period)
    assert start < due <= start + period + 1e-9 and _on_grid(due, period)
    for _ in range(500):
        ran = due + rng.random() * 0.05 * period
        ended = ran + rng.random() * 0.9 * period
        nxt = next_due(ended, period, due, min_gap_s=0.0)
        assert nxt - due == pytest.approx(period, abs=1e-8)
        assert _on_grid(nxt, period)
        due = nxt


async def test_sleep_until_wakes_at_the_due_time_or_at_the_event() -> None:
    loop = asyncio.get_running_loop()
    due = loop.time() + 0.05
    assert await sleep_until(due) is False
    assert loop.time() >= due - 0.002  # the loop's timer resolution
    wake = asyncio.Event()
    loop.call_later(0.02, wake.set)
    t0 = loop.time()
    assert await sleep_until(t0 + 30.0, wake) is True
    assert loop.time() - t0 < 10.0
    assert await sleep_until(t0 - 1.0) is False  # passed: at once


async def test_run_every_runs_its_rounds_on_the_periods_multiples() -> None:
    loop = asyncio.get_running_loop()
    starts: list[float] = []
    enough = asyncio.Event()

    async def round_fn() -> None:
        starts.append(loop.time())
        if len(starts) == 6:
            enough.set()

    task = asyncio.ensure_future(run_every(round_fn, 0.05, "test", logging.getLogger("t"), min_sleep_s=0.0))
    try:
        await asyncio.wait_for(enough.wait(), 30.0)
    finally:
        await cancel_and_wait(task)
    # the first round at once, then one at each multiple of 0.05 s (timers fire at or after their due time)
    for t in starts[1:]:
        past = (t / 0.05) % 1.0  # how far past a multiple, in periods
        assert past < 0.4 or past > 1 - 1e-6, (t, past)
    gaps = [b - a for a, b in zip(starts[1:], starts[2:], strict=False)]
    assert all(g > 0.03 for g in gaps)  # never two rounds within one period (less a late timer's slack)


async def test_loop_lag_probe_on_its_grid_and_on_the_idle_period_while_idle() -> None:
    """While the router has no request work the probe waits for the idle period's due times (shared with the
    scrapes or health probes); request work or ``hurry`` (a new request) puts it back on its own period."""
    loop = asyncio.get_running_loop()
    work = [0]
    lag = LoopLag(interval_s=0.02, window_s=1.0, idle_interval_s=0.2)
    lag.work = lambda: work[0]
    probes: list[float] = []
    lag.listeners.append(lambda p: probes.append(p.at))
    lag.start()
    try:
        assert lag.due is not None and _on_grid(lag.due, 0.02)
        await _until(lambda: len(probes) >= 1)
        assert lag.relaxed and lag.due is not None and _on_grid(lag.due, 0.2)  # idle: the idle grid
        n = len(probes)
        await asyncio.sleep(0.25)
        assert len(probes) - n <= 2  # ~1 probe in 0.25 s, not ~12
        lag.hurry()  # a request arrives
        assert not lag.relaxed and _on_grid(lag.due, 0.02) and lag.due - loop.time() <= 0.021
        work[0] = 1  # and is in progress
        n = len(probes)
        await asyncio.sleep(0.25)
        assert len(probes) - n >= 6  # back at ~12 probes in 0.25 s (fewer on a busy machine)
        assert not lag.relaxed
        work[0] = 0  # it ended: the probe keeps its period for a whole idle period, then relaxes
        ended = loop.time()
        await _until(lambda: lag.relaxed)
        assert loop.time() - ended >= 0.2 - 0.021
    finally:
        lag.stop()


async def _until(cond: object, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


class _Page:
    status_code = 200

    def json(self) -> object:
        return {}


class _RecordingClient:
    """A probe client answering 200 at once and recording when each probe went out (loop time)."""

    def __init__(self) -> None:
        self.at: list[float] = []

    async def get(self, url: str, *, timeout: float, headers: object = None) -> _Page:
        self.at.append(asyncio.get_running_loop().time())
        return _Page()

    async def aclose(self) -> None:
        """Part of the probe-client shape; an injected client is never closed by the checker."""


async def test_health_rounds_on_the_periods_multiples_and_a_wake_keeps_them() -> None:
    """One probe round per due time (a timer that fires a hair early does not run a second round), and a passive
    failure's extra round at once leaves the periodic due times where they were."""
    table = ReplicaTable()
    table.upsert("r0", "http://127.0.0.1:9", labels={"source": "discovered"})
    checker = HealthChecker(table, interval_s=0.05, timeout_s=1.0, admit_joining=True)
    client = _RecordingClient()
    checker.use_client(client)
    await checker.start()
    try:
        await _until(lambda: len(client.at) >= 6)
        checker.record_failure("r0")  # wakes the loop: one round at once
        woke = asyncio.get_running_loop().time()
        await _until(lambda: len(client.at) >= 12)
    finally:
        await checker.stop()
    periodic = [t for t in client.at[1:] if abs(t - woke) > 0.01]  # the first: start(); one: the wake-up
    assert len(client.at) - len(periodic) <= 3
    for t in periodic:
        past = (t / 0.05) % 1.0
        assert past < 0.3 or past > 1 - 1e-6, (t, past)  # just after a multiple of the period
    ks = [round(t / 0.05 - 0.3) for t in periodic]
    assert len(set(ks)) == len(ks), ks  # never two rounds for one due time
