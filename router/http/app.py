"""The kvroute HTTP service: FastAPI app, request models, routes and the wiring of every component.

Routes (OpenAPI at ``/openapi.json``):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI-compatible; routed by ``router.core.routing`` and
  forwarded by ``router.engine.proxy`` (streaming SSE and not).
* ``GET /v1/models``: the union of the replicas' models and LoRA adapters.
* ``POST /route``: the same body as completions or chat, or ``{"model": ..., "token_ids": [...]}``; returns the
  decision (chosen replica name and URL; every candidate's predicted TTFT with Q, R, C, p and matched tokens per
  tier) without forwarding.
* ``GET /replicas``, ``GET /index/stats``, ``GET /metrics``, ``GET /healthz`` (alive), ``GET /readyz`` (at least
  one replica routable).

Errors are OpenAI-style JSON ``{"error": {"message", "type", "code", "param"}}``: invalid JSON -> 400, missing or
invalid fields -> 422 naming the field, unknown model -> 404, body over ``max_request_bytes`` -> 413, router
at its in-flight limit -> 429 with ``Retry-After``, no routable replica -> 503 with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Annotated, Any, Literal, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic.json_schema import models_json_schema
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from membership.replicas import Replica
from policies.admission_slo import best_predicted_ttft_s, predicted_ttft_s
from policies.base import Reuse
from router import signals
from router.config import Settings
from router.core.admission import Rejected
from router.core.routing import Routed, RoutingError, RoutingInput, decision_json
from router.core.tenant_admission import Ticket, bad_identity_response, rejection_response
from router.core.tenants import BadIdentity, Identity
from router.engine.proxy import new_request_id
from router.errors import error_response
from router.serve.guard import Guard
from router.serve.idempotency import HEADER as IDEMPOTENCY_HEADER
from router.serve.intake import Intake, LimitExceeded, dump_messages, not_a_bool, sequences
from router.services import Services, build_services, run
from router.telemetry import CONTENT_TYPE, Telemetry
from router.tokens.frontier import FrontierIds, frontier_ids, frontier_tokenizer
from router.tokens.token_ids import IdsPrompt, ids_prompt
from router.tokens.tokenizer import HfTokenizer, TokenizerError

log = logging.getLogger("kvroute.app")
_M = TypeVar("_M", bound=BaseModel)

# ---------------------------------------------------------------------------------------------------------
# request models (documented in OpenAPI; unknown fields are kept and forwarded to the engine)
# ---------------------------------------------------------------------------------------------------------

#: largest max_tokens accepted (engines cap it by their context length anyway), tokens
_MAX_TOKENS = (1 << 31) - 1
#: a token id as the engines take it (uint32); the schema says so, so clients and fuzzers know the bounds
TokenId = Annotated[int, Field(ge=0, lt=1 << 32), BeforeValidator(not_a_bool)]  # true is not 1
PromptT = str | list[TokenId] | list[str] | list[list[TokenId]]


class ChatMessage(BaseModel):
    """One chat message (``content`` is text or a list of ``{"type": "text", "text": ...}`` parts)."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(description="system | user | assistant | tool | ...")
    content: str | list[dict[str, Any]] | None = Field(default=None, description="message text or parts")


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, description="model id (or LoRA adapter name) to serve the request")
    stream: bool = Field(default=False, description="stream the answer as server-sent events")
    max_tokens: int | None = Field(
        default=None, ge=0, le=_MAX_TOKENS, description="maximum tokens to generate"
    )
    cache_salt: str | None = Field(default=None, description="isolates the prefix cache (vLLM cache_salt)")


class CompletionRequest(_Common):
    """``POST /v1/completions`` body (OpenAI completions; extra fields are forwarded unchanged)."""

    prompt: PromptT = Field(description="prompt text or token ids (a batch is routed by its first prompt)")


class ChatRequest(_Common):
    """``POST /v1/chat/completions`` body (OpenAI chat; extra fields are forwarded unchanged)."""

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_completion_tokens: int | None = Field(
        default=None, ge=0, le=_MAX_TOKENS, description="maximum tokens to generate"
    )
    add_generation_prompt: bool = Field(default=True, description="append the assistant turn header")
    tools: list[dict[str, Any]] | None = Field(default=None, description="tool definitions for the template")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="extra template variables")


def _one_input_schema(schema: dict[str, Any]) -> None:
    """OpenAPI of RouteBody: exactly one of prompt / messages / token_ids, none of them null."""
    props = schema.get("properties", {})
    for key in _ROUTE_INPUTS:
        prop = props.get(key, {})
        options = [o for o in prop.pop("anyOf", []) if o.get("type") != "null"]
        if len(options) == 1:
            prop.update(options[0])
        elif options:
            prop["anyOf"] = options
        prop.pop("default", None)
    schema["oneOf"] = [{"required": [key]} for key in _ROUTE_INPUTS]


_ROUTE_INPUTS = ("prompt", "messages", "token_ids")


class RouteBody(_Common):
    """``POST /route`` body: a completions body (``prompt``), a chat body (``messages``) or ``token_ids``."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_one_input_schema)
    prompt: PromptT | None = Field(default=None, description="completions prompt")
    messages: list[ChatMessage] | None = Field(default=None, description="chat messages")
    token_ids: list[TokenId] | None = Field(default=None, description="prompt token ids (already tokenized)")
    add_generation_prompt: bool = Field(default=True, description="chat: append the assistant turn header")
    tools: list[dict[str, Any]] | None = Field(default=None, description="chat: tool definitions")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="chat: template variables")

    @model_validator(mode="before")
    @classmethod
    def _one_input(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = [k for k in _ROUTE_INPUTS if k in data]
            if len(given) != 1 or data[given[0]] is None:
                raise ValueError(
                    "exactly one of 'prompt', 'messages' or 'token_ids' is required (not null)"
                    + (f" (got {', '.join(given)})" if given else "")
                )
        return data


class ErrorDetail(BaseModel):
    """An error."""

    message: str
    type: str
    code: str | int | None = None
    param: str | None = None


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
        route = path if path in _KNOWN_ROUTES else "other"
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
    #: path -> endpoint served directly (empty until ``enable_fast_path``; never mutated in place)
    _fast_routes: Mapping[str, Callable[[Request], Awaitable[Response]]] = MappingProxyType({})

    def enable_fast_path(
        self, routes: dict[str, Callable[[Request], Awaitable[Response]]], telemetry: Telemetry, max_body: int
    ) -> None:
        """Serve ``routes`` (path -> endpoint taking the Request) directly for POST requests."""
        self._fast_routes = routes
        self._fast_telemetry = telemetry
        self._fast_max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry: the data-plane routes directly, everything else through FastAPI."""
        guard = self.guard  # router/serve/guard.py: auth and shedding from the headers, before any body
        if guard is not None and scope["type"] == "http":
            if not await guard.admit(scope, send):
                return
            if guard.counts(scope):
                with guard.working():  # the router's request work, which the shedding decision watches
                    await self._route(scope, receive, send)
                return
        await self._route(scope, receive, send)

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
            request._body = parts[0] if len(parts) == 1 else b"".join(parts)  # what Request.body() caches
            try:
                response = await self._fast_routes[path](request)
            except (asyncio.CancelledError, ClientDisconnect):
                raise
            except Exception as exc:
                handler = next(
                    (self.exception_handlers[c] for c in type(exc).__mro__ if c in self.exception_handlers),
                    None,
                )
                if handler is None:
                    log.exception("unhandled error", extra={"path": path})
                    response = error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
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
            self._fast_telemetry.requests.labels(path, str(status)).inc()


async def _send_error(send: Send, status: int, message: str, code: str) -> None:
    resp = error_response(status, message, code)
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
    auth = _Auth(svc.guard)
    _add_data_plane(app, _DataPlane(svc, auth))
    _add_control_plane(app, svc, auth)
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
    return app


def _add_middleware(app: FastAPI, svc: Services) -> None:
    settings = svc.settings
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(_Edge, telemetry=svc.telemetry, max_body=settings.max_request_bytes)


def _add_error_handlers(app: FastAPI, svc: Services) -> None:
    """Map the exceptions of the routes to OpenAI-style JSON errors."""
    settings = svc.settings

    @app.exception_handler(LimitExceeded)
    async def _limit(request: Request, exc: LimitExceeded) -> Response:  # router/serve/intake.py input limits
        svc.telemetry.rejected.labels(exc.code).inc()
        return error_response(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        if any(e.get("type") in ("json_invalid", "json_type") for e in errors):
            msg = next((str(e.get("msg")) for e in errors if e.get("type") == "json_invalid"), "invalid JSON")
            return error_response(400, f"request body is not valid JSON: {msg}", "invalid_json")
        parts, first_param = [], None
        for e in errors:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            name = ".".join(loc) or "body"
            first_param = first_param or name
            parts.append(f"{name}: {e.get('msg')}")
        body = orjson.loads(error_response(422, "; ".join(parts), "invalid_request", first_param).body)
        body["detail"] = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg")), "type": e.get("type")} for e in errors
        ]
        return JSONResponse(body, status_code=422)

    @app.exception_handler(RoutingError)
    async def _routing(request: Request, exc: RoutingError) -> Response:
        headers = {"retry-after": str(settings.retry_after_s)} if exc.status in (429, 503) else None
        return error_response(exc.status, exc.message, exc.code, exc.param, headers=headers)

    @app.exception_handler(BadIdentity)
    async def _bad_identity(request: Request, exc: BadIdentity) -> Response:  # router/core/tenants.py headers
        svc.telemetry.rejected.labels("bad_identity").inc()
        return bad_identity_response(exc)

    @app.exception_handler(Rejected)
    async def _rejected(
        request: Request, exc: Rejected
    ) -> Response:  # router/core/tenant_admission.py precheck
        svc.telemetry.rejected.labels(exc.reason).inc()
        return rejection_response(exc, settings.retry_after_s)

    @app.exception_handler(TokenizerError)
    async def _tok(request: Request, exc: TokenizerError) -> Response:
        return error_response(400, str(exc), "tokenization_failed")

    @app.exception_handler(_Forbidden)
    async def _forbidden(request: Request, exc: _Forbidden) -> Response:
        return error_response(403, str(exc), "forbidden")

    @app.exception_handler(_AuthError)
    async def _auth(request: Request, exc: _AuthError) -> Response:
        msg = str(exc) or "missing or invalid API key (Authorization: Bearer <key>)"
        return error_response(401, msg, "unauthorized", headers={"www-authenticate": "Bearer"})

    @app.exception_handler(_BadTokens)
    async def _bad_tokens(request: Request, exc: _BadTokens) -> Response:
        return error_response(422, "token ids must be integers in [0, 2**32)", "invalid_request", "token_ids")


class _Auth:
    """Client API keys (data plane) and the admin token (control plane), checked by ``router.serve.guard.Auth``."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard.auth

    def check_client(self, request: Request) -> None:
        """Raises _AuthError unless the request carries one of the API keys (when any is configured)."""
        if not self.guard.client_ok(request.headers.get("authorization")):
            raise _AuthError()

    def check_admin(self, request: Request) -> None:
        """Admin / introspection endpoints: the admin token when configured, else an API key when configured."""
        status, message = self.guard.admin_status(request.headers.get("authorization"))
        if status:
            raise _AuthError(message) if status == 401 else _Forbidden(message)

    def is_admin(self, request: Request) -> bool:
        """May the caller see replica URLs (internal addresses)?"""
        return self.guard.is_admin(request.headers.get("authorization"))


class _DataPlane:
    """The routed requests: body -> routing input -> admission -> decision -> proxy."""

    def __init__(self, svc: Services, auth: _Auth) -> None:
        self.svc = svc
        self.auth = auth
        self.settings = svc.settings

    async def routing_input(
        self,
        request: Request,
        body: _Common,
        *,
        prompt: Any = None,
        messages: list[ChatMessage] | None = None,
        token_ids: list[int] | None = None,
        chat: dict[str, Any] | None = None,
        max_out: int | None = None,
    ) -> RoutingInput:
        """Tokenize (unless ids were given), hash and bundle what the request contributes to a decision."""
        svc = self.svc
        # identity first (router/core/tenants.py): a bad tenant / priority / TTFT-target header is a 400 before any work
        ident = svc.tenants.identify(
            request.headers, (body.model_extra or {}).get(svc.tenants.cfg.priority_body_field)
        )
        await svc.tenants.precheck(
            ident, max_out or body.max_tokens
        )  # an empty bucket: 429 before tokenizing
        model, lora, base = svc.router.resolve_model(body.model)
        namespace = ident.tenant if ident.policy.isolate_cache else None
        # ids from the request body were validated by the schema (TokenId: 0 <= id < 2**32): no second pass
        in_range = token_ids is not None
        walked: FrontierIds | None = None
        if token_ids is None:
            url = _tokenize_url(svc, model, lora)
            scope = self._frontier_scope(model, lora, messages is None)
            seed = svc.router.seed_for(base, lora, body.cache_salt, namespace) if scope is not None else 0
            if messages is not None:
                chat = chat or {}
                msgs = await dump_messages(messages)
                chat_args = (
                    chat.get("add_generation_prompt", True),
                    chat.get("tools"),
                    chat.get("chat_template_kwargs"),
                )
                if scope is not None:  # cache-frontier tokenization of the rendered template text
                    token_ids, walked = await self._frontier_ids(
                        scope, await scope.render(msgs, *chat_args), False, seed
                    )
                else:
                    token_ids = await svc.tokenizer.encode_chat(
                        msgs,
                        model=body.model,
                        url=url,
                        add_generation_prompt=chat_args[0],
                        tools=chat_args[1],
                        template_kwargs=chat_args[2],
                    )
            else:
                first = (
                    prompt[0]
                    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
                    else prompt
                )
                if isinstance(first, list):
                    token_ids = list(first)  # already ints (validated as list[TokenId])
                    in_range = True
                elif isinstance(first, str) and scope is not None:
                    token_ids, walked = await self._frontier_ids(scope, first, True, seed)
                elif isinstance(first, str):
                    token_ids = await svc.tokenizer.encode_prompt(first, model=body.model, url=url)
                else:
                    token_ids = list(first or [])
        if not in_range and token_ids and (min(token_ids) < 0 or max(token_ids) >= 1 << 32):
            raise _BadTokens()  # e.g. an engine /tokenize answer out of range
        if not in_range:
            self._count_tokenized(len(token_ids), walked)
        inp = svc.router.make_input(
            model,
            lora,
            token_ids,
            base_model=base,
            cache_salt=body.cache_salt,
            session_id=request.headers.get(self.settings.session_header),
            request_id=new_request_id(request.headers.get("x-request-id")),
            expected_output_tokens=max_out or body.max_tokens or 0,
            copies=sequences(body.model_extra),
            namespace=namespace,
            ttft_target_s=ident.ttft_target_s,
            priority=ident.priority,
            keys=walked.keys if walked is not None else None,
            estimated_tokens=None if walked is None or walked.complete else walked.estimated_tokens,
        )
        inp.identity = ident
        return inp

    def _frontier_scope(self, model: str, lora: str | None, add_special_tokens: bool) -> HfTokenizer | None:
        """The tokenizer for cache-frontier tokenization of this request's text (router/tokens/frontier.py), or
        None to tokenize it whole (``tokenize_scope=prompt``, or the tokenizer / fleet does not allow it)."""
        if self.settings.tokenize_scope != "cached_prefix":
            return None
        return frontier_tokenizer(self.svc.tokenizer, self.svc.router, model, lora, add_special_tokens)

    async def _frontier_ids(
        self, tok: HfTokenizer, text: str, add_special_tokens: bool, seed: int
    ) -> tuple[list[int], FrontierIds | None]:
        """Ids of ``text``: whole when it is no longer than the lookahead (as without the frontier: exact ids),
        else only as deep as the fleet's cache (with the walk's ``FrontierIds``)."""
        if len(text) <= self.settings.tokenize_lookahead_chars:
            return await tok.encode_prefix(text, len(text), [], 0, add_special_tokens), None
        walked = await frontier_ids(
            tok, text, add_special_tokens, self.settings.tokenize_lookahead_chars, self.svc.router, seed
        )
        return walked.token_ids, walked

    def _count_tokenized(self, tokenized: int, walked: FrontierIds | None) -> None:
        """Metrics of a prompt the router tokenized: its tokenized tokens, and for partial ids the estimated rest."""
        tel = self.svc.telemetry
        tel.tokenize_tokens.labels("tokenized").inc(tokenized)
        if walked is not None and not walked.complete:
            tel.tokenize_tokens.labels("estimated").inc(walked.estimated_tokens - tokenized)
            tel.partial_ids.inc()

    async def serve(
        self, request: Request, inp: RoutingInput, path: str, stream: bool, ids: IdsPrompt | None = None
    ) -> Response:
        """Serve once per Idempotency-Key (router/serve/idempotency.py), else serve."""
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if key is not None:
            return await self.svc.idempotency.handle(
                key,
                path,
                await request.body(),
                stream,
                inp.request_id,
                lambda: self._serve(request, inp, path, stream, ids),
                principal=self.auth.guard.principal(request.headers.get("authorization")),
            )
        return await self._serve(request, inp, path, stream, ids)

    async def _serve(
        self, request: Request, inp: RoutingInput, path: str, stream: bool, ids: IdsPrompt | None
    ) -> Response:
        """Admission (router/core/tenant_admission.py: SLO check, tenant quota, the fair queue of the in-flight limit),
        decision, then the proxy."""
        svc = self.svc
        ident: Identity = inp.identity if inp.identity is not None else svc.tenants.identify({})
        routed: Routed | None = None
        try:
            if (
                ident.ttft_target_s is not None
            ):  # price it first: an unattainable target is refused, not queued
                routed = await self.decide(inp)
                svc.tenants.check_slo(
                    ident, best_predicted_ttft_s(routed.decision.scores, routed.decision.ranking)
                )
            ticket: Ticket = await svc.tenants.admit(
                ident, inp.prompt_tokens, inp.expected_output_tokens or None
            )
        except Rejected as exc:
            svc.telemetry.rejected.labels(exc.reason).inc()
            return rejection_response(exc, self.settings.retry_after_s)
        try:
            if routed is None or ticket.waited_s > 0:  # decided after any wait: the fleet moved meanwhile
                routed = await self.decide(inp)
            body = await request.body()
        except BaseException:
            ticket.release()
            raise
        chosen = routed.decision.chosen
        score = next((s for s in routed.decision.scores if s.index == chosen), None)
        svc.tenants.serving(
            ident, predicted_ttft_s(score) if score is not None else None, routed.cached_tokens.get(chosen, 0)
        )
        return await svc.proxy.forward(
            request,
            routed,
            path,
            body,
            stream=stream,
            request_id=inp.request_id,
            on_done=ticket.release,
            ids=ids,
        )

    async def decide(self, inp: RoutingInput, exclude: Sequence[int] = ()) -> Routed:
        """The decision for a request to forward (session affinity first, when on), counted and logged;
        ``exclude``: replica indexes that may not be picked (the endpoint picker's subset hint)."""
        svc = self.svc
        # --- membership: session affinity (opt-in; X-Session-Id pinned through Redis while routable) ---
        mem = svc.membership if self.settings.session_affinity and inp.session_id else None
        pinned = await mem.session_replica(inp.session_id) if mem is not None else None
        if pinned is not None and pinned.index in exclude:
            pinned = None
        try:
            routed = svc.router.decide(
                inp,
                exclude=[r.index for r in svc.table.all() if r is not pinned]
                if pinned is not None
                else exclude,
            )
        except RoutingError:
            if pinned is None:
                raise
            routed = svc.router.decide(inp, exclude)  # pinned replica cannot take it now: route normally
        svc.telemetry.decision_seconds.observe(routed.decision_s)
        if routed.decision.reuse is not None:
            svc.telemetry.observe_reuse(routed.decision.reuse)
        chosen = svc.table.by_index(routed.decision.chosen)
        if mem is not None and chosen is not None:
            await mem.remember_session(inp.session_id, chosen)
        svc.telemetry.routed.labels(
            routed.decision.policy, routed.decision.branch, chosen.name if chosen else "?"
        ).inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "routed",
                extra={
                    "request_id": inp.request_id,
                    "model": inp.model,
                    "prompt_tokens": inp.prompt_tokens,
                    "replica": chosen.name if chosen else None,
                    "branch": routed.decision.branch,
                    "cached_tokens": routed.cached_tokens.get(routed.decision.chosen, 0),
                    "decision_s": round(routed.decision_s, 6),
                },
            )
        return routed

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        self.auth.check_client(request)
        body, data = await _parse(self.svc.intake, request, CompletionRequest)
        inp = await self.routing_input(request, body, prompt=body.prompt)
        # a text prompt may reach the engine as the ids just computed (router/tokens/token_ids.py decides per replica)
        check = self.svc.proxy.token_ids
        # ... only when they are all of the prompt's ids (cache-frontier tokenization may stop early: text then)
        ids = (
            ids_prompt(data, inp.token_ids)
            if check and check.mode != "off" and inp.lora is None and not inp.ids_partial
            else None
        )
        return await self.serve(request, inp, "/v1/completions", body.stream, ids)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        self.auth.check_client(request)
        body, _ = await _parse(self.svc.intake, request, ChatRequest)
        inp = await self.routing_input(
            request,
            body,
            messages=body.messages,
            chat={
                "add_generation_prompt": body.add_generation_prompt,
                "tools": body.tools,
                "chat_template_kwargs": body.chat_template_kwargs,
            },
            max_out=body.max_completion_tokens,
        )
        return await self.serve(request, inp, "/v1/chat/completions", body.stream)

    async def models(self, request: Request) -> Any:
        """``GET /v1/models``."""
        self.auth.check_client(request)
        return {"object": "list", "data": self.svc.router.served_models()}

    async def route(self, request: Request) -> Any:
        """``POST /route``: the decision, not forwarded."""
        self.auth.check_client(request)
        body, _ = await _parse(self.svc.intake, request, RouteBody)
        inp = await self.routing_input(
            request,
            body,
            prompt=body.prompt,
            messages=body.messages,
            token_ids=body.token_ids,
            chat={
                "add_generation_prompt": body.add_generation_prompt,
                "tools": body.tools,
                "chat_template_kwargs": body.chat_template_kwargs,
            },
        )
        routed = self.svc.router.decide(inp)
        self.svc.telemetry.decision_seconds.observe(routed.decision_s)
        out = decision_json(
            routed, self.svc.table, self.settings.block_size, show_urls=self.auth.is_admin(request)
        )
        out["reuse"] = _reuse_json(routed.decision.reuse)
        return out


def _add_data_plane(app: _KvrouteApp, dp: _DataPlane) -> None:
    """The OpenAI-compatible routes, ``/v1/models`` and ``/route``."""
    app.post(
        "/v1/completions",
        responses=_ROUTE_ERRORS,
        response_model=None,
        openapi_extra=_body_doc(CompletionRequest),
        summary="OpenAI completions, routed to the replica with the lowest expected TTFT",
    )(dp.completions)
    app.post(
        "/v1/chat/completions",
        responses=_ROUTE_ERRORS,
        response_model=None,
        openapi_extra=_body_doc(ChatRequest),
        summary="OpenAI chat completions, routed through the chat template",
    )(dp.chat_completions)
    if (
        not dp.settings.cors_origins
    ):  # CORS headers come from a middleware: keep those requests on the normal path
        app.enable_fast_path(
            {"/v1/completions": dp.completions, "/v1/chat/completions": dp.chat_completions},
            dp.svc.telemetry,
            dp.settings.max_request_bytes,
        )
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


_BODY_MODELS: list[type[BaseModel]] = [CompletionRequest, ChatRequest, RouteBody]


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI requestBody for a route that parses its JSON body itself (any content type accepted)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


async def _parse(intake: Intake, request: Request, model: type[_M]) -> tuple[_M, Any]:
    """Parse the request body as JSON (whatever the content type) and validate it against ``model``; returns the
    validated model and the parsed JSON it came from. Router-controlled fields (router/serve/client_fields.py) are
    removed from both and from the body that goes on (``request.body()`` then returns the body without them).

    Raises:
        RequestValidationError: invalid JSON (``json_invalid``, answered 400) or invalid fields (422).
        LimitExceeded: an input limit (router/serve/intake.py).
    """
    raw = await request.body()
    parsed, data = await intake.parse(
        raw, model
    )  # router/serve/intake.py: limits first, large bodies off the loop
    if intake.fields is not None and (clean := await intake.fields.strip(raw, data)) is not None:
        request._body = clean  # what Request.body() returns from now on: the proxy and the picker forward it
    return parsed, data


class _AuthError(Exception):
    """Missing or invalid client API key (answered 401)."""


class _Forbidden(Exception):
    """An admin route without the admin token (answered 403)."""


class _BadTokens(Exception):
    """Token ids outside [0, 2**32) (answered 422)."""


def _tokenize_url(svc: Services, model: str, lora: str | None) -> str | None:
    """For ``engine`` tokenizer mode: the URL of a routable replica serving the model (fewest in flight)."""
    if svc.tokenizer.mode != "engine":
        return None
    reps = svc.table.routable(None if lora else model, lora)
    if not reps:
        return None
    return min(reps, key=lambda r: r.load.inflight_requests).url
