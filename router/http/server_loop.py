"""uvicorn's server with a quiet main loop: one wake-up a second instead of ten, and at once when asked to stop.

``uvicorn.Server.main_loop`` sleeps 0.1 s between checks of ``should_exit`` and refreshes the ``date`` header
every tenth check: ten event-loop wake-ups a second whatever the traffic (measured on an idle router: ~0.12 ms of
CPU each, about 1.2 ms per second of its idle cost). ``QuietServer`` waits one second between checks (the date
header's resolution, refreshed at each) or until ``should_exit`` is set: setting it (uvicorn's signal handler on
SIGINT / SIGTERM, or code on the loop) wakes the main loop at once, so a stop starts no later than before. The
checks are due on whole seconds of the loop's clock (``membership.ticks``), so they share their wake-ups with the
router's other periodic work (health probes, scrapes, the loop-lag probe).

Units: seconds.
"""

from __future__ import annotations

import asyncio

import uvicorn

from membership.ticks import next_due, sleep_until

#: seconds between two checks of the main loop when nothing asks it to stop (the date header is refreshed at each)
TICK_S = 1.0
#: ``on_tick`` refreshes the date header when its counter is a multiple of this (uvicorn: every tenth 0.1 s tick)
_TICKS_PER_REFRESH = 10


class QuietServer(uvicorn.Server):
    """``uvicorn.Server`` whose main loop wakes every ``TICK_S`` seconds, or at once when ``should_exit`` is set."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit_flag = False
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ticks = 0  # main-loop checks so far
        super().__init__(config)

    @property  # uvicorn's plain attribute, made a property that wakes the main loop
    def should_exit(self) -> bool:
        """The server is asked to stop (uvicorn's flag)."""
        return self._exit_flag

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit_flag = value
        loop, stop = self._loop, self._stop
        if value and loop is not None and stop is not None and not loop.is_closed():
            # thread- and signal-handler-safe: the signal handler runs between two bytecodes of the loop thread
            loop.call_soon_threadsafe(stop.set)

    async def main_loop(self) -> None:
        """uvicorn's main loop (date header, exit checks) at one check per ``TICK_S``, woken by ``should_exit``."""
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        due = self._loop.time()
        while not should_exit:
            # each check is a whole second: count it as uvicorn's ten ticks, so ``on_tick`` refreshes the date
            counter = (counter + _TICKS_PER_REFRESH) % 864000
            due = next_due(self._loop.time(), TICK_S, due)  # on whole seconds: shared with the other timers
            await sleep_until(due, self._stop)
            self.ticks += 1
            should_exit = await self.on_tick(counter)
