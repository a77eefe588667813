"""Router-wide admission: the global in-flight limit with a short, bounded FIFO queue in front of it.

* fewer than ``limit`` requests in flight: admitted at once;
* at the limit, fewer than ``max_queued`` waiting: the request waits (FIFO) for a slot for at most
  ``max_wait_s`` seconds; when none frees in time -> ``503`` (``queue_timeout``) with ``Retry-After``;
* at the limit with the queue full (``max_queued = 0``: no queue at all) -> ``429`` (``overloaded``) with
  ``Retry-After``.

So time spent in the router's queue is bounded by ``max_wait_s`` (it is the ``q`` the seeds' admission advice
caps), and the router never holds more than ``limit + max_queued`` requests. Runs on the event loop only.

The queue is ordered (``policies.admission_fair.FairQueue``) by priority first, then by weighted fair share
across tenants (virtual time by tokens); one tenant at equal priority is served FIFO. A full queue takes a
higher-priority arrival by pushing out its lowest-priority waiter (503 ``preempted`` + ``Retry-After``); only
waiters are ever pushed out: a request that holds a slot (dispatched, maybe streaming) is never preempted.
Units: requests, seconds, tokens.
"""

from __future__ import annotations

import asyncio
import time

from policies.admission_fair import FairQueue, QueueEntry
from router.errors import KvrouteError


class Rejected(KvrouteError):
    """A request is not admitted. ``status`` (429 / 503), ``code`` and ``reason`` (metric label) say why; answered
    with ``Retry-After`` and the reason told to the client (``wire_reason``)."""

    retry = True

    def __init__(
        self,
        status: int,
        code: str,
        reason: str,
        message: str,
        *,
        wire_reason: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        # wire_reason: told to the client (JSON ``error.reason`` and the ``x-kvroute-rejected-reason`` header):
        # ``quota``, ``queue_full``, ``queue_timeout``, ``preempted``, ``slo_unattainable``; retry_after_s: seconds
        # the client should wait (None: the configured ``retry_after_s``)
        super().__init__(
            message,
            status=status,
            code=code,
            wire_reason=wire_reason or reason,
            retry_after_s=retry_after_s,
            counted_as=reason,
        )
        #: the metric label (``kvroute_rejected_total{reason}``)
        self.reason = reason
        self.wire_reason: str = wire_reason or reason


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
        self._queue: FairQueue[asyncio.Future[None]] = FairQueue()
        self.queued_total = 0
        self.queue_wait_s_total = 0.0
        self.preempted_total = 0

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return len(self._queue)

    async def acquire(
        self, tenant: str = "", priority: int = 0, weight: float = 1.0, cost: float = 0.0
    ) -> float:
        """Take a slot, waiting in the queue when allowed; returns the time waited, seconds.

        ``tenant``, ``priority`` (higher first), ``weight`` (fair share) and ``cost`` (tokens) order the queue.

        Raises:
            Rejected: 429 when the queue is full (of requests of this priority or higher), 503 when no slot freed
            within ``max_wait_s`` or a higher-priority arrival pushed this waiter out.
        """
        if self.inflight < self.limit and not self.waiting:
            self.inflight += 1
            return 0.0
        if self.waiting >= self.max_queued and not self._preempt_lower(priority):
            raise Rejected(
                429,
                "overloaded",
                "router_inflight_limit",
                f"router has {self.limit} requests in flight (max_inflight_total) and "
                f"{self.max_queued} waiting (max_queued_requests)",
                wire_reason="queue_full",
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = self._queue.push(fut, tenant, priority, cost, weight)
        self.queued_total += 1
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.max_wait_s):
                await asyncio.shield(fut)
        except TimeoutError:
            if (
                fut.done() and not fut.cancelled() and fut.exception() is None
            ):  # handed a slot as the timer fired
                return self._waited(t0)
            self._drop(entry)
            raise Rejected(
                503,
                "queue_timeout",
                "queue_timeout",
                f"no capacity freed within {self.max_wait_s:g}s (max_queue_wait_s); "
                f"{self.limit} requests in flight",
            ) from None
        except asyncio.CancelledError:  # the client went away while queued
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()
            else:
                self._drop(entry)
            raise
        return self._waited(t0)

    def _preempt_lower(self, priority: int) -> bool:
        """Push the lowest-priority waiter out when it ranks below ``priority`` (True: a place freed)."""
        low = self._queue.lowest()
        if low is None or low.priority >= priority:
            return False
        self._queue.remove(low)
        if not low.item.done():
            low.item.set_exception(
                Rejected(
                    503,
                    "preempted",
                    "preempted",
                    "pushed out of the router queue by a higher-priority request before it was dispatched",
                    wire_reason="preempted",
                )
            )
        self.preempted_total += 1
        return True

    def _waited(self, t0: float) -> float:
        waited = time.monotonic() - t0
        self.queue_wait_s_total += waited
        return waited

    def _drop(self, entry: QueueEntry[asyncio.Future[None]]) -> None:
        self._queue.remove(entry)
        if not entry.item.done():
            entry.item.cancel()

    def release(self) -> None:
        """Give a slot back: handed to the first waiter in queue order, if any, else freed."""
        while (entry := self._queue.pop()) is not None:
            if not entry.item.done():
                entry.item.set_result(None)  # the slot passes to the waiter (inflight unchanged)
                return
        self.inflight = max(0, self.inflight - 1)
