"""Forwarding to engines: pooled HTTP, in-flight accounting, retries before the first byte, SSE passthrough,
cancellation, timeouts, request ids, and feedback (observed TTFT, engine-reported cached tokens).

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

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import anyio
import orjson
from prometheus_client import Counter
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as HttpToolsCycle

from membership.replicas import Replica, ReplicaState, ReplicaTable
from policies.base import Observation
from router.core.dispatch import DispatchGate, ReplicaGone
from router.core.routing import Routed, Router, RoutingError
from router.engine.client import (
    EngineConnectError,
    EngineConnectionLost,
    EngineConnectTimeout,
    EngineError,
    EnginePool,
    EngineResponse,
    EngineResponseTooLarge,
    EngineTLSError,
)
from router.engine.config import ProxyConfig
from router.errors import error_body, error_response
from router.telemetry import Telemetry
from router.tokens.token_ids import IdsPrompt, TokenIdsCheck

log = logging.getLogger("kvroute.proxy")


class PlanServer(Protocol):
    """Serves requests routed with a prefill/decode plan (``router.pd.legs.PdLegs``, issue 19)."""

    async def serve_plan(
        self, routed: Routed, path: str, body: bytes, stream: bool, request_id: str, ids: IdsPrompt | None
    ) -> Response:
        """The client's answer for ``routed`` (its plan: in place or disaggregated)."""
        ...


#: bytes of the end of a stream kept to find the final ``usage`` chunk
_TAIL_BYTES = 16384
#: largest error body read from an engine 5xx (bytes)
_ERR_BODY_BYTES = 2048


def new_request_id(given: str | None) -> str:
    """The client's ``X-Request-Id`` when sane (<= 128 printable chars), else a fresh one."""
    if given and len(given) <= 128 and given.isprintable():
        return given
    return uuid.uuid4().hex


#: bound on the attempt loop's turns (attempts, skipped replicas and re-decisions together)
_MAX_SPINS = 64


class _AttemptFailed(Exception):
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


class _Run:
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
        self.last: _AttemptFailed | None = None
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
        self.cached.update(again.cached_tokens)
        return True


class _Hold:
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

    def __enter__(self) -> _Hold:
        self.router.acquire(self.rep, self.uncached, self.copies)
        self._prefilling = self._held = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owned:
            self.release()

    async def admit(self, keys: Sequence[int], prompt_tokens: int, stream: bool) -> None:
        """Wait for the dispatch gate (when there is one). Raises ``_AttemptFailed`` (not an attempt) when the
        replica stopped being routable meanwhile."""
        if self.gate is None:
            return
        try:
            self._permit = await self.gate.wait(self.rep.index, keys, prompt_tokens, self.uncached, stream)
        except ReplicaGone as exc:
            raise _AttemptFailed("replica_gone", str(exc), retry=True, attempted=False) from None

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

    def hand_over(self) -> _Hold:
        """The caller no longer releases on leaving the ``with`` block: a relayed stream will. Returns self."""
        self._owned = False
        return self


class Proxy:
    """Forwards requests to engines for a ``Router``.

    Args:
        router: makes decisions and keeps the in-flight accounting.
        telemetry: metrics.
        config: timeouts, retries, pool sizes.
        on_connection_failure: ``f(replica, error)`` called when a connection to a replica fails (passive
            health signal).
    """

    def __init__(
        self,
        router: Router,
        telemetry: Telemetry,
        config: ProxyConfig,
        on_connection_failure: Callable[[Replica, str], None] | None = None,
        token_ids: TokenIdsCheck | None = None,
    ) -> None:
        self.router = router
        self.telemetry = telemetry
        self.cfg = config
        self.on_connection_failure = on_connection_failure or (lambda rep, err: None)
        #: which replicas take prompts as token ids (router/tokens/token_ids.py); None: none
        self.token_ids = token_ids
        self._headers: dict[str, str] = {}
        if config.engine_api_key:
            self._headers["authorization"] = f"Bearer {config.engine_api_key}"
        self._pool: EnginePool | None = None
        #: the cache-first dispatch gate (router/core/dispatch.py); None: every request is sent when routed
        self.gate: DispatchGate | None = None
        #: serves prefill/decode plans (router/pd/legs.py, issue 19); None: no PD fleets
        self.pd: PlanServer | None = None
        self.usage_missing = Counter(
            "kvroute_engine_usage_missing",
            "successful engine answers without the usage the router needs for "
            "cached-token feedback, by replica and what was missing (prompt_tokens_details: vLLM without "
            "--enable-prompt-tokens-details, SGLang without --enable-cache-report; stream_usage: a stream that "
            "carried no usage although it was asked for)",
            ["replica", "what"],
            registry=telemetry.registry,
        )
        #: (replica name, what) already logged as missing usage: one warning per replica
        self._usage_warned: set[tuple[str, str]] = set()
        telemetry.add_gauges(self._policy_gauges)

    def _policy_gauges(self) -> Any:
        """``kvroute_policy_excluded_candidates``: candidates the policy could not score (absurd load values)."""
        from router.telemetry import gauge

        excluded = getattr(self.router.policy, "excluded_candidates", None)
        if isinstance(excluded, int):
            yield gauge(
                "kvroute_policy_excluded_candidates",
                "candidates left out of routing decisions because "
                "their score could not be computed (not finite or negative: broken load values; "
                "cumulative)",
                float(excluded),
            )

    def pool(self) -> EnginePool:
        """The engine connection pool (created on first use, inside the event loop)."""
        if self._pool is None or self._pool.closed:
            # read timeouts are enforced by the proxy itself (first byte, idle gap, total deadline)
            self._pool = EnginePool(
                connect_timeout_s=self.cfg.connect_timeout_s,
                keepalive_timeout_s=self.cfg.keepalive_timeout_s,
                max_connections=self.cfg.max_connections,
                headers=self._headers,
                max_header_bytes=self.cfg.max_header_bytes,
                max_headers=self.cfg.max_headers,
            )
        return self._pool

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None

    # -- entry point -----------------------------------------------------------------------------------
    async def forward(
        self,
        request: Request,
        routed: Routed,
        path: str,
        body: bytes,
        *,
        stream: bool,
        request_id: str,
        on_done: Callable[[], None] | None = None,
        ids: IdsPrompt | None = None,
    ) -> Response:
        """Send ``body`` to ``path`` on the best replica of ``routed`` (retrying as described above).

        Returns the response for the client; never raises for engine or network failures. ``on_done`` is
        called exactly once when the response is over (for a stream: when it ended or the client left).
        ``ids``: set when the body's text prompt may be replaced by the router's token ids (router/tokens/token_ids.py);
        each attempt sends ``ids.body()`` to replicas that take ids and ``body`` to the others.
        """
        try:
            resp = await self._forward(request, routed, path, body, stream, request_id, ids)
        except BaseException:
            if on_done is not None:
                on_done()
            raise
        if on_done is not None:
            if isinstance(resp, _ProxyStream):
                resp.relay.on_done = on_done
            else:
                on_done()
        return resp

    async def _forward(
        self,
        request: Request,
        routed: Routed,
        path: str,
        body: bytes,
        stream: bool,
        request_id: str,
        ids: IdsPrompt | None,
    ) -> Response:
        watch = _ClientWatch(request.receive)
        try:
            if routed.plan is not None and self.pd is not None:  # a prefill/decode fleet (router/pd/legs.py)
                resp = await self.pd.serve_plan(routed, path, body, stream, request_id, ids)
            else:
                resp = await self._attempts(routed, path, body, stream, request_id, ids)
        except asyncio.CancelledError:
            watch.stop()
            if not watch.left or not watch.uncancel():
                raise
            # the client went away before the answer started: the upstream request was cancelled with us
            self.telemetry.upstream_errors.labels("client_disconnected").inc()
            return Response(status_code=499)
        except BaseException:
            watch.stop()
            raise
        if isinstance(resp, _ProxyStream):
            resp.watch = watch.disarm()  # the stream keeps watching (and re-arms it on its own task)
        else:
            watch.stop()
        return resp

    async def _attempts(
        self,
        routed: Routed,
        path: str,
        body: bytes,
        stream: bool,
        request_id: str,
        ids: IdsPrompt | None = None,
    ) -> Response:
        """Try the decision's replicas in ranking order until one answers (module docstring, steps 1-4).

        At most ``1 + max_retries`` attempts (an attempt whose replica left while it waited at the dispatch gate
        does not count); a failure that another replica cannot fix (``_AttemptFailed.retry`` false) ends it.
        """
        run = _Run(
            routed,
            deadline=time.monotonic() + self.cfg.total_timeout_s,
            headers={
                "content-type": "application/json",
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
                return await self._attempt(run, rep, path, body, stream, request_id, ids)
            except _AttemptFailed as exc:
                self._attempt_failed(run, rep, exc, request_id)
                if not exc.retry:
                    break
        return self._all_failed(run, request_id)

    def _next_replica(self, run: _Run) -> Replica | None:
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
            try:
                again = router.decide(run.routed.inp, exclude=run.tried)
            except RoutingError:
                return None
            if not run.extend(again) or run.attempts > self.cfg.max_retries or run.spins >= _MAX_SPINS:
                return None
            run.spins += 1

    async def _attempt(
        self,
        run: _Run,
        rep: Replica,
        path: str,
        body: bytes,
        stream: bool,
        request_id: str,
        ids: IdsPrompt | None,
    ) -> Response:
        """One attempt on ``rep``: hold its in-flight slot (and dispatch-gate permit), send, wait for the first
        byte, commit the answer. Raises ``_AttemptFailed`` before the first byte (the hold is released)."""
        inp = run.routed.inp
        predicted_cached = run.cached.get(rep.index, 0)
        with _Hold(self.router, self.gate, rep, inp.prompt_tokens - predicted_cached, inp.copies) as hold:
            self.router.record_prediction(rep, inp.keys)
            payload, strip_usage = self._payload(rep, body, stream, ids)
            t0 = time.monotonic()  # TTFT includes the wait at the dispatch gate (what the client sees)
            await hold.admit(inp.keys, inp.prompt_tokens, stream)
            resp, first = await self._open(rep, path, payload, run.headers, run.deadline)
            ttft = time.monotonic() - t0
            hold.first_byte()
            return await self._commit(
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
            )

    def _payload(self, rep: Replica, body: bytes, stream: bool, ids: IdsPrompt | None) -> tuple[bytes, bool]:
        """The body for ``rep`` (token ids when it takes them) and whether the router asked for stream usage
        the client did not ask for (then it is removed from what the client receives)."""
        payload = body
        check = self.token_ids
        if check is not None and ids is not None and check.accepts(rep):
            payload = ids.body()
            self.telemetry.token_id_prompts.inc()
            check.audit(rep, ids)
        if stream and self.cfg.stream_usage:
            return ask_for_usage(payload)
        return payload, False

    def _attempt_failed(self, run: _Run, rep: Replica, exc: _AttemptFailed, request_id: str) -> None:
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
            self.on_connection_failure(rep, exc.message)

    def _all_failed(self, run: _Run, request_id: str) -> Response:
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
            )
        self.telemetry.upstream_errors.labels(last.reason).inc()
        msg = f"request failed after {run.attempts} attempt(s): " + "; ".join(run.errors)
        return error_response(last.status, msg, last.reason, headers={"x-request-id": request_id})

    async def _open(
        self, rep: Replica, path: str, body: bytes, headers: dict[str, str], deadline: float
    ) -> tuple[EngineResponse, bytes]:
        """Send the request and wait for headers + the first body chunk. Raises _AttemptFailed."""
        budget = min(self.cfg.first_byte_timeout_s, deadline - time.monotonic())
        resp: EngineResponse | None = None
        try:
            async with asyncio.timeout(max(0.001, budget)):
                resp = await self.pool().post(rep.url, path, body, headers)
                if resp.status >= 500:
                    data = await resp.read_all(_ERR_BODY_BYTES)
                    resp.close()
                    raise _AttemptFailed(
                        f"engine_{resp.status}",
                        f"engine answered {resp.status}: {data[:300].decode(errors='replace')}",
                        retry=True,
                        status=502,
                    )
                first = await resp.read_chunk()
                return resp, first
        except _AttemptFailed:
            raise
        except EngineConnectTimeout as exc:  # an overloaded engine, not necessarily a dead one
            raise _AttemptFailed("connect_timeout", f"connect timed out: {exc}", retry=True) from None
        except TimeoutError:
            if resp is not None:
                resp.close()
            raise _AttemptFailed(
                "first_byte_timeout",
                f"no response within {budget:.3g}s (first_byte_timeout_s)",
                retry=False,
                status=504,
            ) from None
        except EngineTLSError as exc:
            raise _AttemptFailed("tls_error", str(exc), retry=True, connection=True) from None
        except EngineConnectError as exc:
            raise _AttemptFailed(
                "connect_error", f"cannot connect: {exc}", retry=True, connection=True
            ) from None
        except EngineConnectionLost as exc:
            if resp is not None:
                resp.close()
            raise _AttemptFailed(
                "connection_lost",
                f"connection lost before the first byte: {exc}",
                retry=True,
                connection=True,
            ) from None
        except EngineError as exc:
            if resp is not None:
                resp.close()
            raise _AttemptFailed("upstream_error", f"{type(exc).__name__}: {exc}", retry=True) from None
        except BaseException:
            if resp is not None:
                resp.close()
            raise

    # -- committed answers -----------------------------------------------------------------------------
    async def _commit(
        self,
        hold: _Hold,
        routed: Routed,
        resp: EngineResponse,
        first: bytes,
        ttft: float,
        deadline: float,
        stream: bool,
        request_id: str,
        predicted_cached: int,
        strip_usage: bool = False,
    ) -> Response:
        """The client's answer once the first byte arrived: a relayed stream (which takes over ``hold``) or the
        whole body read now (``hold`` is released when it was read)."""
        rep = hold.rep
        out_headers = {
            "x-request-id": request_id,
            "x-kvroute-replica": rep.name,
            "x-kvroute-predicted-cached-tokens": str(predicted_cached),
        }
        ctype = resp.headers.get("content-type", "application/json")
        status = resp.status
        if status < 400:
            self.telemetry.ttft.labels(rep.name).observe(ttft)
        if ctype.startswith("text/event-stream") and status < 400:
            return self._commit_stream(
                hold,
                routed,
                resp,
                first,
                ttft,
                deadline,
                request_id,
                predicted_cached,
                strip_usage,
                ctype,
                out_headers,
            )
        # non-streaming: read the rest now, bounded in size and in silence
        try:
            content = await resp.read_body(
                first,
                max_bytes=self.cfg.max_body_bytes,
                idle_timeout_s=self.cfg.body_idle_timeout_s,
                deadline=deadline,
            )
        except (TimeoutError, EngineError) as exc:
            hold.release()
            resp.close()
            return self._body_failed(rep, exc, out_headers)
        except BaseException:
            hold.release()
            resp.close()
            raise
        hold.release()
        resp.release()  # fully read: the connection goes back to the pool
        if status < 400:
            try:
                obj = orjson.loads(content)
            except orjson.JSONDecodeError:
                self.telemetry.upstream_errors.labels("bad_body").inc()
                log.warning("engine answered garbage", extra={"request_id": request_id, "replica": rep.name})
                return error_response(
                    502,
                    f"engine {rep.name} answered {status} with a body that is not JSON: {content[:80]!r}",
                    "upstream_bad_body",
                    headers=out_headers,
                )
            usage = obj.get("usage") if isinstance(obj, dict) else None
            usage = usage if isinstance(usage, dict) else None
            self._check_usage(rep, usage, streamed=False)
            self._feedback(rep, routed, usage, ttft, predicted_cached, single_chunk=not stream)
        return Response(content, status_code=status, media_type=ctype, headers=out_headers)

    def _commit_stream(
        self,
        hold: _Hold,
        routed: Routed,
        resp: EngineResponse,
        first: bytes,
        ttft: float,
        deadline: float,
        request_id: str,
        predicted_cached: int,
        strip_usage: bool,
        ctype: str,
        out_headers: dict[str, str],
    ) -> Response:
        """A relayed event stream (the relay releases ``hold`` when it ends), or a clean 502 when the first
        chunk is already not a valid event stream (nothing was sent to the client yet)."""
        rep = hold.rep
        events = SSEValidator(strip_usage=strip_usage, max_event_bytes=self.cfg.max_body_bytes)
        try:
            out = events.feed(first)
        except BadStream as exc:
            hold.release()
            resp.close()
            self.telemetry.upstream_errors.labels("bad_stream").inc()
            log.warning(
                "engine sent an invalid event stream",
                extra={"request_id": request_id, "replica": rep.name, "error": str(exc)},
            )
            return error_response(
                502,
                f"engine {rep.name} answered {resp.status} with an invalid event stream: {exc}",
                "upstream_bad_stream",
                headers=out_headers,
            )
        relay = _Relay(self, hold, routed, resp, out, ttft, deadline, request_id, predicted_cached, events)
        relay.tail = bytearray(first[-_TAIL_BYTES:])
        response = _ProxyStream(relay, status_code=resp.status, media_type=ctype, headers=out_headers)
        hold.hand_over()
        return response

    def _body_failed(self, rep: Replica, exc: BaseException, out_headers: dict[str, str]) -> Response:
        """The error answer for a non-streamed body that could not be read whole (counted by reason)."""
        if isinstance(exc, EngineResponseTooLarge):
            reason, status, code = "body_too_large", 502, "upstream_body_too_large"
            msg = (
                f"engine {rep.name} sent a response body over {self.cfg.max_body_bytes} bytes "
                "(engine_max_body_bytes)"
            )
        elif isinstance(exc, TimeoutError) and exc.args[:1] == ("idle",):
            reason, status, code = "body_stalled", 504, "upstream_body_stalled"
            msg = (
                f"engine {rep.name} sent nothing for {self.cfg.body_idle_timeout_s:g}s while sending the "
                "response body (engine_body_idle_timeout_s)"
            )
        elif isinstance(exc, TimeoutError):
            reason, status, code = "total_timeout", 504, "total_timeout"
            msg = f"engine {rep.name} did not finish the response within total_timeout_s"
        else:
            reason, status, code = "body_failed", 502, "upstream_body_failed"
            msg = f"engine {rep.name} failed while sending the response: {type(exc).__name__}"
        self.telemetry.upstream_errors.labels(reason).inc()
        log.warning(
            "engine response body failed",
            extra={"replica": rep.name, "reason": reason, "request_id": out_headers.get("x-request-id")},
        )
        return error_response(status, msg, code, headers=out_headers)

    def _check_usage(self, rep: Replica, usage: dict[str, Any] | None, *, streamed: bool) -> None:
        """Count (and log once per replica) a successful answer without the usage cached-token feedback needs."""
        if usage is None:
            if not streamed:
                return  # a non-streamed answer without usage at all is not an OpenAI-style completion: ignore
            what = "stream_usage"
            hint = (
                "the engine sent no usage chunk although stream_options.include_usage was set (vLLM: "
                "--enable-force-include-usage forces it)"
            )
        elif not isinstance(usage.get("prompt_tokens_details"), dict):
            what = "prompt_tokens_details"
            hint = (
                "usage.prompt_tokens_details is missing: start vLLM with --enable-prompt-tokens-details "
                "(SGLang: --enable-cache-report) so the engine reports cached tokens"
            )
        else:
            return
        self.usage_missing.labels(rep.name, what).inc()
        if (rep.name, what) not in self._usage_warned:
            self._usage_warned.add((rep.name, what))
            log.warning(
                "no cached-token feedback from engine %s: %s; fidelity metrics and calibration stay dark "
                "for it",
                rep.name,
                hint,
                extra={"replica": rep.name, "missing": what},
            )

    def _feedback(
        self,
        rep: Replica,
        routed: Routed,
        usage: dict[str, Any] | None,
        ttft: float,
        predicted_cached: int,
        *,
        single_chunk: bool,
    ) -> None:
        """Telemetry (predicted vs reported cached tokens) and policy calibration after a response."""
        n = routed.inp.prompt_tokens
        reported = _cached_tokens(usage)
        if reported is not None:
            self.telemetry.observe_cached(n, predicted_cached, reported)
        completion = usage.get("completion_tokens") if usage else None
        if single_chunk and not (isinstance(completion, int) and completion <= 1):
            return  # the time of a whole non-streamed answer is not a TTFT
        q = 0.0
        for s in routed.decision.scores:
            if s.index == rep.index:
                q = float(s.parts.get("Q", 0.0) or 0.0)
        obs = Observation(
            index=rep.index,
            prompt_tokens=n,
            cached_tokens=reported if reported is not None else predicted_cached,
            queue_wait_s=q,
            ttft_s=ttft,
            now=self.router.clock(),
        )
        self.router.observe(obs)
        if routed.plan is not None and not routed.disaggregated:
            self.router.observe_pd(obs)  # an in-place plan's answer calibrates the PD policy too


# ---------------------------------------------------------------------------------------------------------
# streams
# ---------------------------------------------------------------------------------------------------------


class _Relay:
    """One relayed SSE stream: yields the engine's chunks, and cleans up exactly once (``finish``).

    Cleanup = release the attempt's hold on the replica (in-flight count), feed back usage / TTFT, close the upstream response, call
    ``on_done``. It runs from the generator's ``finally`` and, as a safety net, from ``_ProxyStream`` (a stream
    cancelled before its generator ever started has no ``finally`` to run).
    """

    def __init__(
        self,
        proxy: Proxy,
        hold: _Hold,
        routed: Routed,
        resp: EngineResponse,
        first: bytes,
        ttft: float,
        deadline: float,
        request_id: str,
        predicted_cached: int,
        events: SSEValidator | None = None,
    ) -> None:
        self.proxy, self.hold, self.rep, self.routed, self.resp = proxy, hold, hold.rep, routed, resp
        self.first, self.ttft, self.deadline, self.request_id = first, ttft, deadline, request_id
        self.predicted_cached = predicted_cached
        #: validates (and filters) the engine's events; ``first`` has already been through it
        self.events = events or SSEValidator(strip_usage=False, max_event_bytes=proxy.cfg.max_body_bytes)
        #: the end of the engine's raw stream (before filtering): the final usage chunk is found there
        self.tail = bytearray(first[-_TAIL_BYTES:])
        self.ok = False
        self.finished = False
        self.on_done: Callable[[], None] | None = None
        #: writes to the client's connection directly (``_ProxyStream`` sets it when the server allows it): the
        #: engine's pieces are then relayed from the engine connection's read callback (``_sink``)
        self.direct: _DirectWrite | None = None
        #: the engine's stream failed validation in ``_sink`` (the loop sends the error event)
        self.bad: BadStream | None = None
        #: ``time.monotonic()`` of the last piece the engine sent (seconds): the idle timeout counts from it
        self.last_at = time.monotonic()
        self.direct_pieces = 0  # pieces relayed by ``_sink`` / by the loop (``kvroute_relayed_pieces_total``)
        self.task_pieces = 1 if first else 0

    def _bad(self, exc: BadStream) -> bytes:
        """Count and log an invalid event stream; the SSE error event that ends the client's stream."""
        self.proxy.telemetry.upstream_errors.labels("bad_stream").inc()
        log.warning(
            "engine sent an invalid event stream",
            extra={"request_id": self.request_id, "replica": self.rep.name, "error": str(exc)},
        )
        return _sse_error(502, f"engine {self.rep.name} sent an invalid event stream: {exc}", "bad_stream")

    def _end(self) -> bytes | None:
        """The engine's stream is over: None when it ended properly, else the SSE error event to send."""
        try:
            self.events.end()
        except BadStream as exc:
            return self._bad(exc)
        return None

    async def body(self) -> AsyncIterator[bytes]:
        """The chunks for the client; a failure after the first byte ends with an SSE error event.

        ``ok`` turns True before the last chunk is yielded when the engine's answer is already complete (no
        further read), so ``_ProxyStream`` can send it as the end of the response (one write, not two).
        """
        telemetry = self.proxy.telemetry
        resp = self.resp
        events = self.events
        try:
            if resp.at_end:  # the whole answer came with the headers
                err = self._end()
                if err is None:
                    self.ok = True
                    yield self.first
                else:
                    yield self.first + err
                return
            if self.first:
                yield self.first
            idle = self.proxy.cfg.idle_timeout_s
            while not self.ok:
                wait, expired = self._next_wait(idle)
                if expired is not None:
                    yield expired
                    break
                if self.direct is not None:
                    resp.attach(
                        self._sink
                    )  # pieces go to the client from the read callback until one is declined
                try:
                    chunk = await resp.read_chunk(wait)
                except TimeoutError:
                    continue  # the checks above tell which limit passed (pieces may have flowed through the sink)
                except EngineError as exc:
                    reason = "stream_broken"
                    telemetry.upstream_errors.labels(reason).inc()
                    log.warning(
                        "stream failed",
                        extra={
                            "request_id": self.request_id,
                            "replica": self.rep.name,
                            "error": f"{type(exc).__name__}: {exc}",
                        },
                    )
                    yield _sse_error(
                        502, f"engine {self.rep.name} failed mid-stream: {type(exc).__name__}", reason
                    )
                    break
                finally:
                    resp.attach(None)
                if self.bad is not None:
                    yield self._bad(self.bad)
                    break
                if not chunk:
                    err = self._end()
                    if err is not None:
                        yield err
                        break
                    self.ok = True
                    break
                self.last_at = time.monotonic()
                self.task_pieces += 1
                self._keep_tail(chunk)
                try:
                    out = events.feed(chunk)
                except BadStream as exc:
                    yield self._bad(exc)
                    break
                if resp.at_end:
                    err = self._end()
                    if err is not None:
                        yield out + err
                        break
                    self.ok = True
                    yield out
                elif out:
                    yield out
        finally:
            # a complete stream is finished by _ProxyStream after the client got its last byte (the feedback
            # and policy update are then off the client's latency); failures and cancellations clean up here
            if not self.ok:
                await self.finish()

    def _keep_tail(self, piece: bytes) -> None:
        """Append ``piece`` to the end of the raw stream kept for the final usage chunk (bounded)."""
        tail = self.tail
        tail += piece
        if len(tail) > 2 * _TAIL_BYTES:
            del tail[:-_TAIL_BYTES]

    def _next_wait(self, idle: float) -> tuple[float, bytes | None]:
        """How long the next read may wait (seconds: until ``total_timeout_s`` or ``idle`` seconds after the last
        piece, whichever comes first), or the SSE error event (counted) when one of them has passed."""
        now = time.monotonic()
        remaining = self.deadline - now
        if remaining <= 0:
            self.proxy.telemetry.upstream_errors.labels("total_timeout").inc()
            return 0.0, _sse_error(504, "stream exceeded total_timeout_s", "total_timeout")
        idle_left = idle - (now - self.last_at)
        if idle_left <= 0:
            self.proxy.telemetry.upstream_errors.labels("idle_timeout").inc()
            return 0.0, _sse_error(504, f"engine sent nothing for {idle:g}s (idle_timeout_s)", "idle_timeout")
        return (remaining if remaining < idle_left else idle_left), None

    def _sink(self, piece: bytes) -> bool:
        """``EngineResponse.attach`` sink: validate a piece of the engine's stream and write it to the client now,
        in the engine connection's read callback (no task switch, future or ASGI message per piece). False
        (the relay loop takes the piece) when the client's connection is paused or closing, or the piece is not
        a valid event stream (``bad``). Never raises."""
        write = self.direct
        if write is None or not write.ready():
            return False
        self.last_at = time.monotonic()
        self._keep_tail(piece)
        try:
            out = self.events.feed(piece)
            if out:
                write(out)
        except BadStream as exc:
            self.bad = exc
            return False
        except Exception as exc:  # a bug here must not break the engine connection's read callback
            log.exception("stream relay failed")
            self.bad = BadStream(f"relay failed: {type(exc).__name__}")
            return False
        self.direct_pieces += 1
        return True

    async def finish(self) -> None:
        """Release everything (idempotent; never raises)."""
        if self.finished:
            return
        self.finished = True
        try:
            pieces = self.proxy.telemetry.relayed_pieces
            if self.direct_pieces:
                pieces.labels("direct").inc(self.direct_pieces)
            if self.task_pieces:
                pieces.labels("task").inc(self.task_pieces)
            self.hold.release()
            # usage is fed back even when the client left right after the last chunk
            usage = _usage_from_sse(bytes(self.tail))
            if self.ok:
                self.proxy._check_usage(self.rep, usage, streamed=True)
            if self.ok or usage:
                self.proxy._feedback(
                    self.rep, self.routed, usage, self.ttft, self.predicted_cached, single_chunk=False
                )
        except Exception:
            log.exception("stream cleanup failed")
        finally:
            if self.on_done is not None:
                self.on_done()
            if self.ok:
                self.resp.release()  # fully read: the connection goes back to the pool
            else:
                self.resp.close()  # the engine sees the connection close and aborts the request


class _ProxyStream(StreamingResponse):
    """A StreamingResponse over a ``_Relay`` that always runs the relay's cleanup when the response ends.

    Streams in the request's own task while one small task waits for the client's ``http.disconnect`` and
    cancels the stream when the client leaves (Starlette's StreamingResponse does the same with an anyio task
    group per response, which costs more CPU than the rest of the relay). The relay's cleanup (in-flight release,
    usage / TTFT feedback, connection back to the pool) runs after the last byte was sent.
    """

    def __init__(self, relay: _Relay, **kwargs: Any) -> None:
        super().__init__(relay.body(), **kwargs)
        self.relay = relay
        #: the relay's own generator: when someone replaced ``body_iterator`` to see every chunk (the idempotency
        #: guard keeps a copy of the stream), nothing may bypass it, so the direct relay stays off
        self._own_body = self.body_iterator
        #: the request's disconnect watcher, handed over by ``Proxy.forward`` (None: one is started here)
        self.watch: _ClientWatch | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watch = self.watch or _ClientWatch(receive)
        watch.arm()
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            relay = self.relay
            relay.direct = _DirectWrite.of(send) if self.body_iterator is self._own_body else None
            ended = False
            async for chunk in self.body_iterator:
                if relay.ok:  # the engine's answer is complete: this chunk ends the response
                    watch.disarm()
                    ended = True
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if not ended:
                watch.disarm()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            watch.disarm()
            if not watch.left or not watch.uncancel():
                raise
            # our own cancellation (the client disconnected): the response is simply over
        except OSError:
            raise ClientDisconnect() from None
        finally:
            watch.stop()
            with anyio.CancelScope(shield=True):
                await self.relay.finish()
        if self.background is not None:
            await self.background()


class _DirectWrite:
    """Writes relayed pieces straight onto the client's connection, as uvicorn's ``send`` would for a
    ``http.response.body`` message with ``more_body`` (one chunk of the chunked transfer encoding), for
    ``_Relay._sink``. Only for uvicorn's httptools protocol (the router's server) once it has started a chunked
    response; ``of`` returns None otherwise (other servers, test clients: the relay then sends every piece
    through ``send``). The end of the response always goes through ``send`` (uvicorn's own bookkeeping)."""

    __slots__ = ("transport", "flow")

    def __init__(self, transport: Any, flow: Any) -> None:
        self.transport = transport
        self.flow = flow

    @classmethod
    def of(cls, send: Any) -> _DirectWrite | None:
        """The direct writer behind ``send`` (after ``http.response.start``), or None when there is none. A wrapper
        that changes only the response head may expose the server's own send as ``server_send`` (the workers'
        ``WorkerApp`` does)."""
        cycle = getattr(getattr(send, "server_send", send), "__self__", None)
        if (
            not isinstance(cycle, HttpToolsCycle)
            or cycle.chunked_encoding is not True
            or cycle.response_complete
            or cycle.scope.get("method") == "HEAD"
        ):
            return None
        return cls(cycle.transport, cycle.flow)

    def ready(self) -> bool:
        """The client's connection takes writes now (not paused by flow control, not closing)."""
        return not self.flow.write_paused and not self.transport.is_closing()

    def __call__(self, data: bytes) -> None:
        self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))


class _ClientWatch:
    """One small task per request waiting for the client's ``http.disconnect`` (the body was already read).

    While armed it cancels the task it watches over (the request's own task) when the client leaves: before
    the answer starts that cancels the upstream attempt, mid-stream it stops the relay. ``Proxy.forward`` hands
    the same watcher to the stream, so a request costs one extra task, not one per phase.
    """

    __slots__ = ("task", "left", "armed", "_waiter")

    def __init__(self, receive: Callable[[], Any]) -> None:
        self.task = asyncio.current_task()
        self.left = False
        self.armed = True
        self._waiter = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Callable[[], Any]) -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                break
        self.left = True
        if self.armed and self.task is not None:
            self.task.cancel()

    def arm(self) -> None:
        """Watch over the current task (cancel it when the client leaves)."""
        self.task = asyncio.current_task()
        self.armed = True
        if self.left and self.task is not None:
            self.task.cancel()  # left while nobody was armed

    def disarm(self) -> _ClientWatch:
        """Stop cancelling (the answer is complete or being handed over); returns self."""
        self.armed = False
        return self

    def uncancel(self) -> bool:
        """Undo the cancellation this watcher caused; True when no other cancellation is pending."""
        return self.task is not None and self.task.uncancel() == 0

    def stop(self) -> None:
        """End the watcher task."""
        self.armed = False
        self._waiter.cancel()


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------

_USAGE_OPTION = b'"stream_options":{"include_usage":true}'


def ask_for_usage(body: bytes) -> tuple[bytes, bool]:
    """The streamed request ``body`` with ``stream_options.include_usage`` true, and whether the router added it
    (then the client did not ask for usage, and the usage chunk is removed from what it receives).

    The common case (no ``stream_options`` at all) appends the option without parsing the body; a body that
    mentions ``stream_options`` is parsed and the option set inside it. A body that is not a JSON object is
    returned unchanged (the engine will reject it).
    """
    if b'"stream_options"' not in body:
        head = body.rstrip()
        if not head.endswith(b"}"):
            return body, False
        inner = head[:-1].rstrip()
        sep = b"" if inner.endswith(b"{") else b","
        return inner + sep + _USAGE_OPTION + b"}", True
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body, False
    if not isinstance(obj, dict):
        return body, False
    options = obj.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return body, False  # the client asked: relay its usage as is
    obj["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return orjson.dumps(obj), True


class BadStream(Exception):
    """An engine's event stream is not a valid OpenAI-style SSE stream (message says why)."""


#: SSE field names (``name:`` lines); anything else on a non-comment line is garbage
_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:")


class SSEValidator:
    """Checks an engine's event stream event by event, and removes usage the client did not ask for.

    ``feed(chunk)`` returns the complete events of what arrived so far (an unfinished event is held until its
    blank line arrives; none may exceed ``max_event_bytes``); ``end()`` checks the stream ended properly. Both
    raise ``BadStream``. Valid: lines that are empty, comments (``:``) or SSE fields (``data``, ``event``, ``id``,
    ``retry``); each event's data a JSON object (the first one is parsed, later ones are checked for their braces:
    this runs for every token) or ``[DONE]``; the stream ends with ``data: [DONE]`` and no unfinished event.

    With ``strip_usage`` (the router asked for usage, the client did not), events whose JSON is a usage-only
    chunk (``"choices": []`` with ``usage``) are dropped and ``usage`` fields of other events removed.

    Units: bytes.
    """

    __slots__ = ("strip_usage", "max_event_bytes", "pending", "pending_bytes", "carry_cr", "done", "checked")

    def __init__(self, *, strip_usage: bool, max_event_bytes: int) -> None:
        self.strip_usage = strip_usage
        self.max_event_bytes = max_event_bytes
        #: pieces of an unfinished event (joined only once its blank line arrives: no quadratic copying)
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.carry_cr = False  # the last chunk ended with "\r" (maybe the first half of a "\r\n")
        self.done = False  # ``data: [DONE]`` seen
        self.checked = False  # the first data event was parsed as JSON

    def _normalize(self, chunk: bytes) -> bytes:
        """CRLF and CR line ends as LF. A chunk ending in CR counts it as a line end at once and drops a LF that
        starts the next chunk (the two halves of one CRLF)."""
        if self.carry_cr:
            self.carry_cr = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if b"\r" not in chunk:
            return chunk
        self.carry_cr = chunk.endswith(b"\r")
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def feed(self, chunk: bytes) -> bytes:
        """The complete, valid (and filtered) events of ``chunk`` plus what was pending."""
        # the common piece, one per token: exactly one whole ``data: {...}`` event after the first was parsed,
        # nothing pending, nothing to strip -> passed on as it is (what ``_feed`` returns for it, without its
        # splitting; issue 23)
        if (
            chunk[:7] == b"data: {"
            and chunk[-3:] == b"}\n\n"
            and self.checked
            and not self.pending
            and not self.carry_cr
            and not self.done
            and chunk.count(b"\n") == 2
            and b"\r" not in chunk
            and len(chunk) - 2 <= self.max_event_bytes
            and not (self.strip_usage and b'"usage"' in chunk)
        ):
            return chunk
        return self._feed(chunk)

    def _feed(self, chunk: bytes) -> bytes:
        """``feed`` for any chunk."""
        chunk = self._normalize(chunk)
        if self.pending:
            last = self.pending[-1]
            if b"\n\n" not in chunk and not (last.endswith(b"\n") and chunk.startswith(b"\n")):
                self._hold(chunk)  # still inside the same event
                return b""
            data = b"".join(self.pending) + chunk
            self.pending.clear()
            self.pending_bytes = 0
        else:
            data = chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._hold(data)
            return b""
        complete = data[: cut + 2]
        if cut + 2 < len(data):
            self._hold(data[cut + 2 :])
        events = complete.split(b"\n\n")
        events.pop()  # after the last blank line
        changed = False
        kept: list[bytes] = []
        for event in events:
            out = self._event(event)
            if out is not event:
                changed = True
            if out is not None:
                kept.append(out)
        if not changed:
            return complete
        return b"".join(e + b"\n\n" for e in kept)

    def _event(self, event: bytes) -> bytes | None:
        """One event (without its blank line): itself when valid and kept, a rewritten copy, or None to drop."""
        if len(event) > self.max_event_bytes:
            raise BadStream(f"an event over {self.max_event_bytes} bytes (engine_max_body_bytes)")
        data: list[bytes] = []
        for line in event.split(b"\n"):
            if not line or line[:1] == b":":
                continue
            if line.startswith(b"data:"):
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif not line.startswith(_SSE_FIELDS):
                raise BadStream(f"not an SSE line: {line[:60]!r}")
        if not data:
            return event
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        if self.done:
            return None  # nothing follows [DONE]: dropped
        if payload == b"[DONE]":
            self.done = True
            return event
        body = payload.strip()
        if body[:1] != b"{" or body[-1:] != b"}":
            raise BadStream(f"event data is not a JSON object: {payload[:60]!r}")
        if not self.checked or (self.strip_usage and b'"usage"' in body):
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise BadStream(f"event data is not JSON ({exc}): {payload[:60]!r}") from None
            if not isinstance(obj, dict):
                raise BadStream(f"event data is not a JSON object: {payload[:60]!r}")
            self.checked = True
            if self.strip_usage and "usage" in obj:
                if obj.get("choices") == [] and obj["usage"] is not None:
                    return None  # the usage-only chunk the router asked for
                del obj["usage"]
                return b"data: " + orjson.dumps(obj)
        return event

    def _hold(self, piece: bytes) -> None:
        """Keep ``piece`` of an unfinished event; an event over ``max_event_bytes`` is garbage."""
        if piece:
            self.pending.append(piece)
            self.pending_bytes += len(piece)
            if self.pending_bytes > self.max_event_bytes:
                raise BadStream(f"an event over {self.max_event_bytes} bytes (engine_max_body_bytes)")

    def end(self) -> None:
        """The engine's stream is over: it must have ended with ``data: [DONE]`` and no unfinished event."""
        rest = b"".join(self.pending).strip()
        if rest:
            raise BadStream(f"the stream ended inside an event: {rest[:60]!r}")
        if not self.done:
            # (worded without the marker itself: the idempotency guard looks for the last "data: [DONE]")
            raise BadStream("the stream ended without its final DONE event")


def _sse_error(status: int, message: str, code: str) -> bytes:
    """A terminal SSE error event (``event: error`` with an OpenAI-style error as data)."""
    return b"event: error\ndata: " + error_body(status, message, code) + b"\n\n"


def _usage_from_json(content: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


def _usage_from_sse(tail: bytes) -> dict[str, Any] | None:
    """The last ``usage`` object in the tail of an SSE stream, or None."""
    if b'"usage"' not in tail:
        return None
    for event in reversed(tail.split(b"\n\n")):
        for line in event.split(b"\n"):
            if not line.startswith(b"data:") or b'"usage"' not in line:
                continue
            usage = _usage_from_json(line[5:].strip())
            if usage:
                return usage
    return None


def _cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (vLLM / OpenAI), or None when absent."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    return None
