"""``membership.tasks``: cancel_and_wait stops a task even when it loses a cancellation; run_every keeps going."""

from __future__ import annotations

import asyncio
import logging

import pytest

from membership.tasks import cancel_and_wait, run_every


async def test_cancels_a_plain_task_and_accepts_none_and_done_tasks() -> None:
    task = asyncio.create_task(asyncio.sleep(3600))
    await cancel_and_wait(task)
    assert task.cancelled()
    await cancel_and_wait(None)

    async def boom() -> None:
        raise RuntimeError("failed earlier")

    failed = asyncio.create_task(boom())
    await asyncio.wait({failed})
    await cancel_and_wait(failed)  # its exception is retrieved, not raised


async def test_a_task_that_swallows_the_first_cancellation_is_cancelled_again() -> None:
    swallowed = 0

    async def stubborn() -> None:  # like a client library turning a cancellation into a handled timeout
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1
                asyncio.current_task().uncancel()  # type: ignore[union-attr]

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, recancel_s=0.05), timeout=30)
    assert task.cancelled() and swallowed == 1


async def test_the_callers_own_cancellation_propagates() -> None:
    release = asyncio.Event()

    async def deaf() -> None:  # ignores every cancellation until released
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]

    inner = asyncio.create_task(deaf())
    caller = asyncio.create_task(cancel_and_wait(inner, recancel_s=3600))
    await asyncio.sleep(0.01)
    assert not caller.done()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    release.set()
    inner.cancel()
    await asyncio.wait({inner})
    assert inner.done() and not inner.cancelled()


async def test_run_every_survives_a_failing_round_and_stops_on_cancel(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rounds: list[int] = []
    third = asyncio.Event()

    async def round_fn() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("first round breaks")
        if len(rounds) == 3:
            third.set()

    with caplog.at_level(logging.ERROR):
        task = asyncio.ensure_future(
            run_every(round_fn, 0.01, "test", logging.getLogger("t"), min_sleep_s=0.0)
        )
        await asyncio.wait_for(third.wait(), 5.0)
        await cancel_and_wait(task)
    assert rounds[:3] == [0, 1, 2] and task.cancelled()
    assert "test round failed" in caplog.text and "first round breaks" in caplog.text
