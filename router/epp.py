"""``kvroute epp``: the endpoint picker, a second front door (gRPC Envoy ``ext_proc``) onto the same routing core.

A Gateway API Inference Extension gateway (Istio, kgateway, Envoy AI Gateway, ...) opens one
``envoy.service.ext_proc.v3.ExternalProcessor/Process`` stream per HTTP request and asks where it goes. The
gateway carries the bytes; kvroute only decides. Per stream (``_Stream``)::

    request_headers ─┬─ end_of_stream (no body): pick now
                     └─ request_body chunks, buffered until end_of_stream (bounded by max_request_bytes)
    -> guard (auth, loop-lag shedding) -> parse + tokenize + hash (the HTTP routes' own code) -> admission
    -> decision (the HTTP routes' own ``decide``: session affinity, subset hint as excluded replicas)
    -> in-flight accounting on the replica (acquired now, released when the response ends or the stream dies)
    <- request_headers answer: x-gateway-destination-endpoint + envoy.lb metadata (same value), clear_route_cache
    <- the body re-streamed in <= 62,000-byte chunks (with stream usage asked for, as the proxy asks)
    response_headers / response_body (passed through; usage parsed) -> TTFT, cached-token feedback, release

Errors are ``ImmediateResponse`` s with the same statuses and OpenAI-style bodies as the HTTP routes: 400
malformed JSON, 422 invalid fields, 404 unknown model, 413 over a limit, 429 shed / overloaded, 503 no ready
replica (or none in the subset hint). Every replica of kvroute answers (active-active): decisions share the
index and the predicted entries through the KV-event / Redis fan-out, as ``kvroute serve`` replicas do.

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
from router import epp_codec as codec
from router.admission import Rejected
from router.app import ChatRequest, CompletionRequest, _Auth, _BadTokens, _DataPlane, _parse
from router.client_fields import ROUTER_HEADERS
from router.intake import LimitExceeded
from router.proxy import _Hold, _usage_from_json, _usage_from_sse, ask_for_usage, error_body, new_request_id
from router.routing import NoReplica, Routed, RoutingError, RoutingInput
from router.services import Services
from router.telemetry import gauge
from router.tenant_admission import Ticket, bad_identity_response, rejection_response
from router.tenants import BadIdentity
from router.tokenizer import TokenizerError

log = logging.getLogger("kvroute.epp")

#: the gRPC service names the gateway's health checks may ask for
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS_SERVICE = "liveness"
READINESS_SERVICE = "readiness"
#: bytes kept from the end of a streamed response (the usage chunk is there), as the proxy keeps
_TAIL_BYTES = 16384


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
        """One HTTP request's ext_proc stream: answers each message as the protocol requires."""
        stream = _Stream(self)
        self.active += 1
        try:
            async for msg in request_iterator:
                for answer in await stream.on(msg):
                    yield answer
                if stream.closed:
                    return
        finally:
            self.active -= 1
            stream.finish()


class _Stream:
    """The state of one gateway stream (one HTTP request): request, decision, hold, response accounting."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.svc = picker.svc
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.closed = False
        self.ticket: Ticket | None = None  # the admission slot (router/tenant_admission.py), held to the end
        self.hold: _Hold | None = None
        self.routed: Routed | None = None
        self.request_id = ""
        self.stream = False  # the client asked for a streamed answer
        self.strip_usage = False  # the picker asked for stream usage the client did not ask for
        self.sent_at = 0.0  # when the decision went back to the gateway (monotonic s)
        self.ttft: float | None = None
        self.status = 0
        self.event_stream = False
        self.tail = bytearray()
        self.body_parts: list[bytes] = []
        self.body_size = 0
        self.finished = False

    # -- dispatch ------------------------------------------------------------------------------------------
    async def on(self, msg: Any) -> list[Any]:
        """The answers to one ``ProcessingRequest``."""
        kind = msg.WhichOneof("request")
        if kind == codec.REQUEST_HEADERS:
            self.headers = codec.headers_of(msg.request_headers)
            self.subset = codec.subset_hint(msg.metadata_context)
            if msg.request_headers.end_of_stream:
                return await self._pick(None)
            return []
        if kind == codec.REQUEST_BODY:
            return await self._on_body(msg.request_body.body, msg.request_body.end_of_stream)
        if kind == codec.REQUEST_TRAILERS:
            return [codec.trailers(request=True)]
        if kind == codec.RESPONSE_HEADERS:
            return self._on_response_headers(msg.response_headers)
        if kind == codec.RESPONSE_BODY:
            return self._on_response_body(msg.response_body.body, msg.response_body.end_of_stream)
        if kind == codec.RESPONSE_TRAILERS:
            return [codec.trailers(request=False)]
        return []

    async def _on_body(self, chunk: bytes, end: bool) -> list[Any]:
        """Buffer one request body chunk; pick at the end of the body."""
        if chunk:
            self.size += len(chunk)
            limit = self.svc.settings.max_request_bytes
            if self.size > limit:
                return self._refuse(
                    _Refused(413, "request_too_large", f"request body over {limit} bytes (max_request_bytes)")
                )
            self.parts.append(chunk)
        if not end:
            return []
        body = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        self.parts = []
        return await self._pick(body)

    # -- the decision --------------------------------------------------------------------------------------
    async def _pick(self, body: bytes | None) -> list[Any]:
        """Route the request (``body`` None: headers only) and answer with the destination and the body."""
        try:
            await self._guard()
            request = self._request(body or b"")
            inp, payload = await self._input(request, body)
            routed = await self._admit_and_decide(inp, self._outside_subset())
        except Exception as exc:  # every failure is an ImmediateResponse, never a broken stream
            return self._refuse(self._refusal(exc))
        return self._routed(routed, body, payload)

    def _routed(self, routed: Routed, body: bytes | None, payload: bytes | None) -> list[Any]:
        """Hold the replica, remember what the response path needs, and build the answers."""
        svc = self.svc
        rep = svc.table.by_index(routed.decision.chosen)
        if rep is None:  # the replica left between the decision and now
            return self._refuse(_Refused(503, NoReplica.code, "the chosen replica left; retry"))
        inp = routed.inp
        self.routed = routed
        # the proxy's own hold (no dispatch gate here): counted in flight now, released by ``release()``
        self.hold = (
            _Hold(
                svc.router, None, rep, inp.prompt_tokens - routed.cached_tokens.get(rep.index, 0), inp.copies
            )
            .__enter__()
            .hand_over()
        )
        svc.router.record_prediction(rep, inp.keys)
        extra = {"x-request-id": inp.request_id}
        changed = payload is not None and payload is not body
        answers = [
            codec.routed_headers(
                codec.endpoint_of(rep.url), extra, len(payload) if changed and payload is not None else None
            )
        ]
        answers[0].request_headers.response.header_mutation.remove_headers.extend(ROUTER_HEADERS)
        if body is not None:
            answers.extend(codec.body_chunks(payload if payload is not None else body, request=True))
        self.sent_at = time.monotonic()
        self.picker.streams.labels("200").inc()
        return answers

    async def _guard(self) -> None:
        """The HTTP front gate on the headers (auth; loop-lag shedding): its answer becomes the refusal."""
        h = self.headers
        scope = {
            "type": "http",
            "method": h.get(":method", "POST"),
            "path": _path(h),
            "headers": [
                (k.encode("latin-1"), v.encode("latin-1", "replace"))
                for k, v in h.items()
                if not k.startswith(":")
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
            "path": _path(h),
            "query_string": b"",
            "headers": [
                (k.encode("latin-1"), v.encode("latin-1", "replace"))
                for k, v in h.items()
                if not k.startswith(":")
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
        data_model = _model_for(self.headers, body)
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
        payload = request._body  # the body without router-controlled fields (router/client_fields.py)
        if self.stream and self.svc.settings.engine_stream_usage:
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
        """Admission then the decision, in the HTTP data plane's order (``router.app._DataPlane._serve``): a
        request with a TTFT target is priced first (an unattainable target is refused, not queued); the tenant's
        quota and the fair in-flight queue (``router.tenant_admission``) give a slot held until the stream ends;
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
        h = codec.headers_of(msg)
        self.status = int(h.get(":status", "200") or 200)
        self.event_stream = h.get("content-type", "").startswith("text/event-stream")
        extra = {codec.REPLICA_HEADER: self.hold.rep.name} if self.hold is not None else {}
        if msg.end_of_stream:
            self._first_byte()
            self._complete()
        return [codec.response_headers(extra)]

    def _on_response_body(self, chunk: bytes, end: bool) -> list[Any]:
        """Pass one response chunk through (removing usage the client did not ask for); account at the end."""
        self._first_byte()
        if self.event_stream:
            self.tail += chunk
            if len(self.tail) > 2 * _TAIL_BYTES:
                del self.tail[:-_TAIL_BYTES]
            if self.strip_usage and b'"usage"' in chunk:
                chunk = _strip_usage_events(chunk)
        elif self.body_size <= self.svc.settings.engine_max_body_bytes:
            self.body_parts.append(chunk)
            self.body_size += len(chunk)
        if end:
            self._complete()
        # every message is answered (an empty chunk too): in FULL_DUPLEX_STREAMED mode the gateway sends the
        # client only what comes back
        return list(codec.body_chunks(chunk, request=False, end_of_stream=end))

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
                proxy = self.svc.proxy
                if self.event_stream:
                    usage = _usage_from_sse(bytes(self.tail))
                    proxy._check_usage(hold.rep, usage, streamed=True)
                    proxy._feedback(
                        hold.rep,
                        routed,
                        usage,
                        self.ttft or 0.0,
                        routed.cached_tokens.get(hold.rep.index, 0),
                        single_chunk=False,
                    )
                elif self.body_size <= self.svc.settings.engine_max_body_bytes:
                    usage = _usage_from_json(b"".join(self.body_parts))
                    proxy._check_usage(hold.rep, usage, streamed=False)
                    proxy._feedback(
                        hold.rep,
                        routed,
                        usage,
                        self.ttft or 0.0,
                        routed.cached_tokens.get(hold.rep.index, 0),
                        single_chunk=not self.stream,
                    )
        except Exception:
            log.exception("endpoint picker feedback failed")
        finally:
            self.finish()

    def finish(self) -> None:
        """Release the replica's in-flight count and the admission slot (idempotent; stream end or cancel)."""
        if self.finished:
            return
        self.finished = True
        if self.hold is not None:
            self.hold.release()
        if self.ticket is not None:
            self.ticket.release()


def _path(headers: dict[str, str]) -> str:
    """The request path without its query string."""
    return headers.get(":path", "/").split("?", 1)[0] or "/"


def _model_for(headers: dict[str, str], body: bytes) -> type[ChatRequest] | type[CompletionRequest]:
    """Which OpenAI request a body is, from the path (a body with ``messages`` on another path is chat)."""
    path = _path(headers)
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
        self.svc = svc
        self.picker = EndpointPicker(svc)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._ready_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind, start serving and keep the readiness services current."""
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(self.picker, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        settings = self.svc.settings
        self.port = server.add_insecure_port(f"{settings.host}:{settings.epp_grpc_port}")
        if self.port == 0:
            raise OSError(
                f"cannot bind the endpoint picker's gRPC port {settings.host}:{settings.epp_grpc_port}"
            )
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self._update_readiness()
        await server.start()
        self.server = server
        self._ready_task = asyncio.create_task(self._readiness_loop(), name="kvroute-epp-readiness")
        log.info("endpoint picker listening", extra={"port": self.port})

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
