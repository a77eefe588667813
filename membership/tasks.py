"""Stopping the background asyncio tasks of the membership parts (probes, scrapes, Redis supervision, ...).

Units: seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any


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
    clock: Callable[[], float] = time.monotonic,
    min_sleep_s: float = 0.05,
) -> None:
    """Run ``round_fn`` forever, one round every ``interval_s`` seconds (start to start, at least ``min_sleep_s``
    between rounds). A failing round is logged (``what`` round failed) and the loop goes on; only cancellation
    ends it. ``interval_s`` may be a callable, read before each sleep (a setting that can change)."""
    while True:
        started = clock()
        try:
            await round_fn()
        except asyncio.CancelledError:
            raise
        except Exception:  # never let the loop die
            logger.exception("%s round failed", what)
        every = interval_s() if callable(interval_s) else interval_s
        await asyncio.sleep(max(min_sleep_s, every - (clock() - started)))
