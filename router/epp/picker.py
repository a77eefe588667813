"""``kvroute epp``: the endpoint picker, a second front door (gRPC Envoy ``ext_proc``) onto the same routing core.

A Gateway API Inference Extension gateway (Istio, kgateway, Envoy AI Gateway, ...) opens one
``envoy.service.ext_proc.v3.ExternalProcessor/Process`` stream per HTTP request and asks where it goes. The
gateway carries the bytes; kvroute only decides. It serves TLS (``router.epp.tls``: self-signed by default, a
mounted certificate when given), plaintext only with ``epp_grpc_insecure``. Per stream (``_Stream``), one
request and one pick::

    request_headers -> checked (size, count, Latin-1) and authorized at once on the normalized request
                       (``router.serve.guard.authorize``: key, route, method), before any body is held
                     ─┬─ end_of_stream (no body): pick now
                      └─ request_body chunks, buffered until end_of_stream or the trailers (bounded by
                         max_request_bytes, epp_request_timeout_s and epp_min_body_rate_bytes_per_s)
    -> the serving pipeline (``router.serve.pipeline``, the HTTP door's steps): guard (loop-lag shedding),
       parse + identify + tokenize + hash, admission, decision (session affinity, subset hint as excluded
       replicas; the hint is read from the headers and from the final body message)
    -> in-flight accounting on the replica (acquired now, released when the response ends or the stream dies)
    -> a disaggregated PD plan: the prefill side run here, on the planned prefill replica, with the protocol
       runners the HTTP door uses (``router.pd.legs.PdLegs.handoff``: vLLM NIXL relay, Mooncake, SGLang
       bootstrap); the decode replica is the destination and gets the decode request (the prefill's
       ``kv_transfer_params``, or the bootstrap fields; ``X-data-parallel-rank`` when pinned), so it serves it
       without recomputing; a failed prefill side is served in place (counted). llm-d's
       ``x-prefiller-host-port`` is never handed on: a client's is removed (it would steer llm-d's decode-side
       sidecar's prefill to a host of the client's choosing), and the picker does not set it (the prefill leg
       has run here; a sidecar would run a second one: ``router.serve.client_fields.PREFILLER_HEADER``)
    <- request_headers answer: x-gateway-destination-endpoint + envoy.lb metadata (same value), clear_route_cache
    <- the body re-streamed in <= 62,000-byte chunks (with stream usage asked for, as the proxy asks)
    response_headers / response_body (passed through; usage parsed, the usage event the client did not ask for
    removed even when split across messages) -> TTFT, cached-token feedback, release

Body modes (from the gateway's ``protocol_config``): ``FULL_DUPLEX_STREAMED`` as above; ``BUFFERED`` (Envoy waits
for the headers' answer before it sends the whole body): the headers are answered with CONTINUE and the pick
comes on the body's answer; ``NONE``: the pick on the headers; other modes are refused at once (500
``unsupported_body_mode``), never a stall.

Errors are the kvroute error family (``router.errors``) rendered as ``ImmediateResponse`` s, with the same
statuses, OpenAI-style bodies and headers as the HTTP door: 400
malformed JSON / header / protocol error, 401 without a key, 404 / 405 outside the picker's routes, 408 a
request too slow, 413 over a limit, 422 invalid fields, 429 shed / overloaded, 431 headers over the limits, 503
no ready replica (or none in the subset hint, or over ``epp_max_streams``). Every replica of kvroute answers
(active-active): decisions share the index and the predicted entries through the KV-event / Redis fan-out, as
``kvroute serve`` replicas do.

Health: ``grpc.health.v1.Health`` with the services ``liveness`` (always serving), ``readiness``,
``envoy.service.ext_proc.v3.ExternalProcessor`` and ``""`` (serving while at least one replica is routable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from starlette.datastructures import Headers

from membership.ticks import sleep_to_next_due
from router.core.regions import hop_headers
from router.core.routing import NoReplica, Routed
from router.core.tenant_admission import Ticket
from router.engine.attempt import OPENAI
from router.engine.feedback import Feedback, usage_from_json, usage_from_sse
from router.engine.gaps import FRAMEWORK_NOT_FOUND
from router.engine.hold import Hold
from router.engine.sse import UsageStripper, ask_for_usage
from router.epp import codec
from router.epp.tls import server_credentials
from router.errors import REASON_HEADER, TRACE_ID_HEADER, KvrouteError, as_error, error_body
from router.pd.legs import Handoff
from router.serve.endpoints import ENGINE_POST_ROUTES, response_route
from router.serve.guard import PICKER_ROUTES, authorize, normalize_path
from router.serve.pipeline import Pipeline, Prepared
from router.serve.requests import new_request_id
from router.telemetry import EppMetrics, current_trace_id
from router.tracing import TRACEPARENT, RequestTrace, caller_trace_id, first_byte

log = logging.getLogger("kvroute.epp")

#: response headers naming a disaggregated plan's prefill replica and the plan (as the HTTP door names them)
PREFILL_REPLICA_HEADER = "x-kvroute-prefill-replica"
PLAN_HEADER = "x-kvroute-plan"
#: the gRPC service names the gateway's health checks may ask for
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS_SERVICE = "liveness"
READINESS_SERVICE = "readiness"
#: bytes kept from the end of a streamed response (the usage chunk is there), as the proxy keeps
_TAIL_BYTES = 16384
#: room in one gRPC message beyond the largest request body: the message's headers and framing, bytes
_MESSAGE_HEADROOM_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class EppConfig:
    """What the endpoint picker reads from the configuration, under the ``Settings`` field names; ``router.services``
    builds it from the picker, client-edge, engine-edge, server and membership sub-configs (no defaults here)."""

    #: the gRPC server: bind address (the server's ``host``), port, TLS or plaintext, streams per connection
    host: str
    epp_grpc_port: int
    epp_grpc_insecure: bool
    epp_tls_cert_file: str
    epp_tls_key_file: str
    epp_max_streams_per_connection: int
    #: gateway streams open at once; a request's deadline and slowest body rate (s, bytes/s)
    epp_max_streams: int
    epp_request_timeout_s: float
    epp_min_body_rate_bytes_per_s: float
    epp_body_rate_grace_s: float
    #: the client edge's limits (bytes, header count) and its Retry-After (s)
    max_request_bytes: int
    max_header_bytes: int
    max_header_count: int
    retry_after_s: int
    #: the engine edge: ask engines for stream usage; largest response body or SSE event kept (bytes)
    engine_stream_usage: bool
    engine_max_body_bytes: int
    #: stop: grace for streams in progress (s); readiness re-checked every probe interval (s)
    shutdown_grace_s: float
    probe_interval_s: float
    #: the key sent to peer regions' routers with a hop (``peer_api_keys``' first); None: none
    peer_key: str | None


class EndpointPicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The ``ExternalProcessor`` servicer: one ``_Stream`` per gateway stream, all on the serving pipeline.

    Args:
        pipeline: the serving pipeline (the same steps as the HTTP door's: never a second copy of the logic).
        feedback: usage and TTFT feedback when a response has passed through.
        config: what the picker reads from the configuration.
    """

    def __init__(self, pipeline: Pipeline, feedback: Feedback, config: EppConfig) -> None:
        self.pipeline = pipeline
        self.feedback = feedback
        #: the prefill/decode legs (the picker runs a disaggregated plan's prefill side itself)
        self.pd = pipeline.dispatcher.pd
        self.config = config
        self.telemetry = pipeline.telemetry
        self.table = pipeline.table
        self.router = pipeline.router
        self.auth = pipeline.gate.auth
        metrics = EppMetrics(self.telemetry.registry)
        self.streams, self.protocol_errors = metrics.streams, metrics.protocol_errors
        #: gateway streams open now (one per HTTP request the gateway is processing; rendered by telemetry)
        self.active = 0
        #: work started when a response ended (the Responses API's map writes), kept until done
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` on its own (a reference kept until it is done; a failure is logged)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("endpoint picker: background work failed", exc_info=t.exception())

        task.add_done_callback(done)

    async def Process(
        self,
        request_iterator: AsyncIterator[Any],  # noqa: N802  (the gRPC method name)
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[Any]:
        """One HTTP request's ext_proc stream: answers each message as the protocol requires; a request that does
        not arrive in time (``_Stream.read_timeout``) is answered 408."""
        if self.active >= self.config.epp_max_streams:
            yield self._over_capacity()
            return
        stream = _Stream(self)
        self.active += 1
        messages = request_iterator.__aiter__()
        try:
            while not stream.closed:
                timeout = stream.read_timeout()
                try:
                    if timeout is None:
                        msg = await messages.__anext__()
                    else:
                        msg = await asyncio.wait_for(messages.__anext__(), timeout)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    answers = stream.timed_out()
                else:
                    answers = await stream.on(msg)
                for answer in answers:
                    yield answer
        finally:
            self.active -= 1
            stream.finish()

    def _over_capacity(self) -> Any:
        """The answer to a stream over ``epp_max_streams``: 503 with Retry-After, before reading anything."""
        config = self.config
        self.streams.labels("503").inc()
        self.telemetry.rejected.labels("too_many_streams").inc()
        message = f"the endpoint picker has {self.active} streams open (epp_max_streams); retry shortly"
        headers = {
            "content-type": "application/json",
            REASON_HEADER: "too_many_streams",
            "retry-after": str(config.retry_after_s),
        }
        return codec.immediate(
            503, error_body(503, message, "too_many_streams"), headers.items(), "too_many_streams"
        )


#: a stream's phases: nothing yet, the request arriving, the request answered (the pick made, or refused)
_START, _REQUEST, _PICKED = 0, 1, 2


class _Stream:
    """The state of one gateway stream (one HTTP request): request, decision, hold, response accounting.

    One request per stream: request headers, then (unless they end the request) the body until ``end_of_stream``
    or the trailers, and one pick. A second request phase, a body or response before any request, or an empty
    message is a protocol error (answered 400 ``protocol_error``, counted, the stream ended). The replica's hold
    and the admission ticket are released exactly once (``finish``) whatever happens."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.pipeline = picker.pipeline
        self.config = picker.config
        self.phase = _START
        self.started = time.monotonic()
        # body send modes: from the gateway's protocol_config, when it sends one
        self.request_mode = codec.FULL_DUPLEX_STREAMED
        self.response_mode = codec.FULL_DUPLEX_STREAMED
        self.configured = False
        self.headers: dict[str, str] = {}
        self.path = "/"  # the normalized :path (router.serve.guard.normalize_path)
        self.subset: list[str] | None = None
        self.body = bytearray()  # the request body so far (one buffer: tiny messages cost their size)
        self.trailers_due = False  # trailers may follow the pick (BUFFERED body without end_of_stream, NONE)
        self.closed = False
        self.ticket: Ticket | None = (
            None  # the admission slot (router/core/tenant_admission.py), held to the end
        )
        self.hold: Hold | None = None
        #: a disaggregated plan's decode leg waiting on its decode replica until the response's first byte (or
        #: its end): (replica index, ``Router.note_handoff`` handle)
        self.decode_leg: tuple[int, int] | None = None
        self.routed: Routed | None = None
        #: the request's trace (``router.tracing``; None: tracing off, or not prepared)
        self.trace: RequestTrace | None = None
        #: the request's trace id (32 hex digits; tracing on: its trace's, off: a valid caller's ``traceparent``'s),
        #: named in the client's answer (``x-kvroute-trace-id``, ``error.trace_id``); None: it has none
        self.trace_id: str | None = None
        #: prompt tokens the served replica was expected to reuse (feedback), tokens
        self.predicted_cached = 0
        #: response headers naming how the request was served (replica, prefill replica, plan)
        self.served_headers: dict[str, str] = {}
        self.request_id = ""
        self.stream = False  # the client asked for a streamed answer
        self.strip_usage = False  # the picker asked for stream usage the client did not ask for
        self.sent_at = 0.0  # when the decision went back to the gateway (monotonic s)
        self.ttft: float | None = None
        self.status = 0
        self.event_stream = False
        self.response_seen = False  # response headers (or, when the gateway skips them, body) arrived
        self.response_over = False
        self.content_length: str | None = None  # the engine's Content-Length (BUFFERED replacements reset it)
        self.stripper: UsageStripper | None = None
        self.tail = bytearray()
        self.body_parts: list[bytes] = []
        self.body_size = 0
        self.finished = False
        #: how the request goes to the engine (``router.engine.attempt.Wire``: its answer's reader, if any)
        self.wire = OPENAI

    # -- dispatch ------------------------------------------------------------------------------------------
    async def on(self, msg: Any) -> list[Any]:
        """The answers to one ``ProcessingRequest``."""
        if not self.configured:
            self.configured = True
            modes = codec.body_modes(msg)
            if modes is not None:
                self.request_mode, self.response_mode = modes
        kind = msg.WhichOneof("request")
        if kind == codec.REQUEST_HEADERS:
            return await self._on_request_headers(msg)
        if kind == codec.REQUEST_BODY:
            return await self._on_request_body(msg)
        if kind == codec.REQUEST_TRAILERS:
            return await self._on_request_trailers(msg)
        if kind is None:
            return self._protocol_error("empty_message", "an ext_proc message with nothing in it")
        if self.phase != _PICKED or self.hold is None:
            return self._protocol_error("response_before_request", f"{kind} before any routed request")
        if self.response_over:
            return self._protocol_error("after_response", f"{kind} after the end of the response")
        if kind == codec.RESPONSE_HEADERS:
            return self._on_response_headers(msg.response_headers)
        if kind == codec.RESPONSE_BODY:
            return self._on_response_body(msg.response_body.body, msg.response_body.end_of_stream)
        return self._on_response_trailers()

    def _protocol_error(self, reason: str, message: str) -> list[Any]:
        """Answer a message out of the protocol with 400 ``protocol_error`` and end the stream (counted)."""
        self.picker.protocol_errors.labels(reason).inc()
        log.warning("endpoint picker: protocol error", extra={"reason": reason, "detail": message})
        return self._refuse(
            KvrouteError(f"ext_proc protocol error: {message}", status=400, code="protocol_error")
        )

    # -- the request ---------------------------------------------------------------------------------------
    async def _on_request_headers(self, msg: Any) -> list[Any]:
        """The request headers: checked and authorized at once; the pick now when no body follows (or the gateway
        sends none), else the body is awaited (BUFFERED: after a plain CONTINUE, which Envoy waits for)."""
        if self.phase != _START:
            return self._protocol_error("second_request", "request headers after the request's own")
        self.phase = _REQUEST
        config = self.config
        try:
            self.headers = codec.headers_of(
                msg.request_headers,
                strict=True,
                max_bytes=config.max_header_bytes,
                max_count=config.max_header_count,
            )
        except codec.HeaderError as exc:
            return self._refuse(exc)
        if TRACEPARENT in self.headers:
            self.trace_id = caller_trace_id(self.headers[TRACEPARENT])
        self._take_subset(msg.metadata_context)
        refusal = self._authorize() or self._mode_refusal()
        if refusal is not None:
            return self._refuse(refusal)
        if msg.request_headers.end_of_stream or self.request_mode == codec.NONE:
            # NONE: the body goes upstream unseen, its trailers (when the gateway sends them) come after the pick
            self.trailers_due = not msg.request_headers.end_of_stream
            return await self._pick(None)
        if self.request_mode == codec.BUFFERED:
            return [codec.continue_headers()]
        return []

    def _authorize(self) -> KvrouteError | None:
        """The front doors' one authorization decision (``router.serve.guard.authorize``) on the normalized request."""
        raw = self.headers.get(":path")
        if not raw:
            return KvrouteError(
                "the request has no :path", status=400, code="missing_path", counted_as="missing_path"
            )
        self.path = normalize_path(raw)
        denial = authorize(
            self.picker.auth,
            self.headers.get(":method", ""),
            self.path,
            self.headers.get("authorization"),
            PICKER_ROUTES,
        )
        if denial is not None:
            denial.counted_as = denial.code
        return denial

    def _mode_refusal(self) -> KvrouteError | None:
        """A request body mode the picker cannot answer in without stalling the gateway (STREAMED: Envoy sends
        the headers upstream once answered, before any body; partial modes) -> 500 at once, naming the modes."""
        if self.request_mode in (codec.FULL_DUPLEX_STREAMED, codec.BUFFERED, codec.NONE):
            return None
        name = codec.mode_name(self.request_mode)
        self.picker.protocol_errors.labels("unsupported_body_mode").inc()
        return KvrouteError(
            f"the gateway sends request bodies in {name} mode; the endpoint picker needs FULL_DUPLEX_STREAMED "
            "or BUFFERED (ext_proc processing_mode.request_body_mode)",
            status=500,
            code="unsupported_body_mode",
        )

    def _take_subset(self, metadata_context: Any) -> None:
        """The gateway's subset hint, when this message carries one (the headers', or the final body message's)."""
        hint = codec.subset_hint(metadata_context)
        if hint is not None:
            self.subset = hint

    async def _on_request_body(self, msg: Any) -> list[Any]:
        """Buffer one request body chunk; pick at the end of the body (BUFFERED: Envoy sends it whole, in one
        message, without ``end_of_stream`` when trailers follow)."""
        if self.phase == _START:
            return self._protocol_error("body_before_headers", "a request body before the request headers")
        if self.phase != _REQUEST:
            return self._protocol_error("second_request", "request body after the request was answered")
        part = msg.request_body
        chunk, end = part.body, part.end_of_stream
        if chunk:
            limit = self.config.max_request_bytes
            if len(self.body) + len(chunk) > limit:
                return self._refuse(
                    KvrouteError(
                        f"request body over {limit} bytes (max_request_bytes)",
                        status=413,
                        code="request_too_large",
                        counted_as="body_too_large",
                    )
                )
            self.body += chunk
        buffered = self.request_mode == codec.BUFFERED
        if not end and not buffered:
            return []
        self._take_subset(msg.metadata_context)
        self.trailers_due = buffered and not end
        return await self._pick(self._take_body())

    async def _on_request_trailers(self, msg: Any) -> list[Any]:
        """Request trailers: they end a body that had no ``end_of_stream`` (the pick then, answered in order:
        headers, body, trailers); in BUFFERED mode they follow the body's answer."""
        if self.phase == _START:
            return self._protocol_error(
                "trailers_before_headers", "request trailers before the request headers"
            )
        if self.phase == _PICKED:
            if not self.trailers_due:
                return self._protocol_error(
                    "second_request", "request trailers after the request was answered"
                )
            self.trailers_due = False
            return [codec.trailers(request=True)]
        if self.request_mode == codec.BUFFERED:  # trailers and no body: the headers went on unrouted
            return self._refuse(
                KvrouteError(
                    "a request with trailers and no body cannot be routed (BUFFERED)",
                    status=400,
                    code="invalid_request",
                )
            )
        self._take_subset(msg.metadata_context)
        return await self._pick(self._take_body(), trailers=True)

    def _take_body(self) -> bytes:
        body = bytes(self.body)
        self.body = bytearray()
        return body

    def read_timeout(self) -> float | None:
        """How long the next message may take, s (None: no limit). While the request arrives: until its deadline
        (``epp_request_timeout_s`` from the stream's start) or, for a body streamed in pieces, until its average
        rate since the stream's start would fall under ``epp_min_body_rate_bytes_per_s`` (checked once
        ``epp_body_rate_grace_s`` have passed), whichever comes first."""
        if self.phase == _PICKED:
            return None
        config = self.config
        due = self.started + config.epp_request_timeout_s
        rate = config.epp_min_body_rate_bytes_per_s
        if rate > 0 and self.phase == _REQUEST and self.request_mode == codec.FULL_DUPLEX_STREAMED:
            due = min(due, self.started + max(config.epp_body_rate_grace_s, len(self.body) / rate))
        return max(0.0, due - time.monotonic())

    def _rate_bound_first(self) -> bool:
        """Whether the minimum body rate, not the request deadline, set the wait that just ran out (decided from
        the deadlines themselves, not from the clock: a loop timer may fire a little early or late)."""
        config = self.config
        rate = config.epp_min_body_rate_bytes_per_s
        if rate <= 0 or self.phase != _REQUEST or self.request_mode != codec.FULL_DUPLEX_STREAMED:
            return False
        return max(config.epp_body_rate_grace_s, len(self.body) / rate) < config.epp_request_timeout_s

    def timed_out(self) -> list[Any]:
        """The request did not arrive in time: 408 (``request_timeout`` past the deadline, else
        ``body_too_slow``), the stream ended."""
        config = self.config
        if not self._rate_bound_first():
            code = "request_timeout"
            message = (
                f"the request did not arrive within {config.epp_request_timeout_s:g}s (epp_request_timeout_s)"
            )
        else:
            code = "body_too_slow"
            message = (
                f"the request body arrives at under {config.epp_min_body_rate_bytes_per_s:g} bytes/s "
                f"({len(self.body)} bytes in {time.monotonic() - self.started:.1f}s; "
                "epp_min_body_rate_bytes_per_s)"
            )
        return self._refuse(KvrouteError(message, status=408, code=code, counted_as=code))

    # -- the decision --------------------------------------------------------------------------------------
    async def _pick(self, body: bytes | None, *, trailers: bool = False) -> list[Any]:
        """Route the request (``body`` None: headers only) through the serving pipeline and answer with the
        destination and the body."""
        self.phase = _PICKED
        pipeline = self.pipeline
        self.request_id = new_request_id(self.headers.get("x-request-id"))
        try:
            await pipeline.guard(
                self.headers.get(":method", "POST"), self.path, self.headers.get("authorization")
            )
            prepared = await self._prepare(body)
            self.trace = prepared.inp.trace
            excluded = [*self._outside_subset(), *pipeline.not_serving(prepared.path)]
            admitted = await pipeline.admit(prepared.inp, excluded)
        except Exception as exc:  # every failure is an ImmediateResponse, never a broken stream
            if self.trace is None and pipeline.tracing is not None:  # refused while prepared: its trace's id
                self.trace_id = current_trace_id() or self.trace_id
            return self._refuse(self._refusal(exc))
        self.ticket = admitted.ticket
        routed = admitted.routed
        pd = self.picker.pd
        if (
            pd is not None and routed.plan is not None
        ):  # a prefill/decode fleet: dispatch chosen from the plan
            if not routed.disaggregated:
                pd.count_in_place(routed)
            else:
                try:
                    return await self._disaggregated(routed, body, prepared.body, trailers)
                except Exception as exc:  # a bug: answered, never a broken stream
                    return self._refuse(self._refusal(exc))
        return self._in_place(routed, routed.decision.chosen, body, prepared.body, trailers)

    async def _disaggregated(
        self, routed: Routed, body: bytes | None, clean: bytes, trailers: bool
    ) -> list[Any]:
        """A disaggregated plan: the picker runs its prefill side (``router.pd.legs.PdLegs.handoff``, the same
        protocol runners the HTTP door uses) and hands the gateway the decode request: the decode replica as the
        destination, the decode leg's body (the prefill's ``kv_transfer_params``, or the bootstrap fields) and
        headers. A failed prefill side (after retries) or a request without a body is served in place."""
        pd = self.picker.pd
        assert pd is not None
        if body is None:  # headers only: nothing to hand over
            ranking = pd.fall_back(
                routed, None, "no_body", "a request without a body cannot be disaggregated", self.request_id
            )
        else:
            out = await pd.handoff(routed, self.path, clean, self.stream, self.request_id)
            if isinstance(out, Handoff):
                return self._handed_over(routed, out, body, trailers)
            ranking = out
        if not ranking:
            return self._refuse(NoReplica("the disaggregated plan failed and no replica can serve in place"))
        return self._in_place(routed, ranking[0], body, clean, trailers)

    def _handed_over(self, routed: Routed, h: Handoff, body: bytes, trailers: bool) -> list[Any]:
        """Answer with the decode request: destination the decode replica, its body and headers; D's hold
        (handed over by the legs) released when the response ends."""
        self.routed, self.hold = routed, h.hold
        if h.decode_leg is not None:
            self.decode_leg = (h.decode.index, h.decode_leg)
        self.predicted_cached, self.strip_usage = h.cached_p, h.strip_usage
        self.served_headers = {
            codec.REPLICA_HEADER: h.decode.name,
            PREFILL_REPLICA_HEADER: h.prefill.name,
            PLAN_HEADER: "disaggregated",
        }
        extra = {"x-request-id": routed.inp.request_id, **h.headers}
        return self._answer(codec.endpoint_of(h.decode.url), extra, body, h.body, trailers)

    def _in_place(
        self, routed: Routed, index: int, body: bytes | None, clean: bytes, trailers: bool
    ) -> list[Any]:
        """Serve on replica ``index`` in place: hold it, and answer with it as the destination (the body with
        stream usage asked for, as the proxy asks)."""
        router = self.picker.router
        rep = self.picker.table.by_index(index)
        if rep is None:  # the replica left between the decision and now
            return self._refuse(NoReplica("the chosen replica left; retry"))
        inp = routed.inp
        self.routed = routed
        self.predicted_cached = routed.cached_tokens.get(rep.index, 0)
        # the attempt's hold (no dispatch gate here): counted in flight now, released by ``finish()``
        self.hold = Hold(router, None, rep, inp.prompt_tokens - self.predicted_cached, inp.copies, inp.lora)
        self.hold.__enter__().hand_over()
        router.record_prediction(rep, inp.keys)
        self.served_headers = {codec.REPLICA_HEADER: rep.name}
        payload = None if body is None else clean
        if (
            payload is not None
            and self.stream
            and self.config.engine_stream_usage
            and self.wire.openai_stream
        ):
            payload, self.strip_usage = ask_for_usage(payload)
        extra = {"x-request-id": inp.request_id}
        if rep.is_peer:  # another region's router: the hop (never forwarded again), residency and session
            st = self.pipeline.config
            extra.update(
                hop_headers(
                    st.region, inp.allowed_regions, st.session_header, inp.session_id, self.config.peer_key
                )
            )
        trace = self.trace
        if trace is not None:  # the attempt's span, ended with the hold; the engine's traceparent names it
            self.hold.span = trace.child(
                "kvroute.attempt",
                {
                    "kvroute.replica": rep.name,
                    "server.address": rep.url,
                    "kvroute.attempt": 1,
                    "kvroute.predicted.cached_tokens": self.predicted_cached,
                },
                client=True,
            )
            extra.update(trace.headers(self.hold.span))
        return self._answer(codec.endpoint_of(rep.url), extra, body, payload, trailers)

    async def _prepare(self, body: bytes | None) -> Prepared:
        """Parse, identify and tokenize as the HTTP door does for the path (headers only: routed by load; the
        engines' other endpoints as ``Pipeline.prepare_engine`` prepares them)."""
        headers = Headers(headers={k: v for k, v in self.headers.items() if not k.startswith(":")})
        if self.path in ENGINE_POST_ROUTES or response_route(self.path) is not None:
            raw_path = self.headers.get(":path", "")
            prepared = await self.pipeline.prepare_engine(
                self.headers.get(":method", "POST"),
                self.path,
                headers,
                body or b"",
                query=raw_path.partition("?")[2],
                content_type=self.headers.get("content-type"),
            )
        elif body is None:
            prepared = self.pipeline.prepare_headers_only(headers)
        else:
            prepared = await self.pipeline.prepare(self.path, headers, body)
        prepared.inp.request_id = self.request_id
        if prepared.inp.trace is not None:
            prepared.inp.trace.set("kvroute.request_id", self.request_id)
            self.trace_id = prepared.inp.trace.trace_hex or None
        self.stream = prepared.stream
        self.wire = prepared.wire
        return prepared

    def _answer(
        self, endpoint: str, extra: dict[str, str], body: bytes | None, payload: bytes | None, trailers: bool
    ) -> list[Any]:
        """The answers naming ``endpoint`` (with ``extra`` request headers), in the request body mode: full duplex
        re-streams the body (``payload`` when it changed) after the headers' answer; BUFFERED answers the body
        message."""
        changed = payload is not None and payload is not body
        self.sent_at = time.monotonic()
        self.picker.streams.labels("200").inc()
        if body is not None and self.request_mode == codec.BUFFERED:
            return [codec.routed_body(endpoint, extra, payload if changed else None)]
        answers = [
            codec.routed_headers(endpoint, extra, len(payload) if changed and payload is not None else None)
        ]
        if body is not None and self.request_mode == codec.FULL_DUPLEX_STREAMED:
            sent = payload if payload is not None else body
            answers.extend(codec.body_chunks(sent, request=True, end_of_stream=not trailers))
        if trailers:
            answers.append(codec.trailers(request=True))
        return answers

    def _outside_subset(self) -> Sequence[int]:
        """Replica indexes the subset hint rules out (none without a hint).

        Raises:
            KvrouteError: 503 when the hint is empty or names no known replica.
        """
        if self.subset is None:
            return ()
        allowed = set(self.subset)
        reps = self.picker.table.all()
        inside = [r for r in reps if codec.endpoint_of(r.url) in allowed]
        if not inside:
            raise KvrouteError(
                f"no replica is among the gateway's subset hint ({len(allowed)} endpoints)",
                status=503,
                code="no_endpoint_in_subset",
                retry=True,
            )
        return [r.index for r in reps if codec.endpoint_of(r.url) not in allowed]

    # -- refusals ------------------------------------------------------------------------------------------
    def _refusal(self, exc: Exception) -> KvrouteError:
        """A failure as a member of the kvroute error family (the one table, ``router.errors.as_error``); a bug is
        logged and answered 500."""
        err = as_error(exc)
        if not isinstance(exc, KvrouteError):
            log.exception("endpoint picker failed", exc_info=exc)
        return err

    def _refuse(self, err: KvrouteError) -> list[Any]:
        """Answer ``err`` with an ImmediateResponse (the HTTP answer's status, body and headers, plus the reason
        header) and end the stream; counted."""
        self.closed = True
        self.picker.streams.labels(str(err.status)).inc()
        if self.trace is not None:
            self.trace.fail(err)
        if err.counted_as is not None:
            self.picker.telemetry.rejected.labels(err.counted_as).inc()
        headers = {
            "content-type": "application/json",
            REASON_HEADER: err.details,
            **err.answer_headers(self.config.retry_after_s),
        }
        if self.request_id:
            headers["x-request-id"] = self.request_id
        if self.trace_id is not None:
            headers[TRACE_ID_HEADER] = self.trace_id
        return [codec.immediate(err.status, err.body(self.trace_id), headers.items(), err.details)]

    # -- the response path ---------------------------------------------------------------------------------
    def _on_response_headers(self, msg: Any) -> list[Any]:
        """The engine's status and content type; the served replica's name goes back to the client."""
        if self.response_seen:
            return self._protocol_error("second_response", "response headers after the response's own")
        self.response_seen = True
        h = codec.headers_of(msg)
        self.status = _status_of(h.get(":status", "200"))
        if self.status == 0:
            self.picker.protocol_errors.labels("bad_status").inc()  # answered and passed on, never fatal
        self.event_stream = h.get("content-type", "").startswith("text/event-stream")
        self.content_length = h.get("content-length")
        self._strip_if_asked()
        extra = self.served_headers
        if self.trace_id is not None:
            extra = {**extra, TRACE_ID_HEADER: self.trace_id}
        if msg.end_of_stream:
            self.response_over = True
            self._first_byte()
            self._complete()
        return [codec.response_headers(extra)]

    def _strip_if_asked(self) -> None:
        if self.event_stream and self.strip_usage and self.stripper is None:
            self.stripper = UsageStripper(self.config.engine_max_body_bytes)

    def _on_response_body(self, chunk: bytes, end: bool) -> list[Any]:
        """Pass one response chunk through (removing usage the client did not ask for, an event split across
        messages held until its end arrives); account at the end. Answered in the response body mode."""
        if not self.response_seen:  # the gateway skips response headers: a streamed request gets a stream
            self.response_seen = True
            self.event_stream = self.stream
            self._strip_if_asked()
        self._first_byte()
        if self.event_stream:
            self.tail += chunk
            if len(self.tail) > 2 * _TAIL_BYTES:
                del self.tail[:-_TAIL_BYTES]
            watch = self.wire.watch
            if watch is not None and 0 < self.status < 400 and self.hold is not None:
                watch.feed(self.hold.rep, chunk)
        elif self.body_size <= self.config.engine_max_body_bytes:
            self.body_parts.append(chunk)
            self.body_size += len(chunk)
        out = chunk
        whole = end or self.response_mode == codec.BUFFERED  # BUFFERED: the whole body in one message
        if self.stripper is not None:
            out = self.stripper.feed(chunk)
            rest = self.stripper.flush() if whole else b""
            if rest:
                out = out + rest
        if end:
            self.response_over = True
            self._complete()
        if self.response_mode == codec.FULL_DUPLEX_STREAMED:
            # every message is answered (an empty chunk too): the gateway sends the client only what comes back
            return list(codec.body_chunks(out, request=False, end_of_stream=end))
        if out is chunk:
            return [codec.body_answer(None, request=False)]
        held = {"content-length": str(len(out))} if whole and self.content_length is not None else None
        return [codec.body_answer(out, request=False, headers=held)]

    def _on_response_trailers(self) -> list[Any]:
        """Response trailers end the response (what an unfinished event held back goes first, full duplex)."""
        answers: list[Any] = []
        rest = self.stripper.flush() if self.stripper is not None else b""
        if rest and self.response_mode == codec.FULL_DUPLEX_STREAMED:
            answers.extend(codec.body_chunks(rest, request=False, end_of_stream=False))
        self.response_over = True
        self._first_byte()
        self._complete()
        answers.append(codec.trailers(request=False))
        return answers

    def _first_byte(self) -> None:
        """The first response byte: TTFT (from the decision going back), prefill tokens released, a decode leg
        no longer waiting."""
        self._decode_leg_over()
        if self.ttft is not None or self.hold is None:
            return
        self.ttft = time.monotonic() - self.sent_at
        self.hold.first_byte()
        if self.hold.span is not None:
            first_byte(self.hold.span, self.status, self.ttft)
        if 0 < self.status < 400:
            self.picker.telemetry.ttft.labels(self.hold.rep.name).observe(self.ttft)

    def _complete(self) -> None:
        """The response is over: usage -> cached-token feedback and calibration, then release (as the proxy)."""
        hold, routed = self.hold, self.routed
        if hold is None or routed is None or self.finished:
            return
        try:
            if 0 < self.status < 400:
                if self.wire.feedback:
                    self._feedback(hold, routed)
                self._read_answer(hold)
            elif self.status == 404:
                self._learn_gap(hold)
        except Exception:
            log.exception("endpoint picker feedback failed")
        finally:
            self.finish()

    def _learn_gap(self, hold: Hold) -> None:
        """The engine answered its framework's bare 404: it does not serve the path (``router.engine.gaps``); the
        next requests for it are decided without that replica (this one's answer has gone to the client)."""
        gaps = self.picker.pipeline.dispatcher.in_place.gaps
        if gaps is not None and b"".join(self.body_parts).strip() in FRAMEWORK_NOT_FOUND:
            gaps.learn(hold.rep.name, self.path)

    def _read_answer(self, hold: Hold) -> None:
        """The request's answer reader (a Responses API answer: the chain's maps) gets a non-streamed body whole,
        then the end of the answer (the map writes run on their own)."""
        watch = self.wire.watch
        if watch is None:
            return
        if not self.event_stream and self.body_size <= self.config.engine_max_body_bytes:
            watch.feed(hold.rep, b"".join(self.body_parts))
        self.picker.spawn(watch.complete(hold.rep))

    def _feedback(self, hold: Hold, routed: Routed) -> None:
        feedback = self.picker.feedback
        cached = self.predicted_cached
        if self.event_stream:
            usage = usage_from_sse(bytes(self.tail))
            feedback.check_usage(hold.rep, usage, streamed=True)
            feedback.observe(hold.rep, routed, usage, self.ttft or 0.0, cached, single_chunk=False)
        elif self.body_size <= self.config.engine_max_body_bytes:
            usage = usage_from_json(b"".join(self.body_parts))
            feedback.check_usage(hold.rep, usage, streamed=False)
            feedback.observe(hold.rep, routed, usage, self.ttft or 0.0, cached, single_chunk=not self.stream)

    def _decode_leg_over(self) -> None:
        """The decode leg the gateway sends no longer waits on its replica (idempotent)."""
        if self.decode_leg is not None:
            self.picker.router.decode_leg_started(*self.decode_leg)
            self.decode_leg = None

    def finish(self) -> None:
        """Release the replica's in-flight count and the admission slot (idempotent; stream end or cancel)."""
        self._decode_leg_over()  # (a gateway that sends no response phase: the leg waited until the end)
        if self.finished:
            return
        self.finished = True
        self.body = bytearray()
        if self.hold is not None:
            self.hold.release()
        if self.ticket is not None:
            self.ticket.release()
        trace = self.trace
        if trace is not None:
            if self.status:
                trace.respond(self.status)
            trace.close()


def _status_of(value: str) -> int:
    """An HTTP status from a ``:status`` header, 0 when it is not one (counted, never fatal)."""
    value = value.strip()
    if value.isdigit() and len(value) == 3:
        return int(value)
    return 0


# -------------------------------------------------------------------------------------------------------------
# the server
# -------------------------------------------------------------------------------------------------------------


class EppServer:
    """The gRPC server (ext_proc + grpc.health.v1) on ``epp_grpc_port``, in the HTTP app's event loop.

    ``start`` / ``stop`` are a background pair of ``router.services`` (started after membership, stopped first).
    """

    def __init__(self, pipeline: Pipeline, feedback: Feedback, config: EppConfig) -> None:
        """Raises ValueError when the configured certificate and key do not load (``router.epp.tls``)."""
        self.config = config
        self.table = pipeline.table
        self.picker = EndpointPicker(pipeline, feedback, config)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._ready_task: asyncio.Task[None] | None = None
        config = self.config
        self.credentials = server_credentials(
            config.epp_grpc_insecure, config.epp_tls_cert_file, config.epp_tls_key_file
        )

    async def start(self) -> None:
        """Bind (TLS unless ``epp_grpc_insecure``), start serving and keep the readiness services current."""
        config = self.config
        server = grpc.aio.server(
            options=[
                ("grpc.max_concurrent_streams", config.epp_max_streams_per_connection),
                # a BUFFERED body comes whole in one message: room for the largest body plus its framing
                ("grpc.max_receive_message_length", config.max_request_bytes + _MESSAGE_HEADROOM_BYTES),
                ("grpc.max_send_message_length", config.max_request_bytes + _MESSAGE_HEADROOM_BYTES),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(self.picker, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        address = f"{config.host}:{config.epp_grpc_port}"
        if self.credentials is None:
            self.port = server.add_insecure_port(address)
        else:
            self.port = server.add_secure_port(address, self.credentials)
        if self.port == 0:
            raise OSError(f"cannot bind the endpoint picker's gRPC port {config.host}:{config.epp_grpc_port}")
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self._update_readiness()
        await server.start()
        self.server = server
        self._ready_task = asyncio.create_task(self._readiness_loop(), name="kvroute-epp-readiness")
        log.info(
            "endpoint picker listening",
            extra={"port": self.port, "tls": self.credentials is not None},
        )

    async def stop(self) -> None:
        """Stop answering (streams in progress get ``shutdown_grace_s`` to end)."""
        if self._ready_task is not None:
            self._ready_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ready_task
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(self.config.shutdown_grace_s)
            self.server = None

    def ready(self) -> bool:
        """At least one replica is routable (every EPP replica answers: no leader election)."""
        return any(r.routable for r in self.table.all())

    async def _update_readiness(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.ready()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in (READINESS_SERVICE, EXT_PROC_SERVICE, ""):
            await self.health.set(name, status)

    async def _readiness_loop(self) -> None:
        due = None  # at the whole multiples of the period (membership.ticks: with the health probes)
        while True:
            due = await sleep_to_next_due(self.config.probe_interval_s, due)
            try:
                await self._update_readiness()
            except Exception:
                log.exception("endpoint picker readiness update failed")
