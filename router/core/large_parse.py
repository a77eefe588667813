"""One large JSON scan at a time per event loop: the transient memory of huge bodies stays that of one.

simdjson reads a body into a padded copy, a structural index and a tape: about seven times the body's size while
it runs (a 16 MiB chat body of ~620k tiny messages: +122 MB of router RSS at its peak, measured with ``VmHWM``,
for the ~50-250 ms the scan takes, all freed after). Request bodies (``router.serve.intake``) and prefill-leg
answers (``router.pd.leg``) of ``LARGE_PARSE_BYTES`` or more are scanned in worker threads; without a bound,
hostile clients sending several at once multiply that peak. Scans of that size wait for each other here
(smaller ones never wait): the router's peak is one large scan, whatever the concurrency. Units: bytes.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

#: bodies / answers at least this large take the process's one large-scan slot (one is scanned at a time), bytes
LARGE_PARSE_BYTES = 1 << 20

_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def large_parse_slot() -> asyncio.Semaphore:
    """The running loop's one slot for large scans (``async with large_parse_slot(): ...``); made on first use."""
    loop = asyncio.get_running_loop()
    slot = _slots.get(loop)
    if slot is None:
        slot = _slots[loop] = asyncio.Semaphore(1)
    return slot


async def scan_in_thread(nbytes: int, scan: Callable[..., _T], *args: object) -> _T:
    """``scan(*args)`` in a worker thread; when its input is ``LARGE_PARSE_BYTES`` (``nbytes``) or more, inside the
    loop's one large-scan slot."""
    if nbytes < LARGE_PARSE_BYTES:
        return await asyncio.to_thread(scan, *args)
    async with large_parse_slot():
        return await asyncio.to_thread(scan, *args)
