"""Stopping the background asyncio tasks of the membership parts (probes, scrapes, Redis supervision, ...).

Units: seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
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
