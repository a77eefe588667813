"""Serving a request in place: the attempts over a decision's ranking, retried before the first byte, on the public
attempt API (``router.engine.hold``: the hold; ``router.engine.attempt``: open / payload / commit; ``router.engine
.relay``: the relayed stream; ``router.engine.feedback``: usage and TTFT).

One attempt = one replica. For each attempt, in order:

1. the replica is counted as in flight (``Router.acquire``: requests + uncached prefill tokens) BEFORE the
   request is sent, and predicted index entries are recorded when the replica has no healthy KV events;
2. the request is sent and the proxy waits for the response headers AND the first body chunk
   (``first_byte_timeout_s``); nothing has reached the client yet, so
3. a connection error, a dropped connection or a 5xx status before that first chunk is retried on the next
   replica of the decision's ranking, the failed ones excluded (at most ``1 + max_retries`` attempts; when the
   ranking is exhausted the router decides again without the failed replicas);
4. once the first chunk arrives the answer is committed (headers ``x-kvroute-replica``: the replica that
   served it, ``x-kvroute-predicted-cached-tokens``: the prompt tokens the router expected it to reuse):
   engine 4xx are passed through unchanged; streams are
   relayed chunk by chunk (an idle gap over ``idle_timeout_s``, the total deadline or an engine failure ends
   the stream with an SSE ``error`` event); the accounting is released when the response ends, whatever the
   outcome.

A client that disconnects cancels the upstream request (the engine sees the connection close and aborts).

What comes back from an engine is bounded and checked: response headers (``engine_max_header_bytes``,
``engine_max_headers``: the engine client fails the attempt), a non-streamed body (``engine_max_body_bytes``:
502 ``upstream_body_too_large``; ``engine_body_idle_timeout_s`` of silence: 504 ``upstream_body_stalled``), and
event streams, which are validated event by event (``data:`` must carry a JSON object or ``[DONE]``; one event at
most ``engine_max_body_bytes``; the stream must end with ``data: [DONE]``): garbage before the first byte is a
502 ``upstream_bad_stream``, later an SSE ``error`` event (which the idempotency guard never stores as a complete
answer).

Usage feedback: for streams the router asks the engine for usage (``stream_options.include_usage``, unless
``engine_stream_usage`` is off) and removes the usage-only chunk and ``usage`` fields from what the client
receives when the client did not ask for them; an engine answer without ``usage.prompt_tokens_details`` (vLLM
without ``--enable-prompt-tokens-details``) is counted in ``kvroute_engine_usage_missing_total`` and logged once
per replica.

Errors are OpenAI-style JSON: ``{"error": {"message", "type", "code", "param"}}``.

Units: seconds, bytes, tokens.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.responses import Response

from membership.replicas import Replica, ReplicaState, ReplicaTable
from router.core.dispatch import DispatchGate
from router.core.regions import hop_headers
from router.core.routing import Routed, Router, RoutingError, candidate_indices
from router.engine.attempt import OPENAI, EngineEdge, Wire
from router.engine.config import ProxyConfig
from router.engine.gaps import FRAMEWORK_NOT_ALLOWED, FRAMEWORK_NOT_FOUND, EndpointGaps
from router.engine.hold import AttemptFailed, Hold
from router.errors import error_response
from router.telemetry import Telemetry, current_trace_id
from router.tokens.token_ids import IdsPrompt
from router.tracing import attempt_failed, first_byte

log = logging.getLogger("kvroute.proxy")


#: bound on the attempt loop's turns (attempts, skipped replicas and re-decisions together)
_MAX_SPINS = 64


class AttemptRun:
    """The state of one request's attempts: the ranking (grown by re-decisions), the predicted cached tokens
    per replica index, the replicas tried, the errors so far, counters."""

    __slots__ = (
        "routed",
        "deadline",
        "headers",
        "ranking",
        "cached",
        "tried",
        "errors",
        "last",
        "attempts",
        "spins",
    )

    def __init__(self, routed: Routed, *, deadline: float, headers: dict[str, str]) -> None:
        self.routed = routed
        #: monotonic seconds at which the whole request times out (total_timeout_s)
        self.deadline = deadline
        #: headers sent to the engine
        self.headers = headers
        self.ranking = list(routed.decision.ranking)
        #: replica index -> prompt tokens the router expects it to have cached
        self.cached = dict(routed.cached_tokens)
        self.tried: list[int] = []
        self.errors: list[str] = []
        self.last: AttemptFailed | None = None
        self.attempts = 0
        self.spins = 0

    def pick(self, table: ReplicaTable, *, panic: bool) -> Replica | None:
        """The first replica of the ranking not tried yet that is routable (with ``panic``: or unhealthy)."""
        for i in self.ranking:
            if i in self.tried:
                continue
            rep = table.by_index(i)
            if rep is not None and (rep.routable or (panic and rep.state == ReplicaState.UNHEALTHY)):
                return rep
        return None

    def extend(self, again: Routed) -> bool:
        """Append a new decision's replicas not ranked yet; False when it brought none."""
        new = [i for i in again.decision.ranking if i not in self.ranking]
        if not new:
            return False
        self.ranking.extend(new)
        cached = self.cached
        for i in candidate_indices(
            again.candidates
        ):  # the new view replaces the old for every replica it saw
            cached.pop(i, None)
        cached.update(again.cached_tokens)
        return True


class Proxy:
    """Serves requests in place for a ``Router``: the attempts over the decision's ranking.

    Args:
        router: makes decisions and keeps the in-flight accounting.
        edge: the engine edge (open / payload / commit, the pool).
        telemetry: metrics (retries, upstream errors).
        config: retries and the total deadline.
    """

    def __init__(
        self,
        router: Router,
        edge: EngineEdge,
        telemetry: Telemetry,
        config: ProxyConfig,
        gaps: EndpointGaps | None = None,
    ) -> None:
        self.router = router
        self.edge = edge
        self.telemetry = telemetry
        self.cfg = config
        #: endpoints replicas do not serve, learned from their answers (None: not learned)
        self.gaps = gaps
        #: the cache-first dispatch gate (router/core/dispatch.py); None: every request is sent when routed
        self.gate: DispatchGate | None = None

    async def attempts(
        self,
        routed: Routed,
        path: str,
        body: bytes,
        stream: bool,
        request_id: str,
        ids: IdsPrompt | None = None,
        wire: Wire = OPENAI,
    ) -> Response:
        """Try the decision's replicas in ranking order until one answers (module docstring, steps 1-4).

        At most ``1 + max_retries`` attempts (an attempt whose replica left while it waited at the dispatch gate
        does not count); a failure that another replica cannot fix (``AttemptFailed.retry`` false) ends it.
        """
        run = AttemptRun(
            routed,
            deadline=time.monotonic() + self.cfg.total_timeout_s,
            headers={
                "content-type": wire.content_type,
                "x-request-id": request_id,
                "accept": "text/event-stream" if stream else "application/json",
            },
        )
        while run.attempts <= self.cfg.max_retries and run.spins < _MAX_SPINS:
            run.spins += 1
            rep = self._next_replica(run)
            if rep is None:
                break
            run.tried.append(rep.index)
            if run.attempts:
                self.telemetry.retries.labels(run.last.reason if run.last else "unknown").inc()
            run.attempts += 1
            try:
                return await self._attempt(run, rep, path, body, stream, request_id, ids, wire)
            except AttemptFailed as exc:
                self._attempt_failed(run, rep, exc, request_id)
                if not exc.retry:
                    break
        return self._all_failed(run, request_id)

    def _next_replica(self, run: AttemptRun) -> Replica | None:
        """The next replica of the ranking that is ready; when none is, an unhealthy one (panic routing, as in
        ``Router.decide``: health checks of overloaded engines give false positives); when the ranking is
        exhausted, decide again without the replicas tried (counted as a spin). None: nothing left to try."""
        router = self.router
        while True:
            rep = run.pick(router.table, panic=False)
            if rep is None and router.panic_routing:
                rep = run.pick(router.table, panic=True)
            if rep is not None:
                return rep
            if run.routed.inp.pinned_to is not None:
                return None  # only the pinned replica may serve it (it holds the request's state)
            try:
                again = router.decide(run.routed.inp, exclude=run.tried)
            except RoutingError:
                return None
            if not run.extend(again) or run.attempts > self.cfg.max_retries or run.spins >= _MAX_SPINS:
                return None
            run.spins += 1

    async def _attempt(
        self,
        run: AttemptRun,
        rep: Replica,
        path: str,
        body: bytes,
        stream: bool,
        request_id: str,
        ids: IdsPrompt | None,
        wire: Wire,
    ) -> Response:
        """One attempt on ``rep``: hold its in-flight slot (and dispatch-gate permit), send, wait for the first
        byte, commit the answer. Raises ``AttemptFailed`` before the first byte (the hold is released)."""
        inp = run.routed.inp
        predicted_cached = run.cached.get(rep.index, 0)
        trace = inp.trace
        span: Any = None
        headers = run.headers
        if trace is not None:  # the attempt's span; the engine's traceparent names it as the parent
            span = trace.child(
                "kvroute.attempt", self._attempt_attributes(run, rep, predicted_cached), client=True
            )
            headers = {**headers, **trace.headers(span)}
        if rep.is_peer:  # another region's router: it serves the request in its region, never hops on
            cfg = self.cfg
            headers = {
                **headers,
                **hop_headers(
                    cfg.region, inp.allowed_regions, cfg.session_header, inp.session_id, cfg.peer_key
                ),
            }
        uncached = inp.prompt_tokens - predicted_cached
        with Hold(self.router, self.gate, rep, uncached, inp.copies, inp.lora) as hold:
            hold.span = span
            self.router.record_prediction(rep, inp.keys)
            payload, strip_usage = self.edge.payload(rep, body, stream, ids, wire)
            t0 = time.monotonic()  # TTFT includes the wait at the dispatch gate (what the client sees)
            try:
                await hold.admit(inp.keys, inp.prompt_tokens, stream)
                resp, first = await self.edge.open(rep, path, payload, headers, run.deadline, wire.method)
            except AttemptFailed as exc:
                attempt_failed(span, exc.reason, exc.message)
                raise
            ttft = time.monotonic() - t0
            hold.first_byte()
            if span is not None:
                first_byte(span, resp.status, ttft)
            answer = await self.edge.commit(
                hold,
                run.routed,
                resp,
                first,
                ttft,
                run.deadline,
                stream,
                request_id,
                predicted_cached,
                strip_usage,
                wire,
            )
        return self._framework_answer(rep, path, wire, answer)

    def _framework_answer(self, rep: Replica, path: str, wire: Wire, answer: Response) -> Response:
        """An engine's framework 404 for the path (the replica does not serve it): learned, and the attempt retried
        elsewhere (``AttemptFailed`` 404 ``endpoint_not_served``); its framework 405 (the method is not served
        there): answered in the OpenAI error shape. Any other answer unchanged."""
        status = answer.status_code
        if status not in (404, 405) or not isinstance(answer.body, bytes):
            return answer
        body = answer.body.strip()
        if status == 404 and body in FRAMEWORK_NOT_FOUND:
            if self.gaps is not None:
                self.gaps.learn(rep.name, path)
            raise AttemptFailed(
                "endpoint_not_served", f"does not serve {path.partition('?')[0]}", retry=True, status=404
            )
        if status == 405 and body in FRAMEWORK_NOT_ALLOWED:
            headers = {k: v for k, v in answer.headers.items() if k.startswith("x-")}
            if "allow" in answer.headers:
                headers["allow"] = answer.headers["allow"]
            return error_response(
                405,
                f"replica {rep.name} does not allow {wire.method} {path.partition('?')[0]}",
                "method_not_allowed",
                headers=headers,
                trace_id=current_trace_id(),
            )
        return answer

    @staticmethod
    def _attempt_attributes(run: AttemptRun, rep: Replica, predicted_cached: int) -> dict[str, Any]:
        """An attempt span's attributes: the replica, the attempt's number (1 = first), the previous attempt's
        failure, the prompt tokens the router expects the replica to reuse."""
        attrs: dict[str, Any] = {
            "kvroute.replica": rep.name,
            "server.address": rep.url,
            "kvroute.attempt": run.attempts,
            "kvroute.predicted.cached_tokens": predicted_cached,
        }
        if run.last is not None:
            attrs["kvroute.retry_reason"] = run.last.reason
        return attrs

    def _attempt_failed(self, run: AttemptRun, rep: Replica, exc: AttemptFailed, request_id: str) -> None:
        """Record a failed attempt (its error for the final message, the passive health signal)."""
        run.last = exc
        run.errors.append(f"{rep.name}: {exc.message}")
        if not exc.attempted:
            run.attempts -= 1  # it never reached the replica: not an attempt
            return
        log.warning(
            "attempt failed",
            extra={"request_id": request_id, "replica": rep.name, "reason": exc.reason, "error": exc.message},
        )
        if exc.connection:
            self.edge.on_connection_failure(rep, exc.message)

    def _all_failed(self, run: AttemptRun, request_id: str) -> Response:
        """The error answer when no attempt succeeded: 503 when no replica could be tried, else the last
        failure's status with every attempt's error."""
        last = run.last
        if last is None:
            self.telemetry.upstream_errors.labels("no_replica").inc()
            return error_response(
                503,
                f"no routable replica left for model {run.routed.inp.model!r}",
                "no_routable_replica",
                headers={"retry-after": str(self.cfg.retry_after_s), "x-request-id": request_id},
                trace_id=current_trace_id(),
            )
        self.telemetry.upstream_errors.labels(last.reason).inc()
        msg = f"request failed after {run.attempts} attempt(s): " + "; ".join(run.errors)
        return error_response(
            last.status, msg, last.reason, headers={"x-request-id": request_id}, trace_id=current_trace_id()
        )
