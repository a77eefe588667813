"""The HTTP front door: a translator between ASGI and the serving pipeline (``router.serve.pipeline``), plus the
introspection routes.

Routes (OpenAPI at ``/openapi.json``):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI-compatible; prepared, admitted, decided and
  dispatched by the pipeline (streaming SSE and not), once per ``Idempotency-Key``.
* ``GET /v1/models``: the union of the replicas' models and LoRA adapters.
* the engines' other endpoints (``router.serve.endpoints``): ``POST /v1/responses`` (chains pinned to the
  replica holding them), ``GET`` / ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, the pooling
  endpoints, ``/tokenize``, ``/detokenize``, audio (multipart) and SGLang's ``/generate``, through the pipeline.
* ``POST /route``: the same body as completions or chat, or ``{"model": ..., "token_ids": [...]}``; returns the
  decision (chosen replica name and URL; every candidate's predicted TTFT with Q, R, C, p and matched tokens per
  tier; a PD fleet's plan) without forwarding.
* ``GET /replicas``, ``GET /index/stats``, ``GET /metrics``, ``GET /healthz`` (alive), ``GET /region/ready`` (another region's router probes it: 2xx while one of this region's
  own engines is routable), ``GET /readyz`` (at least
  one replica routable).

Errors are the kvroute error family (``router.errors``) rendered as OpenAI-style JSON ``{"error": {"message",
"type", "code", "param"}}``: invalid JSON -> 400, missing or invalid fields -> 422 naming the field, unknown model
-> 404, an unknown path -> 404 (405 for a method a route does not take), body over ``max_request_bytes`` -> 413,
router at its in-flight limit -> 429 with ``Retry-After``, no routable replica -> 503 with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from membership.replicas import Replica
from membership.shared_state import MAX_RESPONSE_ID_CHARS
from policies.base import Reuse
from router import signals
from router.config import Settings
from router.core.regions import HOP_HEADER, PEER_KEY_HEADER, PeerKeys
from router.core.routing import decision_json
from router.engine.peer_feed import PREFIX_ETAG_HEADER
from router.errors import (
    TRACE_ID_HEADER,
    KvrouteError,
    as_error,
    error_response,
    forbidden,
    refusal_response,
    unauthorized,
)
from router.serve.endpoints import ENGINE_POST_ROUTES, RESPONSE_CANCEL, RESPONSE_RETRIEVE, Kind
from router.serve.guard import Guard, request_path, route_label
from router.serve.idempotency import HEADER as IDEMPOTENCY_HEADER
from router.serve.pipeline import GENERATION_ROUTES, chat_input
from router.serve.requests import ChatRequest, CompletionRequest, EngineBody, ResponsesRequest, RouteBody
from router.services import Services, build_services, region_summary, run
from router.telemetry import CONTENT_TYPE, Telemetry, bind_trace_id, current_trace_id
from router.tracing import TRACEPARENT, caller_trace_id

log = logging.getLogger("kvroute.app")
_M = TypeVar("_M", bound=BaseModel)

# ---------------------------------------------------------------------------------------------------------
# request models (documented in OpenAPI; unknown fields are kept and forwarded to the engine)
# ---------------------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    """An error."""

    message: str
    type: str
    code: str | int | None = None
    param: str | None = None
    trace_id: str | None = Field(
        default=None,
        description="the request's trace id (32 hex digits), when it has one (docs/observability.md)",
    )


class ErrorResponse(BaseModel):
    """OpenAI-style error body."""

    error: ErrorDetail


class MatchedTokens(BaseModel):
    """Matched leading prompt tokens per tier on one candidate."""

    gpu: int
    cpu: int
    disk: int
    remote: int
    predicted: int
    total: int


class CandidateOut(BaseModel):
    """One candidate of a decision: predicted TTFT and its parts (seconds; p = hit probability)."""

    model_config = ConfigDict(extra="allow")
    name: str
    index: int
    url: str | None
    score: float | None
    predicted_ttft_s: float | None
    Q: float | None
    R: float | None
    C: float | None
    p: float | None
    parts: dict[str, float | None]
    matched_tokens: MatchedTokens
    cached_tokens: int
    load: dict[str, Any] | None


class ChosenOut(BaseModel):
    """The chosen replica."""

    name: str | None
    index: int
    url: str | None


class ReuseOut(BaseModel):
    """Prompt-cache reuse of a decision, tokens: the most any eligible candidate held (available) vs what the
    chosen one holds (achieved); ``missed`` = available - achieved (a router miss or a trade for a shorter queue),
    ``prompt_tokens - available`` = a workload miss."""

    available_tokens: int
    achieved_tokens: int
    missed_tokens: int


class DecisionOut(BaseModel):
    """``POST /route`` answer."""

    model_config = ConfigDict(extra="allow")
    chosen: ChosenOut
    policy: str
    branch: str
    ranking: list[str]
    model: str
    lora: str | None
    prompt_tokens: int
    blocks: int
    prompt_tokens_estimated: bool = Field(
        default=False,
        description="true when prompt_tokens is an estimate: "
        "the router tokenized only tokenized_tokens of the prompt, as deep as "
        "any replica's cache reaches (tokenize_scope=cached_prefix)",
    )
    tokenized_tokens: int = Field(default=0, description="prompt tokens the router tokenized (and hashed)")
    block_size: int
    decision_s: float
    candidates: list[CandidateOut]
    reuse: ReuseOut | None = None


class ModelOut(BaseModel):
    """One served model."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str = "model"
    owned_by: str = "kvroute"
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    """``GET /v1/models`` answer."""

    object: Literal["list"] = "list"
    data: list[ModelOut]


class ReplicaOut(BaseModel):
    """One replica in ``GET /replicas``."""

    model_config = ConfigDict(extra="allow")
    name: str
    index: int
    url: str | None = Field(
        description="base URL (null unless the caller is an admin: admin_token, or no auth)"
    )
    state: str
    dialect: str
    role: str
    models: list[str]
    loras: list[str]
    load: dict[str, Any]
    kv_events: dict[str, Any] | None = None
    health: dict[str, Any] = Field(default_factory=dict)
    token_ids: str = Field(
        default="off",
        description="do prompts go to it as the router's token ids? off | "
        "trusted | unchecked | verified | mismatch | unsupported | error (forward_token_ids)",
    )
    pd: dict[str, float | int] = Field(
        default_factory=dict,
        description="what this router's PD plans left on it: link_busy_s (seconds of handoffs still queued on "
        "its link), decode_legs / decode_leg_tokens (disaggregated requests waiting on it for their first "
        "byte, and their prompt tokens)",
    )


class ReplicaList(BaseModel):
    """``GET /replicas`` answer."""

    replicas: list[ReplicaOut]


class Status(BaseModel):
    """Health / readiness answer."""

    model_config = ConfigDict(extra="allow")
    status: str
    reason: str | None = None


_ERR = {"model": ErrorResponse}
_ROUTE_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _ERR,
    401: _ERR,
    404: _ERR,
    409: _ERR,
    413: _ERR,
    422: _ERR,
    429: _ERR,
    501: _ERR,
    502: _ERR,
    503: _ERR,
    504: _ERR,
}
#: one server-sent event as its fields (the schema of each event of a ``text/event-stream`` answer: the engines'
#: ``data:`` lines carry their JSON chunks as text, the Responses API names its events with ``event:``)
_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
#: the engine routes that stream when the body asks (``"stream": true``), besides the two generation routes
_STREAMED_KINDS = frozenset({Kind.RESPONSES, Kind.SGLANG_GENERATE})
#: what a route that streams documents: ``_ROUTE_ERRORS`` and a 200 as JSON or server-sent events
_STREAMED_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_ROUTE_ERRORS,
    200: {
        "description": "the engine's answer: JSON, or server-sent events when the request asks to stream",
        "content": {"application/json": {}, "text/event-stream": {"schema": _SSE_EVENT}},
    },
}

# ---------------------------------------------------------------------------------------------------------
# middleware
# ---------------------------------------------------------------------------------------------------------

_KNOWN_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/route",
    "/replicas",
    "/index/stats",
    "/metrics",
    "/healthz",
    "/readyz",
    "/region/ready",
    "/region/summary",
    "/openapi.json",
    "/docs",
)


class _Edge:
    """Pure ASGI middleware: request body limit (413) and per-route request counters."""

    def __init__(self, app: ASGIApp, telemetry: Telemetry, max_body: int) -> None:
        self.app = app
        self.telemetry = telemetry
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in _KNOWN_ROUTES else route_label(path)
        status = {"code": 500}
        if _declared_too_big(scope, self.max_body):
            await _send_too_large(send, self.max_body)
            self.telemetry.requests.labels(route, "413").inc()
            return
        seen = 0
        limit = self.max_body

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge()
            return message

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, limited_receive, counting_send)
        except _BodyTooLarge:
            status["code"] = 413
            await _send_too_large(send, self.max_body)
        except Exception:  # unhandled: Starlette's error middleware (outside this one) answers 500
            self.telemetry.requests.labels(route, str(status["code"])).inc()
            raise
        self.telemetry.requests.labels(route, str(status["code"])).inc()


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lowercase bytes) of an ASGI request, or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


#: a rejected request announcing a larger body than this (bytes; uvicorn's read buffer) gets ``connection: close``
_DRAIN_MAX_BYTES = 64 * 1024


def _large_body(scope: Scope) -> bool:
    """True when the request announces a body over ``_DRAIN_MAX_BYTES`` or of unknown length (chunked).

    A rejected request with a small body keeps its connection (uvicorn reads and drops the rest of the body, so a
    client that sent it at once reads its answer instead of a reset); a large one is closed, not read.
    """
    if _header(scope, b"transfer-encoding") is not None:
        return True
    length = _header(scope, b"content-length")
    return length is not None and (not length.strip().isdigit() or int(length) > _DRAIN_MAX_BYTES)


class _BodyTooLarge(Exception):
    """The request body grew past ``max_request_bytes`` while it was read."""


def _declared_too_big(scope: Scope, limit: int) -> bool:
    """True when the request's Content-Length announces more than ``limit`` bytes."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.isdigit() and int(value) > limit
    return False


async def _send_too_large(send: Send, limit: int) -> None:
    await _send_error(send, 413, f"request body over {limit} bytes (max_request_bytes)", "body_too_large")


#: a data-plane endpoint served on the direct path: the request and its body (already read)
FastEndpoint = Callable[[Request, bytes], Awaitable[Response]]


class _KvrouteApp(FastAPI):
    """The FastAPI app with a direct path for the data-plane routes.

    ``POST /v1/completions`` and ``POST /v1/chat/completions`` (every request of a fleet goes through them) skip
    Starlette's middleware and routing stack (error middleware, exception middleware, exit stack, route matching,
    dependency solving: ~0.3 ms of CPU per request measured with ``loadtest.bench_proxy``). They keep what
    ``_Edge`` does (the body limit with the same 413, the request counters; the body is read here, without
    ``_Edge``'s per-message receive wrapper) and exceptions are answered by the same handlers the app
    registers with ``exception_handler`` (looked up along the exception's MRO, as Starlette does); anything
    unhandled is logged and answered 500 in JSON. With CORS configured every request takes the normal path.
    """

    #: the front gate (router/serve/guard.py: auth and shedding from the headers), set by ``create_app``
    guard: Guard | None = None
    #: the keys of peer regions' routers (``router.core.regions.PeerKeys``), set by ``create_app``
    peers: PeerKeys | None = None
    #: the router's metrics (requests, rejected) and the ``Retry-After`` of refusals, s; set by ``create_app``
    telemetry: Telemetry
    retry_after_s: int
    #: tracing is on (every request gets a trace id, named in its answer's ``x-kvroute-trace-id``)
    traced = False
    #: path -> endpoint served directly (empty until ``enable_fast_path``; never mutated in place)
    _fast_routes: Mapping[str, FastEndpoint] = MappingProxyType({})

    def enable_fast_path(self, routes: dict[str, FastEndpoint], max_body: int) -> None:
        """Serve ``routes`` (path -> endpoint taking the Request and its body, read here) directly for POST
        requests."""
        self._fast_routes = routes
        self._fast_max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry: the data-plane routes directly, everything else through FastAPI. A request with a trace id
        (tracing on, or a caller's ``traceparent``) names it in its answer's headers."""
        if scope["type"] == "http":
            traceparent = _header(scope, _TRACEPARENT)
            if traceparent is not None or self.traced:
                send = _naming_the_trace(send, traceparent)
        guard = self.guard  # router/serve/guard.py: auth and shedding from the headers, before any body
        if guard is not None and scope["type"] == "http":
            method = str(scope.get("method", ""))
            path = request_path(scope)
            peer_hop, refusal = self._peer_gate(scope, path)
            if refusal is None:
                refusal = await guard.check(method, path, _header(scope, b"authorization"), peer_hop)
            if refusal is not None:
                await self._refuse_early(scope, send, refusal)
                return
            if guard.counts(method, scope.get("path", "")):
                with guard.working():  # the router's request work, which the shedding decision watches
                    await self._route(scope, receive, send)
                return
        await self._route(scope, receive, send)

    def _peer_gate(self, scope: Scope, path: str) -> tuple[bool, KvrouteError | None]:
        """(a request forwarded by a peer region's router, its refusal) from the peer-key header: a wrong key is
        401; a right one only forwards a hop (``x-kvroute-hop``) on ``/v1/`` (403 otherwise: a peer key never
        routes a client's request). The region routes check their own (``_Auth.check_peer``)."""
        peers = self.peers
        presented = _header(scope, PEER_KEY_HEADER.encode())
        if peers is None or not peers.configured or presented is None or path.startswith("/region/"):
            return False, None
        if peers.status(presented.decode("latin-1")):
            return False, unauthorized(f"the {PEER_KEY_HEADER} is not a peer key (peer_api_keys)")
        if _header(scope, HOP_HEADER.encode()) is None or not path.startswith("/v1/"):
            return False, forbidden(
                f"a peer key only forwards a hopped request ({HOP_HEADER}); use a client key"
            )
        return True, None

    async def _refuse_early(self, scope: Scope, send: Send, err: KvrouteError) -> None:
        """Answer the guard's refusal before any body is read (``connection: close`` when a large body was
        announced: it is not read), counted."""
        if _large_body(scope):
            err.headers["connection"] = "close"
        resp = self.render(err)
        await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
        await send({"type": "http.response.body", "body": resp.body})
        self.telemetry.requests.labels(route_label(scope.get("path", "")), str(resp.status_code)).inc()

    def render(self, err: KvrouteError) -> Response:
        """The JSON answer to a refusal, counted in ``kvroute_rejected_total`` when it names a reason."""
        if err.counted_as is not None:
            self.telemetry.rejected.labels(err.counted_as).inc()
        return refusal_response(err, self.retry_after_s, current_trace_id())

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The data-plane routes directly, everything else through FastAPI."""
        routes = self._fast_routes
        if routes and scope["type"] == "http" and scope.get("method") == "POST" and scope["path"] in routes:
            await self._fast(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def _fast(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One data-plane request: body (with the ``_Edge`` size limit), endpoint, error mapping, counters."""
        scope["app"] = self
        path = scope["path"]
        limit = self._fast_max_body
        status = 500
        try:
            if _declared_too_big(scope, limit):
                raise _BodyTooLarge()
            parts: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    status = 499
                    return  # nobody to answer
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise _BodyTooLarge()
                    parts.append(chunk)
                if not message.get("more_body", False):
                    break
            request = Request(scope, receive, send)
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            try:
                response = await self._fast_routes[path](request, body)
            except (asyncio.CancelledError, ClientDisconnect):
                raise
            except Exception as exc:
                handler = next(
                    (self.exception_handlers[c] for c in type(exc).__mro__ if c in self.exception_handlers),
                    None,
                )
                if handler is None:
                    log.exception("unhandled error", extra={"path": path})
                    response = self.render(as_error(exc))
                else:
                    response = await handler(request, exc)  # type: ignore[misc]  # async handlers only
            status = response.status_code
            await response(scope, receive, send)
        except _BodyTooLarge:
            status = 413
            await _send_too_large(send, limit)
        except ClientDisconnect:
            status = 499
        finally:
            self.telemetry.requests.labels(path, str(status)).inc()


#: the W3C ``traceparent`` header's name in an ASGI scope
_TRACEPARENT = TRACEPARENT.encode()
_TRACE_ID_HEADER = TRACE_ID_HEADER.encode()


def _naming_the_trace(send: Send, traceparent: bytes | None) -> Send:
    """``send`` with the request's trace id (``router.telemetry.current_trace_id``, bound by the pipeline's
    ``request_trace``) in the ``x-kvroute-trace-id`` header of its answer. A valid caller's ``traceparent`` is
    bound at once, so a refusal before the pipeline (auth, shedding, body size) names it too."""
    if traceparent is not None:
        caller = caller_trace_id(traceparent.decode("latin-1"))
        if caller is not None:
            bind_trace_id(caller)

    async def naming_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            trace_id = current_trace_id()
            if trace_id is not None:
                headers = [*message.get("headers", ()), (_TRACE_ID_HEADER, trace_id.encode())]
                message = {**message, "headers": headers}
        await send(message)

    return naming_send


async def _send_error(send: Send, status: int, message: str, code: str) -> None:
    resp = error_response(status, message, code, trace_id=current_trace_id())
    await send({"type": "http.response.start", "status": status, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


# ---------------------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------------------


def create_app(settings: Settings, services: Services | None = None) -> FastAPI:
    """The FastAPI app for ``settings``; background components start and stop with its lifespan."""
    svc = services or build_services(settings)
    app = _new_app(svc)
    _add_middleware(app, svc)
    _add_error_handlers(app, svc)
    auth = _Auth(svc.guard, _peer_keys(svc.settings))
    _add_data_plane(app, _DataPlane(svc, auth))
    _add_control_plane(app, svc, auth)
    _add_region_routes(app, svc, auth)
    _install_openapi(app)
    return app


def _new_app(svc: Services) -> _KvrouteApp:
    """The app whose lifespan runs the services (``router.services.run``)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with run(svc):
            yield

    app = _KvrouteApp(
        title="kvroute",
        version="0.1.0",
        lifespan=lifespan,
        description="Cache-aware router for LLM inference fleets (OpenAI-compatible).",
    )
    app.state.services = svc
    app.guard = svc.guard  # router/serve/guard.py: auth before the body, loop-lag shedding
    app.peers = _peer_keys(svc.settings)
    app.telemetry = svc.telemetry
    app.retry_after_s = svc.settings.retry_after_s
    app.traced = svc.pipeline.tracing is not None
    return app


def _add_middleware(app: FastAPI, svc: Services) -> None:
    settings = svc.settings
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(_Edge, telemetry=svc.telemetry, max_body=settings.max_request_bytes)


def _add_error_handlers(app: _KvrouteApp, svc: Services) -> None:
    """Every refusal of the routes (the kvroute error family, ``router.errors``; the framework's validation
    errors through the same table) answered as OpenAI-style JSON, counted when it names a reason."""

    async def refused(request: Request, exc: Exception) -> Response:
        return app.render(as_error(exc))

    async def framework(request: Request, exc: Exception) -> Response:
        """The framework's own refusals (an unknown path, a method a route does not take) in the same shape."""
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if status == 404:
            message = f"no route {request.url.path!r}: kvroute serves the engines' API (docs/service.md)"
        headers = dict(exc.headers or {})
        return app.render(KvrouteError(message, status=status, code=code, headers=headers))

    app.add_exception_handler(KvrouteError, refused)
    app.add_exception_handler(RequestValidationError, refused)
    app.add_exception_handler(StarletteHTTPException, framework)


def _peer_keys(settings: Settings) -> PeerKeys:
    """The peer keys (``peer_api_keys``), checked against the client keys and the admin token."""
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    return PeerKeys(
        [k.get_secret_value() for k in settings.peer_api_keys],
        [k.get_secret_value() for k in settings.api_keys],
        admin,
    )


class _Auth:
    """Client API keys (data plane) and the admin token (control plane), checked by ``router.serve.guard.Auth``;
    peer regions' keys (``router.core.regions.PeerKeys``)."""

    def __init__(self, guard: Guard, peers: PeerKeys) -> None:
        self.guard = guard.auth
        self.peers = peers

    def check_client(self, request: Request, hop_ok: bool = False) -> None:
        """Raises 401 unless the request carries one of the API keys (when any is configured). A request with a
        peer key is a peer's: accepted only where ``hop_ok`` (a hopped request), else 403; a wrong peer key 401."""
        presented = request.headers.get(PEER_KEY_HEADER)
        if presented is not None and self.peers.configured:
            if self.peers.status(presented):
                raise unauthorized(f"the {PEER_KEY_HEADER} is not a peer key (peer_api_keys)")
            if not hop_ok:
                raise forbidden(f"a peer key only forwards a hopped request ({HOP_HEADER}); use a client key")
            return
        if not self.guard.client_ok(request.headers.get("authorization")):
            raise unauthorized()

    def check_peer(self, request: Request) -> None:
        """What other regions' routers read: a peer key when any is configured (a client key is not one: 401),
        else as ``check_client``."""
        status = self.peers.status(request.headers.get(PEER_KEY_HEADER))
        if status < 0:
            self.check_client(request)
        elif status:
            raise unauthorized(f"missing or wrong {PEER_KEY_HEADER} (peer_api_keys)")

    def check_admin(self, request: Request) -> None:
        """Admin / introspection endpoints: the admin token when configured, else an API key when configured."""
        status, message = self.guard.admin_status(request.headers.get("authorization"))
        if status:
            raise unauthorized(message) if status == 401 else forbidden(message)

    def is_admin(self, request: Request) -> bool:
        """May the caller see replica URLs (internal addresses)?"""
        return self.guard.is_admin(request.headers.get("authorization"))


class _DataPlane:
    """The routed requests, translated between ASGI and the serving pipeline (``router.serve.pipeline``)."""

    def __init__(self, svc: Services, auth: _Auth) -> None:
        self.svc = svc
        self.pipeline = svc.pipeline
        self.auth = auth
        #: the client edge's sub-config (CORS, body limit) and the block size decisions are shown in
        self.client_edge = svc.settings.client_edge
        self.block_size = svc.settings.routing.block_size

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self.generate(request, await request.body(), "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self.generate(request, await request.body(), "/v1/chat/completions")

    async def generate(self, request: Request, raw: bytes, path: str) -> Response:
        """A generation request (``raw``: its body): prepared and served by the pipeline, once per
        Idempotency-Key (router/serve/idempotency.py)."""
        self.auth.check_client(request, hop_ok=HOP_HEADER in request.headers)
        prepared = await self.pipeline.prepare(path, request.headers, raw)
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if key is None:
            return await self.pipeline.serve(prepared, request.receive)
        served = False

        async def serve() -> Response:
            nonlocal served
            served = True
            return await self.pipeline.serve(prepared, request.receive)

        trace = prepared.inp.trace
        try:
            resp = await self.svc.idempotency.handle(
                key,
                path,
                prepared.body,
                prepared.stream,
                prepared.inp.request_id,
                serve,
                principal=self.auth.guard.principal(request.headers.get("authorization")),
            )
        except BaseException as exc:
            if trace is not None and not served:
                trace.fail(exc)
            raise
        if trace is not None and not served:  # answered from the key's record (or refused): never dispatched
            trace.respond(resp.status_code)
            trace.close()
        return resp

    async def engine(self, request: Request, raw: bytes | None = None) -> Response:
        """One of the engines' other endpoints (router/serve/endpoints.py): prepared and served by the pipeline
        (``raw``: the body, when the direct path has read it)."""
        self.auth.check_client(request, hop_ok=HOP_HEADER in request.headers)
        body = await request.body() if raw is None else raw
        prepared = await self.pipeline.prepare_engine(
            request.method,
            request_path(request.scope),
            request.headers,
            body,
            query=request.url.query,
            content_type=request.headers.get("content-type"),
        )
        return await self.pipeline.serve(prepared, request.receive)

    async def engine_route(self, request: Request) -> Response:
        """``engine`` as a FastAPI route (the body read here)."""
        return await self.engine(request)

    async def stored_response(
        self, request: Request, response_id: str = Path(min_length=1, max_length=MAX_RESPONSE_ID_CHARS)
    ) -> Response:
        """A stored response (``GET`` / ``DELETE /v1/responses/{id}``, ``POST .../cancel``), on its replica."""
        return await self.engine(request)

    async def models(self, request: Request) -> Any:
        """``GET /v1/models``."""
        self.auth.check_client(request)
        return {"object": "list", "data": self.svc.router.served_models()}

    async def route(self, request: Request) -> Any:
        """``POST /route``: the decision, not forwarded."""
        self.auth.check_client(request)
        pipeline = self.pipeline
        parsed = await pipeline.parse(await request.body(), RouteBody)
        body = parsed.model
        ident = await pipeline.identify(request.headers, body, None)
        chat = chat_input(body)
        inp = await pipeline.tokenize(
            request.headers,
            body,
            ident,
            prompt=body.prompt,
            chat=chat,
            token_ids=body.token_ids,
            image_chat=pipeline.scope_images(parsed, ident) if chat is not None else None,
        )
        routed = pipeline.explain(inp)
        out = decision_json(routed, self.svc.table, self.block_size, show_urls=self.auth.is_admin(request))
        out["reuse"] = _reuse_json(routed.decision.reuse)
        return out


async def _generate_at(dp: _DataPlane, request: Request, raw: bytes, *, path: str) -> Response:
    """The direct path's endpoint for the generation route ``path``."""
    return await dp.generate(request, raw, path)


async def _engine_at(dp: _DataPlane, request: Request, raw: bytes) -> Response:
    """The direct path's endpoint for the engines' other POST routes."""
    return await dp.engine(request, raw)


def _add_engine_routes(app: _KvrouteApp, dp: _DataPlane) -> None:
    """The engines' other endpoints (router/serve/endpoints.py), relayed through the pipeline."""
    for path, kind in ENGINE_POST_ROUTES.items():
        app.add_api_route(
            path,
            dp.engine_route,
            methods=["POST"],
            responses=_STREAMED_RESPONSES if kind in _STREAMED_KINDS else _ROUTE_ERRORS,
            response_model=None,
            openapi_extra=_MULTIPART_DOC
            if kind is Kind.MULTIPART
            else _body_doc(ResponsesRequest if kind is Kind.RESPONSES else EngineBody),
            summary=f"the engines' {path}, routed (docs/service.md)",
        )
    for pattern, method, name in (
        (RESPONSE_RETRIEVE, "GET", "retrieve_response"),
        (RESPONSE_RETRIEVE, "DELETE", "delete_response"),
        (RESPONSE_CANCEL, "POST", "cancel_response"),
    ):
        app.add_api_route(
            pattern.replace("{id}", "{response_id}"),
            dp.stored_response,
            methods=[method],
            operation_id=name,
            responses=_ROUTE_ERRORS,
            response_model=None,
            summary="a stored response, on the replica holding it",
        )


def _add_data_plane(app: _KvrouteApp, dp: _DataPlane) -> None:
    """The OpenAI-compatible routes, ``/v1/models`` and ``/route``."""
    app.post(
        "/v1/completions",
        responses=_STREAMED_RESPONSES,
        response_model=None,
        openapi_extra=_body_doc(CompletionRequest),
        summary="OpenAI completions, routed to the replica with the lowest expected TTFT",
    )(dp.completions)
    app.post(
        "/v1/chat/completions",
        responses=_STREAMED_RESPONSES,
        response_model=None,
        openapi_extra=_body_doc(ChatRequest),
        summary="OpenAI chat completions, routed through the chat template",
    )(dp.chat_completions)
    if (
        not dp.client_edge.cors_origins
    ):  # CORS headers come from a middleware: keep those requests on the normal path
        fast: dict[str, FastEndpoint] = {
            path: functools.partial(_generate_at, dp, path=path) for path in GENERATION_ROUTES
        }
        fast.update({path: functools.partial(_engine_at, dp) for path in ENGINE_POST_ROUTES})
        app.enable_fast_path(fast, dp.client_edge.max_request_bytes)
    _add_engine_routes(app, dp)
    app.get(
        "/v1/models",
        response_model=ModelList,
        responses={401: _ERR},
        summary="models served by the replicas (union)",
    )(dp.models)
    app.post(
        "/route",
        response_model=DecisionOut,
        responses=_ROUTE_ERRORS,
        openapi_extra=_body_doc(RouteBody),
        summary="where would this request go? (decision with every candidate's predicted TTFT)",
    )(dp.route)


def _add_region_routes(app: FastAPI, svc: Services, auth: _Auth) -> None:
    """What other regions' routers read: readiness of this region's own engines and the region's summary."""

    @app.get(
        "/region/ready",
        response_model=Status,
        responses={503: {"model": Status}},
        summary="readiness for other regions' routers: at least one of this region's own engines is routable",
    )
    async def region_ready() -> Any:
        n = sum(1 for r in svc.table.all() if r.routable and not r.is_peer)
        if n:
            return {"status": "ready", "routable_replicas": n}
        return JSONResponse(
            {"status": "not ready", "reason": "no routable engine in this region"}, status_code=503
        )

    @app.get(
        "/region/summary",
        responses={401: _ERR},
        summary="what this region publishes for other regions' routers: queue seconds and free capacity per "
        "model, and a Bloom filter of the prompt prefixes its engines hold (docs/regions.md)",
    )
    async def region_summary_route(request: Request) -> Any:
        auth.check_peer(request)
        pub = await region_summary(svc)
        status, body = pub.answer(
            request.headers.get("if-none-match"), request.headers.get(PREFIX_ETAG_HEADER)
        )
        media = None if status == 304 else "application/json"
        return Response(body, status_code=status, media_type=media, headers={"etag": f'"{pub.etag}"'})


def _add_control_plane(app: FastAPI, svc: Services, auth: _Auth) -> None:
    """Introspection (``/replicas``, ``/index/stats``, ``/metrics``) and probes (``/healthz``, ``/readyz``)."""

    @app.get(
        "/replicas",
        response_model=ReplicaList,
        responses={401: _ERR, 403: _ERR},
        summary="replicas with state, load view and freshness",
    )
    async def replicas(request: Request) -> Any:
        auth.check_admin(request)
        show_urls = auth.is_admin(request)  # addresses: admins only
        return {"replicas": [_replica_json(svc, r, show_urls) for r in svc.table.all()]}

    @app.get(
        "/index/stats",
        responses={401: _ERR, 403: _ERR},
        summary="prefix index sizes and counters (blocks per replica and tier)",
    )
    async def index_stats(request: Request) -> Any:
        auth.check_admin(request)
        stats = svc.index.stats()
        names = {r.index: r.name for r in svc.table.all()}
        for key in ("blocks", "predicted_blocks"):
            if isinstance(stats.get(key), dict):
                stats[key] = {names.get(i, str(i)): v for i, v in stats[key].items()}
        return stats

    @app.get(
        "/metrics",
        response_class=Response,
        summary="Prometheus metrics of the router",
        responses={200: {"content": {"text/plain": {}}}},
    )
    async def metrics() -> Response:
        # in pieces: the per-tenant families are rendered a slice at a time, between other work of the loop
        return StreamingResponse(svc.telemetry.render_stream(), media_type=CONTENT_TYPE)

    @app.get("/healthz", response_model=Status, summary="liveness")
    async def healthz() -> Any:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        response_model=Status,
        responses={503: {"model": Status}},
        summary="readiness: at least one replica is routable",
    )
    async def readyz() -> Any:
        n = sum(1 for r in svc.table.all() if r.routable)
        if n:
            return {"status": "ready", "routable_replicas": n, "tenants": svc.tenants.readiness()}
        states = {r.name: r.state.value for r in svc.table.all()}
        reason = "no replicas configured" if not states else f"no routable replica (states: {states})"
        return JSONResponse(
            {"status": "not ready", "reason": reason, "tenants": svc.tenants.readiness()}, status_code=503
        )


def _reuse_json(reuse: Reuse | None) -> dict[str, int] | None:
    """``POST /route``'s ``reuse``: available vs achieved cached prompt tokens of the decision."""
    if reuse is None:
        return None
    return {
        "available_tokens": reuse.available_tokens,
        "achieved_tokens": reuse.achieved_tokens,
        "missed_tokens": reuse.missed_tokens,
    }


def _replica_json(svc: Services, r: Replica, show_url: bool) -> dict[str, Any]:
    """One replica of ``GET /replicas``: state, load view, KV-event feed, health, token-id forwarding (its URL
    only when ``show_url``)."""
    return {
        "name": r.name,
        "index": r.index,
        "url": r.url if show_url else None,
        "state": r.state.value,
        "dialect": r.dialect,
        "role": r.role,
        "models": r.models,
        "loras": r.loras,
        "load": dataclasses.asdict(r.load),
        "kv_events": signals.feed_status(svc.kv_events, r),
        "health": svc.membership.health_of(r.name),
        "token_ids": svc.token_ids.state(r),
        "engine": svc.engine_metrics.engine_info(r.index),
        "pd": svc.router.pd_state(r.index),
    }


def _install_openapi(app: FastAPI) -> None:
    """OpenAPI with the request body models the data-plane routes parse themselves."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            _, defs = models_json_schema(
                [(m, "validation") for m in _BODY_MODELS], ref_template="#/components/schemas/{model}"
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_BODY_MODELS: list[type[BaseModel]] = [
    CompletionRequest,
    ChatRequest,
    RouteBody,
    ResponsesRequest,
    EngineBody,
]

#: OpenAPI requestBody of the audio routes (multipart: a ``file`` and text fields, forwarded as sent)
_MULTIPART_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "model": {"type": "string"},
                        "stream": {"type": "string", "enum": ["true", "false"]},
                    },
                }
            }
        },
    }
}


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI requestBody for a route that parses its JSON body itself (any content type accepted)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }
