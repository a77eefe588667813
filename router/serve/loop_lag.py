"""Event-loop lag: how late the router's event loop runs what is due, and how much of that its own work explains.

A probe callback is scheduled every ``interval_s`` with ``loop.call_at``; when it runs, the difference between
now and the time it was due is the loop's scheduling delay (everything else that ran in between: request
handlers, KV-event intake, a blocked thread holding the GIL, or no CPU at all: the process starved by other
processes, throttled by its CPU quota, or stopped). The probe is a plain callback, not a task, so it runs in the
same loop iteration as the I/O that arrived while the loop was busy, before the handlers of that I/O.

**Own lag.** Each probe also reads the process's CPU time (all threads) and the loop thread's run-queue wait (time
it was runnable but had no CPU: ``/proc/thread-self/schedstat``; 0 where the kernel does not report it). The part
of a delay the router's own work explains is ``min(delay - run-queue wait, CPU time used)`` over the probe's
period, at least 0: the time waiting for a CPU is someone else's, and the process cannot have worked longer than
the CPU time it used (a stopped or throttled process uses none). A loop late by 1 s while it waited 0.8 s for a CPU
has an own lag of 0.2 s. ``router.serve.guard.Shedder`` sheds on own lag only.

``lag_s()`` is the largest delay measured within the last ``window_s``, or the probe's own overdue time when it
is late right now (a loop that is blocked has not run its probe yet).

**Shared wake-ups.** The probe is due at the whole multiples of its period on the loop's clock
(``membership.ticks``), as are the scrapes and the health probes: their due times coincide with probes, and the
loop wakes once for all of them. **While the router is idle** (no request work: nothing in progress, queued or
waiting at the gate, ``work``) for a whole ``idle_interval_s`` and its probes are on time (late by at most one
period), the probe runs every ``idle_interval_s`` instead (the router passes the shorter of the scrape and
health-probe periods): on due times the scrapes or health probes wake the loop for anyway, so an idle router's loop
does not wake for the probe alone (10 times a second at the default 0.1 s). A new request at the gate (``hurry``)
or a late probe puts it back on its own period at once. What a reading means is unchanged (how late a due probe
ran); while idle there are fewer of them, so a stall of the idle loop shorter than ``idle_interval_s`` can go
unseen, and the overdue time counts from the idle due time. Under requests nothing changes: the probe keeps its
period and the guard sheds on it as before.

Prometheus: ``kvroute_event_loop_lag_seconds`` (histogram of every probe delay),
``kvroute_event_loop_own_lag_seconds`` (histogram of their own parts), ``kvroute_event_loop_lag_recent_seconds``
(gauge: ``lag_s()`` at scrape time), ``kvroute_event_loop_lag_max_seconds`` and
``kvroute_event_loop_own_lag_max_seconds`` (gauges: largest since start). Units: seconds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from membership.ticks import next_due
from router.telemetry import loop_lag_histograms

#: the loop thread's scheduler statistics: "<on-CPU ns> <run-queue wait ns> <timeslices>"
_SCHEDSTAT = "/proc/thread-self/schedstat"


@dataclass(frozen=True, slots=True)
class Probe:
    """One sample of the loop (units: seconds; ``at`` is loop time).

    ``lag``: how late the probe ran (for a sample taken between probes: how overdue the next probe is);
    ``own_lag``: the part of ``lag`` the router's own work explains (module docstring); ``cpu_s``: the process's
    CPU time so far, all threads; ``wait_s``: the loop thread's time so far runnable but waiting for a CPU (0 where
    unknown).
    """

    at: float
    lag: float
    own_lag: float
    cpu_s: float
    wait_s: float


def own_lag_s(lag: float, prev: Probe | None, cpu_s: float, wait_s: float) -> float:
    """The part of a delay ``lag`` the process's own work explains, given the sample of the previous probe and
    the CPU time and run-queue wait now (s; module docstring). Without a previous sample, all of it."""
    if prev is None:
        return lag
    return max(0.0, min(lag - (wait_s - prev.wait_s), cpu_s - prev.cpu_s, lag))


class RunQueueClock:
    """The calling thread's cumulative run-queue wait (s), read from ``/proc/thread-self/schedstat``.

    Open it on the thread to be measured (the file names the thread that opened it); ``wait_s()`` re-reads the
    open file. Where the file is missing (no ``CONFIG_SCHED_INFO``, not Linux) every reading is 0: the wait is then
    counted as idle time, never as work.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        with contextlib.suppress(OSError):
            self._fd = os.open(_SCHEDSTAT, os.O_RDONLY)

    def wait_s(self) -> float:
        """Time this thread spent runnable without a CPU since it started, s."""
        if self._fd is None:
            return 0.0
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def close(self) -> None:
        """Close the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LoopLag:
    """Measures the event loop's scheduling delay every ``interval_s`` (start on the loop, stop at shutdown).

    Args:
        interval_s: probe period, seconds.
        window_s: how long a measured delay counts for ``lag_s()``, seconds.
        registry: where the histogram is registered (None: not exported).
        idle_interval_s: probe period while the router is idle (module docstring), seconds (None, or not longer
            than ``interval_s``: always ``interval_s``).
    """

    def __init__(
        self,
        interval_s: float,
        window_s: float,
        registry: CollectorRegistry | None = None,
        idle_interval_s: float | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.idle_interval_s = idle_interval_s if idle_interval_s and idle_interval_s > interval_s else None
        #: the router's request work now (requests in progress, queued or waiting); None: never idle
        self.work: Callable[[], int] | None = None
        #: the pending probe is on the idle period
        self.relaxed = False
        self._ran_due: float | None = None  # the due time of the last probe that ran
        self._busy_at: float | None = None  # loop time request work was last seen (a probe, ``hurry``)
        self.histogram, self.own_histogram = loop_lag_histograms(registry)
        self._recent: collections.deque[tuple[float, float]] = collections.deque()  # (measured at, lag)
        self._due: float | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clock: RunQueueClock | None = None
        self.samples = 0
        self.max_seen_s = 0.0
        #: set by ``note_resumed`` (a signal handler): the process was stopped; the delay covering it is not lag
        self._resumed = False
        self.own_max_seen_s = 0.0
        self.last: Probe | None = None  # the last probe's sample
        #: called with every probe's sample, on the loop
        self.listeners: list[Callable[[Probe], None]] = []

    def start(self) -> None:
        """Schedule the first probe on the running loop (and open the loop thread's scheduler statistics)."""
        self._loop = asyncio.get_running_loop()
        self._clock = RunQueueClock()
        self._schedule(self._loop.time(), 0.0)

    def stop(self) -> None:
        """Cancel the probe."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._due = self._ran_due = self._busy_at = None
        self.relaxed = False
        self.last = None
        if self._clock is not None:
            self._clock.close()
            self._clock = None

    def _measure(self, lag: float) -> Probe:
        now = self.now()
        wait = self._clock.wait_s() if self._clock is not None else 0.0
        cpu = time.process_time()
        return Probe(now, lag, own_lag_s(lag, self.last, cpu, wait), cpu, wait)

    def _idle(self, now: float, lag: float) -> bool:
        """The next probe may wait for the idle period: one is set, the last probe (``lag``, s) was on time and the
        router has had no request work for an idle period (its requests came and went in less: e.g. a trickle of
        short ones while it is starved of CPU, which the probe must keep measuring at its own period)."""
        idle_s = self.idle_interval_s
        if idle_s is None or lag > self.interval_s or self.work is None:
            return False
        if self.work() > 0:
            self._busy_at = now
            return False
        return self._busy_at is None or now - self._busy_at >= idle_s

    def _schedule(self, now: float, lag: float) -> None:
        """Schedule the next probe at the next due time of its period (the idle one when idle), after ``now``."""
        assert self._loop is not None
        self.relaxed = self._idle(now, lag)
        period = (
            self.idle_interval_s if self.relaxed and self.idle_interval_s is not None else self.interval_s
        )
        self._due = next_due(now, period, self._ran_due)
        self._handle = self._loop.call_at(self._due, self._probe)

    @property
    def due(self) -> float | None:
        """When the pending probe is due, loop time, s (None when stopped)."""
        return self._due

    def hurry(self) -> None:
        """Back to the probe's own period at once (a request arrives while the probe waits for the idle period):
        the pending probe moves to the next due time of ``interval_s``."""
        if self._loop is None:
            return
        now = self._busy_at = self._loop.time()
        if not self.relaxed or self._handle is None or self._due is None:
            return
        self.relaxed = False
        due = next_due(now, self.interval_s, self._ran_due)
        if due < self._due:
            self._handle.cancel()
            self._due = due
            self._handle = self._loop.call_at(due, self._probe)

    def note_resumed(self) -> None:
        """The process was resumed after a stop (SIGCONT; called from the signal handler, so it only sets a flag):
        the probe's delay across the stop is not the loop's own work and is neither recorded nor shed on."""
        self._resumed = True

    def _probe(self) -> None:
        assert self._loop is not None and self._due is not None
        now = self._loop.time()
        self._ran_due = self._due
        if self._resumed:  # the process was stopped (note_resumed): the delay covering the stop is not lag
            self._resumed = False
            self._recent.clear()
            lag = 0.0
        else:
            lag = max(0.0, now - self._due)
            self.record(lag, now)
        probe = self._measure(lag)
        self.last = probe
        self.own_max_seen_s = max(self.own_max_seen_s, probe.own_lag)
        self.own_histogram.observe(probe.own_lag)
        self._schedule(now, lag)
        for listener in self.listeners:
            listener(probe)

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

    def now(self) -> float:
        """The loop's time (0 before ``start``), s."""
        return self._loop.time() if self._loop is not None else 0.0

    def overdue_s(self) -> float:
        """How late the next probe is right now (0 when it is not due yet or the probe is stopped), s."""
        if self._loop is None or self._due is None:
            return 0.0
        return max(0.0, self._loop.time() - self._due)

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
