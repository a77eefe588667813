"""Shared wake-ups for periodic work: every periodic task is due at whole multiples of its own period.

An idle router's CPU goes mostly to waking up: each wake-up of its event loop costs ~55 us of CPU before any Python
runs (docs/benchmarks.md, "Idle router: fewer wake-ups"). Its periodic tasks (the engines' ``/metrics`` scrapes,
the health probes, the event-loop lag probe, the HTTP server's main-loop check) each used to sleep one period from
their own last run, so they woke the loop at unrelated instants. Here each task is due at the whole multiples of
its period on the event loop's clock (``loop.time()``): a task with a period of 0.5 s at ..., 41.0, 41.5, 42.0,
..., one with 1 s at 41.0, 42.0, .... Tasks whose periods are multiples of one another (the defaults: lag probe
0.1 s, health probes 1 s, scrapes 2 s, the server's check 1 s) then fall due at the same instants, and the loop
wakes once for all of them. No period changes: the grid of a task is its own period, and two tasks share the
instants that are multiples of both periods.

``next_due`` (pure): due times are whole multiples of the period; after the first, consecutive due times are
exactly one period apart (never closer); a round that ran past its next due time is followed by the first
multiple at least ``min_gap_s`` from now (missed rounds are skipped, never run in a burst). The first due time
after a start is the first multiple after the start: within one period (the step onto the grid; the only gap
shorter than a period). Due times are computed in whole nanoseconds so that two tasks due at the same instant get
the same float, and so the same timer tick of the loop (uvloop's timers have a millisecond resolution).

``sleep_until`` sleeps until a due time with ``loop.call_at`` (not a relative delay, which would be taken from a
slightly later clock reading and could land in the next millisecond).

Units: seconds (loop time).
"""

from __future__ import annotations

import asyncio
from typing import Any

#: nanoseconds per second: due times are whole nanoseconds
_NS = 1_000_000_000


def next_due(now: float, period_s: float, prev_due: float | None = None, min_gap_s: float = 0.0) -> float:
    """The next due time of a task run every ``period_s``: the first whole multiple of the period after
    ``prev_due`` (its last due time; None: after ``now``, a start) that is after ``now`` and at least ``min_gap_s``
    after it, s (loop time)."""
    step = max(1, round(period_s * _NS))
    after = round(now * _NS)
    floor = max(after + 1, round((now + min_gap_s) * _NS))
    if prev_due is not None:
        floor = max(floor, round(prev_due * _NS) + 1)
    k = -(-floor // step)  # the first multiple at or after floor
    return k * step / _NS


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def sleep_until(due: float, wake: asyncio.Event | None = None) -> bool:
    """Sleep until loop time ``due`` (at once when it has passed), or until ``wake`` is set first.

    Returns True when ``wake`` ended the sleep. Cancellation propagates.
    """
    loop = asyncio.get_running_loop()
    if wake is not None and wake.is_set():
        return True
    fut: asyncio.Future[None] = loop.create_future()
    timer = loop.call_at(due, _wake, fut)
    waiter: asyncio.Task[bool] | None = None
    try:
        if wake is None:
            await fut
            return False
        waiter = asyncio.ensure_future(wake.wait())
        either: set[asyncio.Future[Any]] = {fut, waiter}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        return waiter.done()
    finally:
        timer.cancel()
        if waiter is not None and not waiter.done():
            waiter.cancel()


async def sleep_to_next_due(period_s: float, prev_due: float | None = None, min_gap_s: float = 0.0) -> float:
    """Sleep until the next due time of a task run every ``period_s`` (``next_due`` from now and its last due time
    ``prev_due``) and return that due time (to pass back as ``prev_due`` next time), s (loop time)."""
    due = next_due(asyncio.get_running_loop().time(), period_s, prev_due, min_gap_s)
    await sleep_until(due)
    return due
