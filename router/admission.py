"""Router-wide admission: the global in-flight limit with a short, bounded FIFO queue in front of it.

* fewer than ``limit`` requests in flight: admitted at once;
* at the limit, fewer than ``max_queued`` waiting: the request waits (FIFO) for a slot for at most
  ``max_wait_s`` seconds; when none frees in time -> ``503`` (``queue_timeout``) with ``Retry-After``;
* at the limit with the queue full (``max_queued = 0``: no queue at all) -> ``429`` (``overloaded``) with
  ``Retry-After``.

So time spent in the router's queue is bounded by ``max_wait_s`` (it is the ``q`` the seeds' admission advice
caps), and the router never holds more than ``limit + max_queued`` requests. Runs on the event loop only.
Units: requests, seconds.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterable
from typing import Any


class Rejected(Exception):
    """A request is not admitted. ``status`` (429 / 503), ``code`` and ``reason`` (metric label) say why."""

    def __init__(self, status: int, code: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.reason = reason
        self.message = message


class Admission:
    """Counts requests in flight through the router and queues the excess briefly.

    Args:
        limit: requests allowed in flight at once (``max_inflight_total``).
        max_queued: requests allowed to wait for a slot (``max_queued_requests``; 0 = reject at once).
        max_wait_s: longest wait in the queue, seconds (``max_queue_wait_s``).
    """

    def __init__(self, limit: int, max_queued: int, max_wait_s: float) -> None:
        self.limit = limit
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self.inflight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.queued_total = 0
        self.queue_wait_s_total = 0.0

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self) -> float:
        """Take a slot, waiting in the queue when allowed; returns the time waited, seconds.

        Raises:
            Rejected: 429 when the queue is full, 503 when no slot freed within ``max_wait_s``.
        """
        if self.inflight < self.limit and not self.waiting:
            self.inflight += 1
            return 0.0
        if self.waiting >= self.max_queued:
            raise Rejected(429, "overloaded", "router_inflight_limit",
                           f"router has {self.limit} requests in flight (max_inflight_total) and "
                           f"{self.max_queued} waiting (max_queued_requests)")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.queued_total += 1
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.max_wait_s):
                await asyncio.shield(fut)
        except TimeoutError:
            if fut.done() and not fut.cancelled():  # a slot was handed over as the timer fired: keep it
                return self._waited(t0)
            fut.cancel()
            self._drop(fut)
            raise Rejected(503, "queue_timeout", "queue_timeout",
                           f"no capacity freed within {self.max_wait_s:g}s (max_queue_wait_s); "
                           f"{self.limit} requests in flight") from None
        except asyncio.CancelledError:  # the client went away while queued
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                fut.cancel()
                self._drop(fut)
            raise
        return self._waited(t0)

    def _waited(self, t0: float) -> float:
        waited = time.monotonic() - t0
        self.queue_wait_s_total += waited
        return waited

    def _drop(self, fut: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass

    def release(self) -> None:
        """Give a slot back: handed to the oldest waiter, if any, else freed."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes to the waiter (inflight unchanged)
                return
        self.inflight = max(0, self.inflight - 1)


def admission_gauges(adm: Admission) -> Iterable[Any]:
    """Gauge families of the router queue (collected at scrape time)."""
    from router.telemetry import gauge

    yield gauge("kvroute_queued_requests", "requests waiting in the router queue for an in-flight slot",
                float(adm.waiting))
    yield gauge("kvroute_queue_waited_requests", "requests that waited in the router queue (cumulative)",
                float(adm.queued_total))
    yield gauge("kvroute_queue_wait_seconds", "total time requests waited in the router queue (cumulative, s)",
                adm.queue_wait_s_total)
