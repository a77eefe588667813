"""Stopping the background asyncio tasks of the membership parts (probes, scrapes, Redis supervision, ...).

Units: seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from membership.ticks import sleep_to_next_due


async def cancel_and_wait(task: asyncio.Future[Any] | None, *, recancel_s: float = 1.0) -> None:
    """Cancel ``task`` and return once it has finished, whatever it raised (nothing when ``task`` is None).

    A task that loses the cancellation (a library call that turns it into a timeout it handles itself) is
    cancelled again every ``recancel_s`` seconds instead of being waited for forever. A cancellation of the
    caller itself propagates.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=recancel_s)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()  # retrieved: asyncio does not log "exception was never retrieved"


async def run_every(
    round_fn: Callable[[], Awaitable[Any]],
    interval_s: Callable[[], float] | float,
    what: str,
    logger: logging.Logger,
    min_sleep_s: float = 0.05,
) -> None:
    """Run ``round_fn`` forever: one round at once, then one at every due time of its period
    (``membership.ticks.next_due``: the whole multiples of ``interval_s`` on the event loop's clock, so that periodic
    tasks whose periods are multiples of one another wake the loop together; start to start, a round every
    ``interval_s``). A round that runs past its next due time is followed by the first due time at least
    ``min_sleep_s`` after it ends (missed rounds are skipped). A failing round is logged (``what`` round failed) and
    the loop goes on; only cancellation ends it. ``interval_s`` may be a callable, read after each round (a setting
    that can change)."""
    due = asyncio.get_running_loop().time()
    while True:
        try:
            await round_fn()
        except asyncio.CancelledError:
            raise
        except Exception:  # never let the loop die
            logger.exception("%s round failed", what)
        every = interval_s() if callable(interval_s) else interval_s
        due = await sleep_to_next_due(every, due, min_sleep_s)
