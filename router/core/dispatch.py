"""The service side of the cache-first dispatch gate (``policies.dispatch``): futures, timers, replicas leaving.

``DispatchGate.wait`` is awaited by the proxy after a replica is chosen and before the request is sent to it;
``DispatchGate.done`` is called when that request's first byte arrives or it fails, which may release the next
waiting requests (deepest prefix cached on the replica first). Only streamed requests wait: the first chunk of a
stream is the engine's first token, while a non-streamed answer arrives whole, so its prefill's end is not seen
(those are sent at once and not counted). Every accepted request leaves the gate: released, sent by
``dispatch_max_wait_s``, or failed over when its replica stops being routable (``ReplicaGone``).

Runs on the event loop only. Units: tokens, blocks, seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from index.prefix_index import PrefixIndex
from policies.dispatch import DispatchQueues, DispatchSettings, IndexQuestions

log = logging.getLogger("kvroute.dispatch")

#: seconds between checks for requests past ``max_wait_s`` and queues of replicas that left
_TICK_S = 0.25


class ReplicaGone(Exception):
    """The replica a request waited for is no longer routable: route the request elsewhere."""


@dataclass(slots=True, eq=False)
class _Waiter:
    keys: Sequence[int]
    prompt_tokens: int
    fut: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class DispatchGate:
    """Per-replica gates of the router (see the module docstring).

    Args:
        settings: the gate's parameters (``dispatch_*`` options).
        index: the prefix index (a waiting request's cached depth is read from it when a replica frees).
        block_size: tokens per block.
        routable: ``f(replica index) -> bool``: False once the replica cannot take requests.
        clock: seconds (monotonic).
    """

    def __init__(
        self,
        settings: DispatchSettings,
        index: PrefixIndex,
        block_size: int,
        routable: Callable[[int], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.index = index
        self.block_size = block_size
        self.routable = routable
        self.clock = clock
        self.ask = IndexQuestions(index.match, block_size)
        self.queues: DispatchQueues[_Waiter] = DispatchQueues(settings, self.ask.cached_blocks)
        self.gone_total = 0
        self._ticker: asyncio.Task[None] | None = None

    # -- the proxy's calls -----------------------------------------------------------------------------
    async def wait(
        self, replica: int, keys: Sequence[int], prompt_tokens: int, uncached_tokens: int, stream: bool
    ) -> int | None:
        """Wait until ``replica`` may take this request; returns the tokens to give ``done`` afterwards
        (None: the request was not counted, e.g. not streamed or the gate is off).

        Raises:
            ReplicaGone: the replica stopped being routable while the request waited.
            asyncio.CancelledError: the caller was cancelled (the request leaves the queue).
        """
        if not stream or not self.settings.enabled:
            return None
        q = self.queues
        w = _Waiter(keys, prompt_tokens)
        if q.offer(replica, w, uncached_tokens, self.clock()):
            return max(0, uncached_tokens)
        self._ensure_ticker()
        try:
            return await w.fut
        except asyncio.CancelledError:
            if w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
                self.done(replica, w.fut.result())  # released as we were cancelled: give the slot back
            else:
                q.withdraw(replica, w, self.clock())
            raise

    def done(self, replica: int, tokens: int | None) -> None:
        """The request ``wait`` let through got its first byte, failed or was abandoned."""
        if tokens is None:
            return
        self.queues.started(replica, tokens)
        self._release(replica)

    # -- internals -------------------------------------------------------------------------------------
    def _release(self, replica: int) -> None:
        for w in self.queues.pop_ready(replica, self.clock(), self.ask.uncached_tokens):
            self._hand_over(replica, w.item, w.tokens)

    def _hand_over(self, replica: int, w: _Waiter, tokens: int) -> None:
        if (
            w.fut.done()
        ):  # its caller is gone (cancelled): give the counted tokens back, which may free the next
            self.done(replica, tokens)
            return
        w.fut.set_result(tokens)

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="kvroute-dispatch-gate")

    async def _tick(self) -> None:
        """While requests wait: send those past ``max_wait_s``, fail over those whose replica left."""
        while self.queues.waiting():
            await asyncio.sleep(_TICK_S)
            try:
                self.check(self.clock())
            except Exception:  # never let the safety net die
                log.exception("dispatch gate check failed")

    def check(self, now: float) -> None:
        """Fail over the requests of replicas no longer routable; send those waiting ``max_wait_s`` or more."""
        for r in [r for r in self.queues.replicas() if self.queues.waiting(r) and not self.routable(r)]:
            for w in self.queues.forget(r):
                self.gone_total += 1
                if not w.item.fut.done():
                    w.item.fut.set_exception(ReplicaGone(f"replica {r} stopped being routable"))
        for r, w in self.queues.expired(now, self.ask.uncached_tokens):
            log.warning(
                "dispatch gate: request sent after waiting max_wait_s",
                extra={"replica": r, "max_wait_s": self.settings.max_wait_s},
            )
            self._hand_over(r, w.item, w.tokens)

    async def aclose(self) -> None:
        """Stop the timer; requests still waiting are failed over (the service is stopping)."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._ticker
        for r in list(self.queues.replicas()):
            for w in self.queues.forget(r):
                if not w.item.fut.done():
                    w.item.fut.set_exception(ReplicaGone("the router is stopping"))
