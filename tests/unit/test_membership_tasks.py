"""``membership.tasks.cancel_and_wait``: stops a task even when the task loses a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from membership.tasks import cancel_and_wait


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
