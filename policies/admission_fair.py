"""Pure admission math shared by the router and the simulator: per-tenant token buckets and a fair queue.

Nothing here does I/O or reads a clock: time arrives as an argument (seconds). The router
(``router/core/tenant_admission.py``, ``router/core/admission.py``) and the simulator (``sim/simulator.py``) call the
same functions, so a benchmark measures the code the service runs. The Redis script of
``membership/tenant_budget.py`` is the same bucket arithmetic, written in Lua.

* **Token bucket** (``BucketState``, ``take``): a tenant may spend ``rate`` tokens per second with bursts of up to
  ``burst`` tokens. A request costs ``prompt tokens + max output tokens`` (tokens). When the bucket holds fewer
  tokens than the cost, nothing is taken and the answer says how long until it would hold enough.
* **Fair queue** (``FairQueue``): waiting requests leave in order of priority (higher first), then of weighted
  fair share across tenants by virtual time (start-time fair queuing, tokens as the work unit): a tenant's
  request gets the finish tag ``max(V, tenant's last finish) + cost / weight`` and the smallest tag leaves first;
  ``V`` is the tag of the request that left last. One tenant flooding the queue therefore cannot push another
  tenant's request further back than its weighted share; equal tags leave in arrival order (FIFO for one
  tenant). Each priority has its own virtual time and its own last finish per tenant: a tenant's requests in
  one class never push back its (or anyone's) requests in another (with one clock, a high-priority request
  leaving first moved ``V`` past every tag of the class below, and the next arrival there queued behind all of
  them).

Units: tokens, seconds, tokens per second.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------------
# token bucket
# ---------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class BucketState:
    """One tenant's bucket: ``tokens`` available at time ``at`` (seconds)."""

    tokens: float
    at: float


@dataclass(frozen=True, slots=True)
class Take:
    """The outcome of ``take``.

    Attributes:
        admitted: True when the cost was taken from the bucket.
        tokens_left: tokens in the bucket afterwards.
        wait_s: when refused, seconds until the bucket holds the cost (``inf`` when the cost exceeds the burst or
            the rate is 0); 0 when admitted.
    """

    admitted: bool
    tokens_left: float
    wait_s: float


def refill(state: BucketState | None, now: float, rate: float, burst: float) -> BucketState:
    """The bucket at ``now``: ``state`` refilled at ``rate`` tokens/s, capped at ``burst`` (a new bucket is full)."""
    if state is None:
        return BucketState(burst, now)
    elapsed = max(0.0, now - state.at)
    return BucketState(min(burst, state.tokens + elapsed * rate), max(now, state.at))


def take(
    state: BucketState | None, now: float, rate: float, burst: float, cost: float
) -> tuple[BucketState, Take]:
    """Try to take ``cost`` tokens at ``now``; returns the new state and the outcome (nothing taken on refusal)."""
    cur = refill(state, now, rate, burst)
    if cur.tokens >= cost:
        cur.tokens -= cost
        return cur, Take(True, cur.tokens, 0.0)
    if cost > burst or rate <= 0:
        return cur, Take(False, cur.tokens, math.inf)
    return cur, Take(False, cur.tokens, (cost - cur.tokens) / rate)


# ---------------------------------------------------------------------------------------------------------
# fair queue
# ---------------------------------------------------------------------------------------------------------


@dataclass(order=True, slots=True)
class QueueEntry(Generic[T]):
    """A waiting item with its sort key: (-priority, finish tag, arrival sequence)."""

    neg_priority: int
    finish: float
    seq: int
    tenant: str = field(compare=False)
    item: T = field(compare=False)
    removed: bool = field(default=False, compare=False)

    @property
    def priority(self) -> int:
        """The item's priority (higher leaves first)."""
        return -self.neg_priority


class FairQueue(Generic[T]):
    """Priority first, then weighted fair share by virtual time (see the module docstring). Not thread-safe."""

    def __init__(self) -> None:
        self._heap: list[QueueEntry[T]] = []
        self._seq = itertools.count()
        #: (tenant, priority) -> finish tag of its last queued request
        self._last_finish: dict[tuple[str, int], float] = {}
        #: priority -> the tag of the request of that priority that left last
        self.virtual_time: dict[int, float] = {}
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, item: T, tenant: str, priority: int, cost: float, weight: float) -> QueueEntry[T]:
        """Queue ``item`` for ``tenant`` (``cost`` tokens, share ``weight`` > 0); returns its entry."""
        start = max(self.virtual_time.get(priority, 0.0), self._last_finish.get((tenant, priority), 0.0))
        finish = start + max(0.0, cost) / max(weight, 1e-9)
        self._last_finish[(tenant, priority)] = finish
        entry = QueueEntry(-priority, finish, next(self._seq), tenant, item)
        heapq.heappush(self._heap, entry)
        self._live += 1
        return entry

    def pop(self) -> QueueEntry[T] | None:
        """The next entry to leave (None when empty); advances its priority's virtual time to its tag."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            if entry.removed:
                continue
            self._live -= 1
            prio = entry.priority
            self.virtual_time[prio] = max(self.virtual_time.get(prio, 0.0), entry.finish)
            self._forget_idle()
            return entry
        return None

    def remove(self, entry: QueueEntry[T]) -> bool:
        """Take ``entry`` out (it gave up waiting); False when it already left."""
        if entry.removed:
            return False
        entry.removed = True
        self._live -= 1
        return True

    def lowest(self) -> QueueEntry[T] | None:
        """The entry that would leave last (lowest priority, then largest tag), or None."""
        live = [e for e in self._heap if not e.removed]
        return max(live) if live else None

    def _forget_idle(self) -> None:
        """Drop finish tags behind the virtual time (those tenants start from V again): bounded memory."""
        if len(self._last_finish) > 4096:
            v = self.virtual_time
            self._last_finish = {k: f for k, f in self._last_finish.items() if f > v.get(k[1], 0.0)}
