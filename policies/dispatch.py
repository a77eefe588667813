"""Cache-first dispatch: when a routed request is sent to its replica, and in which order.

A policy picks the replica when a request arrives; an engine then runs its queue first come, first served, and
its LRU cache may evict a waiting request's cached prefix before the request runs (the prefill of the requests
ahead of it writes new blocks). Measured on the Mooncake conversation trace, that queue-time eviction and the
moves it provokes are where ``ttft`` lost hit rate against load-blind routers (docs/results.md).

The dispatch gate keeps the engine's queue short and holds the rest in the router, per replica:

* a replica *accepts* another request while the uncached prompt tokens the router sent it and whose first token
  has not come back are at most ``limit_tokens`` (about one engine step's prefill budget; 0 = no gate);
* when it accepts, it gets the queued request with the **deepest prefix cached on it** (at least
  ``min_blocks`` blocks, deepest first, then oldest) — those are the ones the cache can still save — unless the
  oldest request has waited ``patience_s`` seconds or more, which then goes first (no starvation);
* a request never waits more than ``max_wait_s`` seconds: then it is sent whatever the gate says.

Pure: no I/O, no clock (time comes in as ``now``, seconds), no asyncio. The service (router/core/dispatch.py) wraps it
with futures; the simulator calls it directly, so both dispatch in the same order. Units: tokens, blocks, seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from index.prefix_index import ReplicaMatch
from policies.hits import hit_from_match

T = TypeVar("T")


@dataclass(slots=True)
class DispatchSettings:
    """The gate's parameters.

    Attributes:
        limit_tokens: uncached prompt tokens a replica may have sent and not started (first token pending)
            before further requests wait in the router, tokens; 0 (the default) turns the gate off: every
            request is sent at once, in arrival order. 8192 (one vLLM step's prefill budget) is the value
            measured in docs/results.md.
        patience_s: once the oldest queued request has waited this long, it goes next, seconds.
        min_blocks: a request jumps the queue only with at least this many prompt blocks cached on the replica.
        max_wait_s: a request waiting this long is sent regardless of the gate, seconds (a safety net: it bounds
            the wait even if first tokens stop being reported).
    """

    limit_tokens: int = 0
    patience_s: float = 5.0
    min_blocks: int = 2
    max_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.limit_tokens < 0:
            raise ValueError("limit_tokens must be >= 0")
        if self.patience_s < 0 or self.max_wait_s < 0:
            raise ValueError("patience_s and max_wait_s must be >= 0")
        if self.min_blocks < 1:
            raise ValueError("min_blocks must be >= 1")

    @property
    def enabled(self) -> bool:
        """True when requests may wait in the router (``limit_tokens`` > 0)."""
        return self.limit_tokens > 0


@dataclass(slots=True)
class Queued(Generic[T]):
    """One request waiting for its replica.

    Attributes:
        item: the caller's handle (a future in the service, a request record in the simulator).
        tokens: its uncached prompt tokens as estimated when routed, tokens (what it adds to ``sent`` once sent).
        enqueued_s: when it started waiting, seconds (caller's clock).
    """

    item: T
    tokens: int
    enqueued_s: float


@dataclass(slots=True)
class ReplicaQueue(Generic[T]):
    """One replica's gate: requests waiting (oldest first) and the tokens sent whose first token is pending."""

    waiting: list[Queued[T]] = field(default_factory=list)
    sent_tokens: int = 0
    sent_requests: int = 0


class DispatchQueues(Generic[T]):
    """The per-replica gates of one router (or one simulated fleet).

    Call ``offer`` when a request is routed: it is either sent at once (True) or queued. Call ``started`` when a
    sent request's first token arrives, it fails, or it is abandoned; then ``pop_ready`` for the requests that
    may go now. ``expired`` returns the queued requests past ``max_wait_s``. ``cached_blocks(item)`` gives a
    queued request's prompt blocks cached on the replica *now* (the caller asks its index), blocks.
    """

    def __init__(self, settings: DispatchSettings, cached_blocks: Callable[[int, T], int]) -> None:
        self.settings = settings
        self._cached_blocks = cached_blocks
        self._queues: dict[int, ReplicaQueue[T]] = {}
        #: requests that waited, requests sent ahead of older ones, and requests sent by ``max_wait_s``
        self.queued_total = 0
        self.reordered_total = 0
        self.expired_total = 0
        self.wait_s_total = 0.0

    def queue(self, replica: int) -> ReplicaQueue[T]:
        """The gate of ``replica`` (created empty on first use)."""
        q = self._queues.get(replica)
        if q is None:
            q = self._queues[replica] = ReplicaQueue()
        return q

    def _accepts(self, q: ReplicaQueue[T]) -> bool:
        return not self.settings.enabled or q.sent_tokens <= self.settings.limit_tokens

    def offer(self, replica: int, item: T, tokens: int, now: float) -> bool:
        """A request routed to ``replica`` with ``tokens`` uncached prompt tokens: True = send it now (counted
        as sent), False = it waits (``pop_ready`` / ``expired`` hand it out later)."""
        q = self.queue(replica)
        tokens = max(0, tokens)
        if not q.waiting and self._accepts(q):
            q.sent_tokens += tokens
            q.sent_requests += 1
            return True
        q.waiting.append(Queued(item, tokens, now))
        self.queued_total += 1
        return False

    def started(self, replica: int, tokens: int) -> None:
        """A sent request's first token arrived (or it failed or was abandoned): its tokens stop counting."""
        q = self.queue(replica)
        q.sent_tokens = max(0, q.sent_tokens - max(0, tokens))
        q.sent_requests = max(0, q.sent_requests - 1)

    def _pick(self, q: ReplicaQueue[T], replica: int, now: float) -> int:
        waiting = q.waiting
        s = self.settings
        if len(waiting) == 1 or now - waiting[0].enqueued_s >= s.patience_s:
            return 0
        best, pick = s.min_blocks - 1, 0
        for j, w in enumerate(waiting):
            b = self._cached_blocks(replica, w.item)
            if b > best:
                best, pick = b, j
        return pick

    def pop_ready(
        self, replica: int, now: float, tokens_now: Callable[[int, T], int] | None = None
    ) -> list[Queued[T]]:
        """The queued requests ``replica`` accepts now, in the order to send them (each counted as sent).

        ``tokens_now(replica, item)``: its uncached prompt tokens now (the cache may have changed while it
        waited), tokens; stored in the entry's ``tokens``, which is what ``started`` must be given later."""
        q = self._queues.get(replica)
        out: list[Queued[T]] = []
        if q is None:
            return out
        while q.waiting and self._accepts(q):
            j = self._pick(q, replica, now)
            if j:
                self.reordered_total += 1
            out.append(self._send(q, q.waiting.pop(j), replica, now, tokens_now))
        return out

    def _send(
        self,
        q: ReplicaQueue[T],
        w: Queued[T],
        replica: int,
        now: float,
        tokens_now: Callable[[int, T], int] | None,
    ) -> Queued[T]:
        """Count a request leaving the queue as sent (its tokens taken again when ``tokens_now`` is given)."""
        if tokens_now is not None:
            w.tokens = max(0, tokens_now(replica, w.item))
        q.sent_tokens += w.tokens
        q.sent_requests += 1
        self.wait_s_total += max(0.0, now - w.enqueued_s)
        return w

    def expired(
        self, now: float, tokens_now: Callable[[int, T], int] | None = None
    ) -> list[tuple[int, Queued[T]]]:
        """Queued requests that have waited ``max_wait_s`` or more, as (replica, entry), removed from their
        queues and counted as sent: the caller sends them now (``tokens_now`` as in ``pop_ready``)."""
        out: list[tuple[int, Queued[T]]] = []
        limit = self.settings.max_wait_s
        for r, q in self._queues.items():
            while q.waiting and now - q.waiting[0].enqueued_s >= limit:
                self.expired_total += 1
                out.append((r, self._send(q, q.waiting.pop(0), r, now, tokens_now)))
        return out

    def withdraw(self, replica: int, item: T, now: float) -> bool:
        """Remove a queued request (its client left, or its replica went away); False when it is not queued."""
        q = self._queues.get(replica)
        if q is None:
            return False
        for j, w in enumerate(q.waiting):
            if w.item is item:
                del q.waiting[j]
                self.wait_s_total += max(0.0, now - w.enqueued_s)
                return True
        return False

    def waiting(self, replica: int | None = None) -> int:
        """Requests waiting for ``replica`` (or for any replica when None)."""
        if replica is not None:
            q = self._queues.get(replica)
            return len(q.waiting) if q else 0
        return sum(len(q.waiting) for q in self._queues.values())

    def replicas(self) -> list[int]:
        """Replicas that have a gate (queued or sent requests now or before)."""
        return list(self._queues)

    def forget(self, replica: int) -> list[Queued[T]]:
        """Drop ``replica``'s gate (it left the fleet); returns its queued requests for the caller to re-route."""
        q = self._queues.pop(replica, None)
        return list(q.waiting) if q else []


class QueuedPrompt(Protocol):
    """What the gate needs of a waiting request to ask the index about it."""

    @property
    def keys(self) -> Sequence[int]:
        """The prompt's block keys."""
        ...

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length, tokens."""
        ...


class IndexQuestions:
    """The gate's two questions to the prefix index about a waiting prompt on one replica, answered now.

    Args:
        match: ``PrefixIndex.match`` (keys, replicas -> {replica: ReplicaMatch}); called, never stored from.
        block_size: tokens per block.
    """

    def __init__(
        self, match: Callable[[Sequence[int], Set[int]], Mapping[int, ReplicaMatch]], block_size: int
    ) -> None:
        self._match = match
        self.block_size = block_size

    def _on(self, replica: int, item: QueuedPrompt) -> ReplicaMatch | None:
        return self._match(item.keys, {replica}).get(replica) if len(item.keys) else None

    def cached_blocks(self, replica: int, item: QueuedPrompt) -> int:
        """Leading prompt blocks ``replica`` holds now (the gate's order), blocks."""
        m = self._on(replica, item)
        return m.blocks if m is not None else 0

    def uncached_tokens(self, replica: int, item: QueuedPrompt) -> int:
        """Prompt tokens ``replica`` would have to compute now (what the gate counts once sent), tokens."""
        n = item.prompt_tokens
        return max(0, n - hit_from_match(self._on(replica, item), n, self.block_size).total)
