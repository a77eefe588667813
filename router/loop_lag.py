"""Event-loop lag: how late the router's event loop runs what is due, measured, and the shedding decision on it.

A probe callback is scheduled every ``interval_s`` with ``loop.call_at``; when it runs, the difference between
now and the time it was due is the loop's scheduling delay (everything else that ran in between: request
handlers, KV-event intake, a blocked thread holding the GIL). The probe is a plain callback, not a task, so it
runs in the same loop iteration as the I/O that arrived while the loop was busy, before the handlers of that I/O.

``lag_s()`` is the largest delay measured within the last ``window_s``, or the probe's own overdue time when it
is late right now (a loop that is blocked has not run its probe yet). The router sheds new work while it is over
``max_lag_s`` (``router.guard``): under CPU overload the lag grows with the backlog, and answering cheap 503s
keeps the requests already admitted, the probes and the metrics served.

Prometheus: ``kvroute_event_loop_lag_seconds`` (histogram of every probe delay),
``kvroute_event_loop_lag_recent_seconds`` (gauge: ``lag_s()`` at scrape time). Units: seconds.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopLag:
    """Measures the event loop's scheduling delay every ``interval_s`` (start on the loop, stop at shutdown).

    Args:
        interval_s: probe period, seconds.
        window_s: how long a measured delay counts for ``lag_s()``, seconds.
        registry: where the histogram is registered (None: not exported).
    """

    def __init__(self, interval_s: float, window_s: float, registry: CollectorRegistry | None = None) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.histogram = Histogram(
            "kvroute_event_loop_lag_seconds",
            "delay of the event-loop lag probe past its due time (s)",
            buckets=_BUCKETS,
            registry=registry,
        )
        self._recent: collections.deque[tuple[float, float]] = collections.deque()  # (measured at, lag)
        self._due: float | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.samples = 0
        self.max_seen_s = 0.0
        #: set by ``note_resumed`` (a signal handler): the process was stopped; the delay covering it is not lag
        self._resumed = False

    def start(self) -> None:
        """Schedule the first probe on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._schedule(self._loop.time())

    def stop(self) -> None:
        """Cancel the probe."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._due = None

    def _schedule(self, now: float) -> None:
        assert self._loop is not None
        self._due = now + self.interval_s
        self._handle = self._loop.call_at(self._due, self._probe)

    def note_resumed(self) -> None:
        """The process was resumed after a stop (SIGCONT; called from the signal handler, so it only sets a flag):
        the probe's delay across the stop is not the loop's own work and is neither recorded nor shed on."""
        self._resumed = True

    def _probe(self) -> None:
        assert self._loop is not None and self._due is not None
        now = self._loop.time()
        if self._resumed:
            self._resumed = False
            self._recent.clear()
        else:
            self.record(now - self._due, now)
        self._schedule(now)

    def record(self, lag: float, now: float) -> None:
        """Record one measured delay ``lag`` (s) taken at loop time ``now``."""
        lag = max(0.0, lag)
        self.samples += 1
        self.max_seen_s = max(self.max_seen_s, lag)
        self.histogram.observe(lag)
        recent = self._recent  # lags decreasing from the oldest: recent[0] is the window's maximum
        while recent and recent[-1][1] <= lag:
            recent.pop()  # a smaller, older delay can never be the window's maximum again
        while recent and now - recent[0][0] > self.window_s:
            recent.popleft()
        recent.append((now, lag))

    def lag_s(self, now: float | None = None) -> float:
        """The loop's current lag: the largest delay measured within ``window_s``, or the probe's overdue time."""
        if now is None:
            if self._loop is None:
                return 0.0
            now = self._loop.time()
        recent = self._recent
        while recent and now - recent[0][0] > self.window_s:
            recent.popleft()
        measured = recent[0][1] if recent else 0.0
        overdue = now - self._due if self._due is not None and not self._resumed else 0.0
        return max(measured, overdue, 0.0)


def lag_gauges(lag: LoopLag) -> Iterable[Any]:
    """Gauge families of the loop lag (collected at scrape time)."""
    from router.telemetry import gauge

    yield gauge(
        "kvroute_event_loop_lag_recent_seconds",
        "the event loop's current lag: largest probe delay within "
        "event_loop_lag_window_s, or the probe's overdue time (s)",
        lag.lag_s(),
    )
    yield gauge(
        "kvroute_event_loop_lag_max_seconds", "largest event-loop probe delay since start (s)", lag.max_seen_s
    )
