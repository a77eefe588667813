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
    -> guard (loop-lag shedding) -> parse + tokenize + hash (the HTTP routes' own code) -> admission
    -> decision (the HTTP routes' own ``decide``: session affinity, subset hint as excluded replicas; the hint
       is read from the headers and from the final body message)
    -> in-flight accounting on the replica (acquired now, released when the response ends or the stream dies)
    <- request_headers answer: x-gateway-destination-endpoint + envoy.lb metadata (same value), clear_route_cache
    <- the body re-streamed in <= 62,000-byte chunks (with stream usage asked for, as the proxy asks)
    response_headers / response_body (passed through; usage parsed, the usage event the client did not ask for
    removed even when split across messages) -> TTFT, cached-token feedback, release

Body modes (from the gateway's ``protocol_config``): ``FULL_DUPLEX_STREAMED`` as above; ``BUFFERED`` (Envoy waits
for the headers' answer before it sends the whole body): the headers are answered with CONTINUE and the pick
comes on the body's answer; ``NONE``: the pick on the headers; other modes are refused at once (500
``unsupported_body_mode``), never a stall.

Errors are ``ImmediateResponse`` s with the same statuses and OpenAI-style bodies as the HTTP routes: 400
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
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from fastapi.exceptions import RequestValidationError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter
from starlette.requests import Request
from starlette.responses import Response

from policies.admission_slo import best_predicted_ttft_s, predicted_ttft_s
from router.core.admission import Rejected
from router.core.routing import NoReplica, Routed, RoutingError, RoutingInput
from router.core.tenant_admission import Ticket, bad_identity_response, rejection_response
from router.core.tenants import BadIdentity
from router.engine.proxy import _Hold, _usage_from_json, _usage_from_sse, ask_for_usage, new_request_id
from router.epp import codec
from router.epp.tls import server_credentials
from router.errors import error_body
from router.http.app import ChatRequest, CompletionRequest, _Auth, _BadTokens, _DataPlane, _parse
from router.serve.guard import PICKER_ROUTES, authorize, normalize_path
from router.serve.intake import LimitExceeded
from router.services import Services
from router.telemetry import gauge
from router.tokens.tokenizer import TokenizerError

log = logging.getLogger("kvroute.epp")

#: the gRPC service names the gateway's health checks may ask for
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS_SERVICE = "liveness"
READINESS_SERVICE = "readiness"
#: bytes kept from the end of a streamed response (the usage chunk is there), as the proxy keeps
_TAIL_BYTES = 16384
#: room in one gRPC message beyond the largest request body: the message's headers and framing, bytes
_MESSAGE_HEADROOM_BYTES = 1 << 20


class _Refused(Exception):
    """A request answered with an ImmediateResponse (status, stable code, message, extra headers; ``body``: the
    JSON to send when another module already built it, else an OpenAI-style error from the message)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}
        self.body = body

    @classmethod
    def of_response(cls, response: Response, code: str) -> _Refused:
        """The refusal answering like an HTTP ``response`` (status, body, headers but the framing ones)."""
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        body = bytes(response.body)
        return cls(response.status_code, code, body.decode("utf-8", "replace"), headers, body)


class EndpointPicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The ``ExternalProcessor`` servicer: one ``_Stream`` per gateway stream, all on the shared ``Services``."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc
        #: the HTTP routes' own parsing, tokenizing and deciding (never a second copy of the decision logic)
        self.dp = _DataPlane(svc, _Auth(svc.guard))
        self.streams = Counter(
            "kvroute_epp_requests",
            "endpoint-picker streams by outcome (HTTP status of the answer: 200 = routed)",
            ["status"],
            registry=svc.telemetry.registry,
        )
        self.protocol_errors = Counter(
            "kvroute_epp_protocol_errors",
            "ext_proc messages out of the protocol (answered 400 protocol_error, the stream ended), by reason",
            ["reason"],
            registry=svc.telemetry.registry,
        )
        #: gateway streams open now (one per HTTP request the gateway is processing)
        self.active = 0
        svc.telemetry.add_gauges(
            lambda: [
                gauge(
                    "kvroute_epp_streams_active",
                    "endpoint-picker streams open now (one per request the gateway is processing)",
                    float(self.active),
                )
            ]
        )

    async def Process(
        self,
        request_iterator: AsyncIterator[Any],  # noqa: N802  (the gRPC method name)
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[Any]:
        """One HTTP request's ext_proc stream: answers each message as the protocol requires; a request that does
        not arrive in time (``_Stream.read_timeout``) is answered 408."""
        if self.active >= self.svc.settings.epp_max_streams:
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
        settings = self.svc.settings
        self.streams.labels("503").inc()
        self.svc.telemetry.rejected.labels("too_many_streams").inc()
        message = f"the endpoint picker has {self.active} streams open (epp_max_streams); retry shortly"
        headers = {
            "content-type": "application/json",
            codec.REASON_HEADER: "too_many_streams",
            "retry-after": str(settings.retry_after_s),
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
        self.svc = picker.svc
        self.settings = picker.svc.settings
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
        self.hold: _Hold | None = None
        self.routed: Routed | None = None
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
        self.stripper: _UsageStripper | None = None
        self.tail = bytearray()
        self.body_parts: list[bytes] = []
        self.body_size = 0
        self.finished = False

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
        return self._refuse(_Refused(400, "protocol_error", f"ext_proc protocol error: {message}"))

    # -- the request ---------------------------------------------------------------------------------------
    async def _on_request_headers(self, msg: Any) -> list[Any]:
        """The request headers: checked and authorized at once; the pick now when no body follows (or the gateway
        sends none), else the body is awaited (BUFFERED: after a plain CONTINUE, which Envoy waits for)."""
        if self.phase != _START:
            return self._protocol_error("second_request", "request headers after the request's own")
        self.phase = _REQUEST
        settings = self.settings
        try:
            self.headers = codec.headers_of(
                msg.request_headers,
                strict=True,
                max_bytes=settings.max_header_bytes,
                max_count=settings.max_header_count,
            )
        except codec.HeaderError as exc:
            self.svc.telemetry.rejected.labels(exc.code).inc()
            return self._refuse(_Refused(exc.status, exc.code, exc.message))
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

    def _authorize(self) -> _Refused | None:
        """The front doors' one authorization decision (``router.serve.guard.authorize``) on the normalized request."""
        raw = self.headers.get(":path")
        if not raw:
            self.svc.telemetry.rejected.labels("missing_path").inc()
            return _Refused(400, "missing_path", "the request has no :path")
        self.path = normalize_path(raw)
        denial = authorize(
            self.svc.guard.auth,
            self.headers.get(":method", ""),
            self.path,
            self.headers.get("authorization"),
            PICKER_ROUTES,
        )
        if denial is None:
            return None
        self.svc.telemetry.rejected.labels(denial.code).inc()
        return _Refused(denial.status, denial.code, denial.message, dict(denial.headers))

    def _mode_refusal(self) -> _Refused | None:
        """A request body mode the picker cannot answer in without stalling the gateway (STREAMED: Envoy sends
        the headers upstream once answered, before any body; partial modes) -> 500 at once, naming the modes."""
        if self.request_mode in (codec.FULL_DUPLEX_STREAMED, codec.BUFFERED, codec.NONE):
            return None
        name = codec.mode_name(self.request_mode)
        self.picker.protocol_errors.labels("unsupported_body_mode").inc()
        return _Refused(
            500,
            "unsupported_body_mode",
            f"the gateway sends request bodies in {name} mode; the endpoint picker needs FULL_DUPLEX_STREAMED "
            "or BUFFERED (ext_proc processing_mode.request_body_mode)",
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
            limit = self.settings.max_request_bytes
            if len(self.body) + len(chunk) > limit:
                self.svc.telemetry.rejected.labels("body_too_large").inc()
                return self._refuse(
                    _Refused(413, "request_too_large", f"request body over {limit} bytes (max_request_bytes)")
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
                _Refused(
                    400, "invalid_request", "a request with trailers and no body cannot be routed (BUFFERED)"
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
        settings = self.settings
        due = self.started + settings.epp_request_timeout_s
        rate = settings.epp_min_body_rate_bytes_per_s
        if rate > 0 and self.phase == _REQUEST and self.request_mode == codec.FULL_DUPLEX_STREAMED:
            due = min(due, self.started + max(settings.epp_body_rate_grace_s, len(self.body) / rate))
        return max(0.0, due - time.monotonic())

    def _rate_bound_first(self) -> bool:
        """Whether the minimum body rate, not the request deadline, set the wait that just ran out (decided from
        the deadlines themselves, not from the clock: a loop timer may fire a little early or late)."""
        settings = self.settings
        rate = settings.epp_min_body_rate_bytes_per_s
        if rate <= 0 or self.phase != _REQUEST or self.request_mode != codec.FULL_DUPLEX_STREAMED:
            return False
        return max(settings.epp_body_rate_grace_s, len(self.body) / rate) < settings.epp_request_timeout_s

    def timed_out(self) -> list[Any]:
        """The request did not arrive in time: 408 (``request_timeout`` past the deadline, else
        ``body_too_slow``), the stream ended."""
        settings = self.settings
        if not self._rate_bound_first():
            code = "request_timeout"
            message = f"the request did not arrive within {settings.epp_request_timeout_s:g}s (epp_request_timeout_s)"
        else:
            code = "body_too_slow"
            message = (
                f"the request body arrives at under {settings.epp_min_body_rate_bytes_per_s:g} bytes/s "
                f"({len(self.body)} bytes in {time.monotonic() - self.started:.1f}s; "
                "epp_min_body_rate_bytes_per_s)"
            )
        self.svc.telemetry.rejected.labels(code).inc()
        return self._refuse(_Refused(408, code, message))

    # -- the decision --------------------------------------------------------------------------------------
    async def _pick(self, body: bytes | None, *, trailers: bool = False) -> list[Any]:
        """Route the request (``body`` None: headers only) and answer with the destination and the body."""
        self.phase = _PICKED
        try:
            await self._guard()
            request = self._request(body or b"")
            inp, payload = await self._input(request, body)
            routed = await self._admit_and_decide(inp, self._outside_subset())
        except Exception as exc:  # every failure is an ImmediateResponse, never a broken stream
            return self._refuse(self._refusal(exc))
        return self._routed(routed, body, payload, trailers)

    def _routed(self, routed: Routed, body: bytes | None, payload: bytes | None, trailers: bool) -> list[Any]:
        """Hold the replica, remember what the response path needs, and build the answers (in the request body
        mode: full duplex re-streams the body after the headers' answer; BUFFERED answers the body message)."""
        svc = self.svc
        rep = svc.table.by_index(routed.decision.chosen)
        if rep is None:  # the replica left between the decision and now
            return self._refuse(_Refused(503, NoReplica.code, "the chosen replica left; retry"))
        inp = routed.inp
        self.routed = routed
        # the proxy's own hold (no dispatch gate here): counted in flight now, released by ``finish()``
        self.hold = (
            _Hold(
                svc.router, None, rep, inp.prompt_tokens - routed.cached_tokens.get(rep.index, 0), inp.copies
            )
            .__enter__()
            .hand_over()
        )
        svc.router.record_prediction(rep, inp.keys)
        extra = {"x-request-id": inp.request_id}
        endpoint = codec.endpoint_of(rep.url)
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

    async def _guard(self) -> None:
        """The HTTP front gate on the headers (authorization again, loop-lag shedding): its answer becomes the
        refusal."""
        h = self.headers
        scope = {
            "type": "http",
            "method": h.get(":method", "POST"),
            "path": self.path,
            "raw_path": self.path.encode("latin-1", "replace"),
            "headers": [
                (k.encode("latin-1"), v.encode("latin-1")) for k, v in h.items() if not k.startswith(":")
            ],
        }
        sent: list[dict[str, Any]] = []

        async def capture(message: Any) -> None:
            sent.append(message)

        if await self.svc.guard.admit(scope, capture):
            return
        status = int(sent[0]["status"]) if sent else 503
        headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])} if sent else {}
        body = sent[1].get("body", b"") if len(sent) > 1 else b""
        try:
            err = orjson.loads(body)["error"]
            code, message = str(err.get("code")), str(err.get("message"))
        except (orjson.JSONDecodeError, KeyError, TypeError):
            code, message = "rejected", body.decode("utf-8", "replace")
        headers.pop("content-length", None)
        headers.pop("content-type", None)
        raise _Refused(status, code, message, headers)

    def _request(self, body: bytes) -> Request:
        """A Starlette request carrying the gateway's headers and the body, for the HTTP routes' own code."""
        h = self.headers
        scope = {
            "type": "http",
            "method": h.get(":method", "POST"),
            "path": self.path,
            "query_string": b"",
            "headers": [
                (k.encode("latin-1"), v.encode("latin-1")) for k, v in h.items() if not k.startswith(":")
            ],
        }
        request = Request(scope)
        request._body = body  # what Request.body() returns
        return request

    async def _input(self, request: Request, body: bytes | None) -> tuple[RoutingInput, bytes | None]:
        """Parse, tokenize and hash as the HTTP route for the path does; returns the routing input and the body
        to forward (with stream usage asked for, as the proxy asks; None: headers only)."""
        dp = self.picker.dp
        self.request_id = new_request_id(self.headers.get("x-request-id"))
        if body is None:
            return self._headers_only_input(request), None
        data_model = _model_for(self.path, body)
        if data_model is ChatRequest:
            chat, _ = await _parse(self.svc.intake, request, ChatRequest)
            inp = await dp.routing_input(
                request,
                chat,
                messages=chat.messages,
                chat={
                    "add_generation_prompt": chat.add_generation_prompt,
                    "tools": chat.tools,
                    "chat_template_kwargs": chat.chat_template_kwargs,
                },
                max_out=chat.max_completion_tokens,
            )
            self.stream = chat.stream
        else:
            comp, _ = await _parse(self.svc.intake, request, CompletionRequest)
            inp = await dp.routing_input(request, comp, prompt=comp.prompt)
            self.stream = comp.stream
        inp.request_id = self.request_id
        payload = request._body  # the body without router-controlled fields (router/serve/client_fields.py)
        if self.stream and self.settings.engine_stream_usage:
            payload, self.strip_usage = ask_for_usage(payload)
        return inp, payload

    def _headers_only_input(self, request: Request) -> RoutingInput:
        """A request without a body (no prompt): routed by load among the replicas of the model named by
        ``x-gateway-model-name`` (set by body-based routing), else of any routable replica's first model."""
        router = self.svc.router
        model = self.headers.get("x-gateway-model-name") or next(
            (r.models[0] for r in self.svc.table.all() if r.routable and r.models), None
        )
        if model is None:
            raise NoReplica("no routable replica")
        model, lora, base = router.resolve_model(model)
        return router.make_input(
            model,
            lora,
            [],
            base_model=base,
            session_id=request.headers.get(self.svc.settings.session_header),
            request_id=self.request_id,
        )

    def _outside_subset(self) -> Sequence[int]:
        """Replica indexes the subset hint rules out (none without a hint).

        Raises:
            _Refused: 503 when the hint is empty or names no known replica.
        """
        if self.subset is None:
            return ()
        allowed = set(self.subset)
        reps = self.svc.table.all()
        inside = [r for r in reps if codec.endpoint_of(r.url) in allowed]
        if not inside:
            raise _Refused(
                503,
                "no_endpoint_in_subset",
                f"no replica is among the gateway's subset hint ({len(allowed)} endpoints)",
                {"retry-after": str(self.svc.settings.retry_after_s)},
            )
        return [r.index for r in reps if codec.endpoint_of(r.url) not in allowed]

    async def _admit_and_decide(self, inp: RoutingInput, exclude: Sequence[int]) -> Routed:
        """Admission then the decision, in the HTTP data plane's order (``router.http.app._DataPlane._serve``): a
        request with a TTFT target is priced first (an unattainable target is refused, not queued); the tenant's
        quota and the fair in-flight queue (``router.core.tenant_admission``) give a slot held until the stream ends;
        the decision is taken (again) after any wait."""
        svc, dp = self.svc, self.picker.dp
        ident = inp.identity if inp.identity is not None else svc.tenants.identify(self.headers)
        routed: Routed | None = None
        if ident.ttft_target_s is not None:
            routed = await dp.decide(inp, exclude)
            svc.tenants.check_slo(
                ident, best_predicted_ttft_s(routed.decision.scores, routed.decision.ranking)
            )
        self.ticket = await svc.tenants.admit(ident, inp.prompt_tokens, inp.expected_output_tokens or None)
        if routed is None or self.ticket.waited_s > 0:
            routed = await dp.decide(inp, exclude)
        chosen = routed.decision.chosen
        score = next((sc for sc in routed.decision.scores if sc.index == chosen), None)
        svc.tenants.serving(
            ident, predicted_ttft_s(score) if score is not None else None, routed.cached_tokens.get(chosen, 0)
        )
        return routed

    # -- refusals ------------------------------------------------------------------------------------------
    def _refusal(self, exc: Exception) -> _Refused:
        """The ImmediateResponse for a failure, with the status and code the HTTP routes answer."""
        retry = {"retry-after": str(self.svc.settings.retry_after_s)}
        telemetry = self.svc.telemetry
        if isinstance(exc, _Refused):
            return exc
        if isinstance(exc, Rejected):
            telemetry.rejected.labels(exc.reason).inc()
            return _Refused.of_response(
                rejection_response(exc, self.svc.settings.retry_after_s), exc.wire_reason
            )
        if isinstance(exc, BadIdentity):
            telemetry.rejected.labels("bad_identity").inc()
            return _Refused.of_response(bad_identity_response(exc), "invalid_identity")
        if isinstance(exc, RoutingError):
            return _Refused(exc.status, exc.code, exc.message, retry if exc.status in (429, 503) else None)
        if isinstance(exc, LimitExceeded):
            telemetry.rejected.labels(exc.code).inc()
            return _Refused(exc.status, exc.code, exc.message)
        if isinstance(exc, RequestValidationError):
            return _validation_refusal(exc)
        if isinstance(exc, TokenizerError):
            return _Refused(400, "tokenization_failed", str(exc))
        if isinstance(exc, _BadTokens):
            return _Refused(422, "invalid_request", "token ids must be integers in [0, 2**32)")
        log.exception("endpoint picker failed", exc_info=exc)
        return _Refused(500, "internal_error", f"internal error: {type(exc).__name__}")

    def _refuse(self, refusal: _Refused) -> list[Any]:
        """Answer with an ImmediateResponse and end the stream."""
        self.closed = True
        self.picker.streams.labels(str(refusal.status)).inc()
        headers = {"content-type": "application/json", codec.REASON_HEADER: refusal.code, **refusal.headers}
        if self.request_id:
            headers["x-request-id"] = self.request_id
        body = (
            refusal.body
            if refusal.body is not None
            else error_body(refusal.status, refusal.message, refusal.code)
        )
        return [codec.immediate(refusal.status, body, headers.items(), refusal.code)]

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
        extra = {codec.REPLICA_HEADER: self.hold.rep.name} if self.hold is not None else {}
        if msg.end_of_stream:
            self.response_over = True
            self._first_byte()
            self._complete()
        return [codec.response_headers(extra)]

    def _strip_if_asked(self) -> None:
        if self.event_stream and self.strip_usage and self.stripper is None:
            self.stripper = _UsageStripper(self.settings.engine_max_body_bytes)

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
        elif self.body_size <= self.settings.engine_max_body_bytes:
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
        """The first response byte: TTFT (from the decision going back), prefill tokens released."""
        if self.ttft is not None or self.hold is None:
            return
        self.ttft = time.monotonic() - self.sent_at
        self.hold.first_byte()
        if 0 < self.status < 400:
            self.svc.telemetry.ttft.labels(self.hold.rep.name).observe(self.ttft)

    def _complete(self) -> None:
        """The response is over: usage -> cached-token feedback and calibration, then release (as the proxy)."""
        hold, routed = self.hold, self.routed
        if hold is None or routed is None or self.finished:
            return
        try:
            if 0 < self.status < 400:
                self._feedback(hold, routed)
        except Exception:
            log.exception("endpoint picker feedback failed")
        finally:
            self.finish()

    def _feedback(self, hold: _Hold, routed: Routed) -> None:
        proxy = self.svc.proxy
        cached = routed.cached_tokens.get(hold.rep.index, 0)
        if self.event_stream:
            usage = _usage_from_sse(bytes(self.tail))
            proxy._check_usage(hold.rep, usage, streamed=True)
            proxy._feedback(hold.rep, routed, usage, self.ttft or 0.0, cached, single_chunk=False)
        elif self.body_size <= self.settings.engine_max_body_bytes:
            usage = _usage_from_json(b"".join(self.body_parts))
            proxy._check_usage(hold.rep, usage, streamed=False)
            proxy._feedback(hold.rep, routed, usage, self.ttft or 0.0, cached, single_chunk=not self.stream)

    def finish(self) -> None:
        """Release the replica's in-flight count and the admission slot (idempotent; stream end or cancel)."""
        if self.finished:
            return
        self.finished = True
        self.body = bytearray()
        if self.hold is not None:
            self.hold.release()
        if self.ticket is not None:
            self.ticket.release()


class _UsageStripper:
    """Removes the usage-only SSE events the picker asked for (``"choices":[]`` with ``usage``) from a response
    body that passes through in pieces. The gateway may split one event across two body messages: the end of a
    piece after its last complete event is held and goes out with the next piece, so the client receives the
    unsplit stream minus those events, byte for byte, however it was split. An unfinished event longer than
    ``max_event_bytes`` is let through unchanged, and stripping stops."""

    __slots__ = ("held", "max_event_bytes", "active")

    def __init__(self, max_event_bytes: int) -> None:
        self.held = bytearray()
        self.max_event_bytes = max_event_bytes
        self.active = True

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream so far can go out now (complete events, usage-only ones removed)."""
        if not self.active:
            return chunk
        if not self.held:
            if chunk.endswith(b"\n\n"):  # whole events (one per token, the common piece)
                return _strip_usage_events(chunk) if b'"usage"' in chunk else chunk
            data = chunk
        else:
            boundary = bytes(self.held[-1:]) + chunk[:1]
            if b"\n\n" not in chunk and boundary != b"\n\n":
                self.held += chunk
                return self._bounded()
            data = bytes(self.held) + chunk
            self.held = bytearray()
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.held += data
            return self._bounded()
        complete, rest = data[: cut + 2], data[cut + 2 :]
        self.held += rest
        return _strip_usage_events(complete) if b'"usage"' in complete else complete

    def flush(self) -> bytes:
        """The end of the stream: what was held (an unfinished last event, stripped like any other)."""
        rest, self.held = bytes(self.held), bytearray()
        return _strip_usage_events(rest) if self.active and b'"usage"' in rest else rest

    def _bounded(self) -> bytes:
        if len(self.held) <= self.max_event_bytes:
            return b""
        self.active = False  # not an event stream the picker can edit: pass everything on
        out, self.held = bytes(self.held), bytearray()
        return out


def _status_of(value: str) -> int:
    """An HTTP status from a ``:status`` header, 0 when it is not one (counted, never fatal)."""
    value = value.strip()
    if value.isdigit() and len(value) == 3:
        return int(value)
    return 0


def _model_for(path: str, body: bytes) -> type[ChatRequest] | type[CompletionRequest]:
    """Which OpenAI request a body is, from the normalized path (a body with ``messages`` elsewhere is chat)."""
    if path.endswith("/chat/completions"):
        return ChatRequest
    if path.endswith("/completions"):
        return CompletionRequest
    return ChatRequest if b'"messages"' in body else CompletionRequest


def _validation_refusal(exc: RequestValidationError) -> _Refused:
    """Invalid JSON -> 400 invalid_json; invalid fields -> 422 naming them (as the HTTP routes answer)."""
    errors = exc.errors()
    if any(e.get("type") in ("json_invalid", "json_type") for e in errors):
        msg = next((str(e.get("msg")) for e in errors if e.get("type") == "json_invalid"), "invalid JSON")
        return _Refused(400, "invalid_json", f"request body is not valid JSON: {msg}")
    parts = [
        f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
        for e in errors
    ]
    return _Refused(422, "invalid_request", "; ".join(parts))


def _strip_usage_events(chunk: bytes) -> bytes:
    """``chunk`` without the usage-only SSE events (``"choices":[]`` with ``usage``) the picker asked for."""
    kept = []
    for event in chunk.split(b"\n\n"):
        if b'"usage"' in event and b'"choices":[]' in event.replace(b" ", b""):
            continue
        kept.append(event)
    return b"\n\n".join(kept)


# -------------------------------------------------------------------------------------------------------------
# the server
# -------------------------------------------------------------------------------------------------------------


class EppServer:
    """The gRPC server (ext_proc + grpc.health.v1) on ``epp_grpc_port``, in the HTTP app's event loop.

    ``start`` / ``stop`` are a background pair of ``router.services`` (started after membership, stopped first).
    """

    def __init__(self, svc: Services) -> None:
        """Raises ValueError when the configured certificate and key do not load (``router.epp.tls``)."""
        self.svc = svc
        self.picker = EndpointPicker(svc)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._ready_task: asyncio.Task[None] | None = None
        settings = svc.settings
        self.credentials = server_credentials(
            settings.epp_grpc_insecure, settings.epp_tls_cert_file, settings.epp_tls_key_file
        )

    async def start(self) -> None:
        """Bind (TLS unless ``epp_grpc_insecure``), start serving and keep the readiness services current."""
        settings = self.svc.settings
        server = grpc.aio.server(
            options=[
                ("grpc.max_concurrent_streams", settings.epp_max_streams_per_connection),
                # a BUFFERED body comes whole in one message: room for the largest body plus its framing
                ("grpc.max_receive_message_length", settings.max_request_bytes + _MESSAGE_HEADROOM_BYTES),
                ("grpc.max_send_message_length", settings.max_request_bytes + _MESSAGE_HEADROOM_BYTES),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(self.picker, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        address = f"{settings.host}:{settings.epp_grpc_port}"
        if self.credentials is None:
            self.port = server.add_insecure_port(address)
        else:
            self.port = server.add_secure_port(address, self.credentials)
        if self.port == 0:
            raise OSError(
                f"cannot bind the endpoint picker's gRPC port {settings.host}:{settings.epp_grpc_port}"
            )
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
            await self.server.stop(self.svc.settings.shutdown_grace_s)
            self.server = None

    def ready(self) -> bool:
        """At least one replica is routable (every EPP replica answers: no leader election)."""
        return any(r.routable for r in self.svc.table.all())

    async def _update_readiness(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.ready()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in (READINESS_SERVICE, EXT_PROC_SERVICE, ""):
            await self.health.set(name, status)

    async def _readiness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.svc.settings.probe_interval_s)
            try:
                await self._update_readiness()
            except Exception:
                log.exception("endpoint picker readiness update failed")


def add_epp(svc: Services) -> EppServer:
    """Build the endpoint picker on ``svc`` and start it with the other background parts."""
    server = EppServer(svc)
    svc.background.append((server.start, server.stop))
    return server
