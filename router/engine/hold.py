"""One attempt's hold on a replica and the failure of an attempt before its first byte: the public attempt API
that the in-place attempts (``router.engine.proxy``), the prefill/decode legs (``router.pd``) and the endpoint picker
share.

Units: tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from membership.replicas import Replica
from router.core.dispatch import DispatchGate, ReplicaGone
from router.core.routing import Router


class AttemptFailed(Exception):
    """One attempt failed before the first byte. ``retry``: another replica may succeed; ``connection``: the
    connection to the replica failed (passive health signal); ``attempted``: False when the request never
    reached the replica (it left while the request waited at the dispatch gate): not counted as an attempt."""

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        retry: bool,
        status: int = 502,
        connection: bool = False,
        attempted: bool = True,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry = retry
        self.status = status
        self.connection = connection
        self.attempted = attempted


class Hold:
    """One attempt's hold on a replica, released exactly once on every path.

    Entering counts the request in flight on the replica (``Router.acquire``: requests and uncached prefill
    tokens) BEFORE anything is sent; ``admit`` waits for the dispatch gate's permit; ``first_byte`` gives the
    permit and the prefill tokens back (the prefill is over); ``release`` ends the in-flight count (and does
    ``first_byte`` first if it has not happened). Each step happens at most once however often it is called.

    Leaving the ``with`` block releases everything (failure before the first byte, retry, cancellation, client
    disconnect, a non-streamed answer read whole) unless the hold was handed over to a relayed stream
    (``hand_over``), which then calls ``release`` when the stream ends.

    Units: tokens.
    """

    __slots__ = ("router", "gate", "rep", "uncached", "copies", "_permit", "_prefilling", "_held", "_owned")

    def __init__(
        self, router: Router, gate: DispatchGate | None, rep: Replica, uncached: int, copies: int
    ) -> None:
        self.router = router
        self.gate = gate
        self.rep = rep
        #: prompt tokens the replica must prefill (not expected to be cached)
        self.uncached = uncached
        #: sequences requested (n / best_of), each counted as a request
        self.copies = copies
        self._permit: int | None = None  # what gate.wait returned (None: no permit counted)
        self._prefilling = False
        self._held = False
        self._owned = True

    def __enter__(self) -> Hold:
        self.router.acquire(self.rep, self.uncached, self.copies)
        self._prefilling = self._held = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owned:
            self.release()

    async def admit(self, keys: Sequence[int], prompt_tokens: int, stream: bool) -> None:
        """Wait for the dispatch gate (when there is one). Raises ``AttemptFailed`` (not an attempt) when the
        replica stopped being routable meanwhile."""
        if self.gate is None:
            return
        try:
            self._permit = await self.gate.wait(self.rep.index, keys, prompt_tokens, self.uncached, stream)
        except ReplicaGone as exc:
            raise AttemptFailed("replica_gone", str(exc), retry=True, attempted=False) from None

    def first_byte(self) -> None:
        """The prefill is over (first byte) or abandoned: the gate's permit and the prefill tokens go back."""
        if not self._prefilling:
            return
        self._prefilling = False
        if self.gate is not None:
            self.gate.done(self.rep.index, self._permit)
        self.router.prefill_done(self.rep, self.uncached)

    def release(self) -> None:
        """The request is over on the replica, whatever the outcome."""
        self.first_byte()
        if self._held:
            self._held = False
            self.router.release(self.rep, self.copies)

    def hand_over(self) -> Hold:
        """The caller no longer releases on leaving the ``with`` block: a relayed stream will. Returns self."""
        self._owned = False
        return self
