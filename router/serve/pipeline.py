"""The serving pipeline: one request's way through the router, the same for every front door.

The HTTP app (``router.http``) and the endpoint picker (``router.epp``) only translate (ASGI, ext_proc) and call
these steps in this order; a rule added here reaches every door:

1. ``guard``: authorization on the normalized request and load shedding, from the headers alone;
2. ``parse``: body limits, JSON, the request model, router-controlled fields stripped (``router.serve.intake``);
3. ``identify``: tenant, priority class, TTFT target; the tenant's quota precheck, before any tokenizing;
4. ``tokenize``: the prompt's token ids (the cache frontier or the whole prompt) and block keys ->
   ``RoutingInput``; ``prepare`` runs 2-4 for a generation request (``Prepared``), ``prepare_engine`` for the
   engines' other endpoints (``router.serve.endpoints``: the Responses API with its chains pinned to the replica
   holding them, ``router.serve.responses``; pooling, tokenize, audio, SGLang's ``/generate``);
5. ``admit``: a request with a TTFT target is priced first (refused when unattainable), then the tenant's quota
   and a slot of the in-flight limit (a ``Ticket``, released exactly once);
6. ``decide``: session affinity, then ``Router.decide`` (co-located) or ``Router.decide_plan`` (PD), counted
   and logged (``admit`` decides again after any wait in the queue);
7. ``dispatch`` (the doors that forward bytes): chosen from the plan (``router.serve.dispatch``): the attempts
   in place, or the two legs through the plan's protocol runner; released when the response ends;
8. finish: usage, TTFT and calibration when the answer ends (``router.engine.feedback``), the hold and the ticket
   released.

Every refusal is a ``router.errors.KvrouteError``; the door renders it.

Units: tokens, seconds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import orjson
from pydantic import BaseModel
from starlette.responses import Response

from index.hashing import mm_block_keys
from membership.replicas import Replica, ReplicaTable
from membership.runtime import Membership
from policies.admission_slo import best_predicted_ttft_s, predicted_ttft_s
from router.core.regions import (
    ALLOWED_REGIONS_HEADER,
    CLIENT_REGION_HEADER,
    HOP_HEADER,
    allowed_regions,
    client_region_trusted,
)
from router.core.routing import NoReplica, Routed, Router, RoutingError, RoutingInput
from router.core.tenant_admission import TenantAdmission, Ticket
from router.core.tenants import Identity
from router.engine.attempt import OPENAI, Wire
from router.errors import BadTokenIds, KvrouteError, as_refusal
from router.serve.dispatch import Dispatcher
from router.serve.endpoints import ENGINE_POST_ROUTES, Kind, multipart_field, response_route, route_key
from router.serve.guard import Guard
from router.serve.intake import Intake, dump_messages, sequences
from router.serve.requests import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    EngineBody,
    RequestCommon,
    ResponsesRequest,
    new_request_id,
)
from router.serve.responses import ResponseChains, conversation
from router.telemetry import Telemetry
from router.tokens.frontier import FrontierIds, frontier_ids, frontier_tokenizer
from router.tokens.images import (
    ImageRenderer,
    has_image_parts,
    render_key,
    scope_image_uuids,
    tenant_scope,
    text_parts,
)
from router.tokens.token_ids import IdsPrompt, TokenIdsCheck, ids_prompt
from router.tokens.tokenizer import HfTokenizer, Tokenizer, engine_call_headers
from router.tracing import RequestTrace, Tracing, request_trace

log = logging.getLogger("kvroute.app")
_M = TypeVar("_M", bound=BaseModel)
#: the step of a request that is not traced (reusable: nothing is allocated per request)
_UNTRACED: AbstractContextManager[Any] = nullcontext()


def _step(trace: RequestTrace | None, name: str) -> AbstractContextManager[Any]:
    """A traced step's child span (``RequestTrace.step``), or nothing when the request is not traced."""
    return _UNTRACED if trace is None else trace.step(name)


#: the generation routes and the body each takes
GENERATION_ROUTES: Mapping[str, type[CompletionRequest] | type[ChatRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
}


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """What the pipeline's own steps read from the configuration; ``router.services`` builds it from the routing,
    shared-state, regions and tokenizer sub-configs (no defaults here: they live in ``router.config`` only)."""

    #: HTTP header carrying a client session id (routing's ``session_header``)
    session_header: str
    #: pin a session to its replica while routable (shared state's ``session_affinity``)
    session_affinity: bool
    #: this router's region; empty = regions off (``region``)
    region: str
    #: how much of a long text prompt is tokenized (tokenizer's ``tokenize_scope``)
    tokenize_scope: Literal["prompt", "cached_prefix"]
    #: texts up to this many characters are tokenized whole (``tokenize_lookahead_chars``), characters
    tokenize_lookahead_chars: int
    #: the first prefix of a walk (``tokenize_first_prefix_chars``), characters
    tokenize_first_prefix_chars: int


@dataclass(slots=True)
class Parsed(Generic[_M]):
    """A parsed body: the validated model, the JSON it came from, and the bytes that go on to the engine (the
    router-controlled fields stripped, ``router.serve.client_fields``)."""

    model: _M
    data: Any
    body: bytes


@dataclass(slots=True)
class Prepared:
    """A generation request after parse, identify and tokenize: what admission, the decision and dispatch need.

    Attributes:
        path: the OpenAI route (``/v1/completions``, ``/v1/chat/completions``).
        inp: the routing input (its ``identity`` set).
        body: the body that goes on to the engine (bytes).
        stream: the client asked for a streamed answer.
        ids: the prompt as the router's token ids, for replicas that take them (None: the text goes).
        wire: the request's wire beyond the OpenAI generation default (``router.engine.attempt.Wire``).
    """

    path: str
    inp: RoutingInput
    body: bytes
    stream: bool
    ids: IdsPrompt | None = None
    #: how it goes to the engine (method, content type, stream kind, the answer's reader)
    wire: Wire = OPENAI


@dataclass(slots=True)
class Admitted:
    """An admitted request: its decision, and the admission slot to release exactly once when it is over."""

    routed: Routed
    ticket: Ticket


@dataclass(slots=True)
class ChatInput:
    """What a chat request adds to tokenizing: its messages and the template's arguments."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None


def chat_input(body: Any) -> ChatInput | None:
    """The chat part of a parsed body (None when it has no ``messages``)."""
    messages = getattr(body, "messages", None)
    if messages is None:
        return None
    return ChatInput(messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs)


class Pipeline:
    """The serving pipeline's steps (see the module docstring), on the components the composition root built.

    Args:
        config: what the steps read from the configuration (session header and affinity, region, tokenize
            scope).
        telemetry: metrics.
        table: the replica table.
        router: decisions and accounting.
        tokenizer: prompt -> token ids.
        tenants: identity and admission.
        intake: body limits and parsing.
        membership: session affinity (Redis).
        guard: authorization and shedding from the headers.
        token_ids: which replicas take prompts as token ids.
        dispatcher: dispatch (in place or by the plan).
        images: renders image chats on an engine (``router.tokens.images``); None: image chats are routed
            unkeyed.
        chains: the Responses API's response id -> replica and conversation maps.
        tracing: spans of the steps and trace context to the engines (router/tracing.py); None: off.
    """

    def __init__(
        self,
        config: PipelineConfig,
        telemetry: Telemetry,
        table: ReplicaTable,
        router: Router,
        tokenizer: Tokenizer,
        tenants: TenantAdmission,
        intake: Intake,
        membership: Membership,
        guard: Guard,
        token_ids: TokenIdsCheck,
        dispatcher: Dispatcher,
        chains: ResponseChains,
        images: ImageRenderer | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config
        self.images = images
        self.telemetry = telemetry
        self.table = table
        self.router = router
        self.tokenizer = tokenizer
        self.tenants = tenants
        self.intake = intake
        self.membership = membership
        self.gate = guard
        self.token_ids = token_ids
        self.dispatcher = dispatcher
        self.chains = chains
        self.tracing = tracing

    # -- 1. guard ------------------------------------------------------------------------------------------
    async def guard(self, method: str, path: str, authorization: str | None) -> None:
        """Authorization and shedding from the headers (``path`` normalized). Raises the refusal."""
        refusal = await self.gate.check(method, path, authorization)
        if refusal is not None:
            raise refusal

    # -- 2. parse ------------------------------------------------------------------------------------------
    async def parse(self, raw: bytes, model: type[_M]) -> Parsed[_M]:
        """Parse ``raw`` as JSON (whatever the content type) and validate it against ``model``; router-controlled
        fields are removed from the model, the JSON and the body that goes on.

        Raises:
            InvalidBody (via ``router.errors.as_error``): invalid JSON (400) or invalid fields (422);
            LimitExceeded: an input limit.
        """
        parsed, data = await self.intake.parse(raw, model)  # limits first, large bodies off the loop
        fields = self.intake.fields
        clean = await fields.strip(raw, data) if fields is not None else None
        return Parsed(parsed, data, raw if clean is None else clean)

    # -- 3. identify ---------------------------------------------------------------------------------------
    async def identify(
        self, headers: Mapping[str, str], body: RequestCommon, max_out: int | None
    ) -> Identity:
        """Tenant, class and TTFT target (a bad header is a 400 before any work), then the tenant's quota
        precheck (an empty bucket: 429 before tokenizing)."""
        tenants = self.tenants
        ident = tenants.identify(headers, (body.model_extra or {}).get(tenants.cfg.priority_body_field))
        await tenants.precheck(ident, max_out or body.max_tokens)
        return ident

    # -- 4. tokenize ---------------------------------------------------------------------------------------
    async def tokenize(
        self,
        headers: Mapping[str, str],
        body: RequestCommon,
        ident: Identity,
        *,
        prompt: Any = None,
        chat: ChatInput | None = None,
        token_ids: list[int] | None = None,
        max_out: int | None = None,
        image_chat: dict[str, Any] | None = None,
    ) -> RoutingInput:
        """Tokenize (unless ids were given), hash and bundle what the request contributes to a decision.
        ``image_chat``: the body of a chat with images (its uuids scoped): its ids and images come from an
        engine's render endpoint, else it is routed unkeyed."""
        model, lora, base = self.router.resolve_model(body.model)
        namespace = ident.tenant if ident.policy.isolate_cache else None
        walked: FrontierIds | None = None
        keys: list[int] | None = None
        if image_chat is not None:
            token_ids, keys = await self._image_ids(
                image_chat, body, (model, lora, base), ident.tenant, namespace, chat
            )
        # ids from the request body were validated by the schema (TokenId: 0 <= id < 2**32): no second pass
        if token_ids is None:
            token_ids, walked, checked = await self._token_ids(
                body, model, lora, base, namespace, prompt, chat
            )
            if not checked:
                if token_ids and (min(token_ids) < 0 or max(token_ids) >= 1 << 32):
                    raise BadTokenIds()  # e.g. an engine /tokenize answer out of range
                self._count_tokenized(len(token_ids), walked)
        inp = self.router.make_input(
            model,
            lora,
            token_ids,
            base_model=base,
            cache_salt=body.cache_salt,
            session_id=headers.get(self.config.session_header.lower()),
            request_id=new_request_id(headers.get("x-request-id")),
            expected_output_tokens=max_out or body.max_tokens or 0,
            copies=sequences(body.model_extra),
            namespace=namespace,
            ttft_target_s=ident.ttft_target_s,
            priority=ident.priority,
            keys=walked.keys if walked is not None else keys,
            estimated_tokens=None if walked is None or walked.complete else walked.estimated_tokens,
        )
        inp.identity = ident
        self._regional(inp, headers, ident)
        return inp

    def _regional(self, inp: RoutingInput, headers: Mapping[str, str], ident: Identity) -> None:
        """Where the request may go (router/core/regions.py): a hop from another region's router is never
        forwarded again; with regions on, the regions allowed to process it (the tenant's list, narrowed by the
        header) and the client's region (an edge's header; ignored and counted from other callers)."""
        inp.hop = HOP_HEADER in headers
        if not self.config.region:
            return
        inp.allowed_regions = allowed_regions(
            ident.policy.allowed_regions, headers.get(ALLOWED_REGIONS_HEADER)
        )
        client = headers.get(CLIENT_REGION_HEADER)
        if client is None or inp.hop:  # a hop is served in this region whatever the client's region
            return
        cfg = self.tenants.cfg
        if client_region_trusted(headers.get("authorization"), cfg.header_keys, cfg.client_keys_required):
            inp.client_region = client.strip()
        else:
            self.telemetry.region_headers_ignored.labels(CLIENT_REGION_HEADER).inc()

    async def _image_ids(
        self,
        data: dict[str, Any],
        body: RequestCommon,
        names: tuple[str, str | None, str],
        tenant: str,
        namespace: str | None,
        chat: ChatInput | None,
    ) -> tuple[list[int], list[int]]:
        """An image chat's ids and block keys: rendered by a replica serving the model (the images folded into
        the keys exactly as the engine's events fold them; the answer cached per tenant, model and rendered
        fields), else the text's ids and no keys (routed by load). ``names``: (model, adapter, base model)."""
        model, lora, base = names
        rendered = None
        if self.images is not None:
            key = render_key(tenant, model, lora, data)
            rendered = await self.images.render_cached(key, self._render_url(model, lora), data)
        if rendered is not None:
            self.telemetry.image_prompts.labels("rendered").inc()
            seed = self.router.seed_for(base, lora, body.cache_salt, namespace)
            ids = rendered.token_ids
            return ids, mm_block_keys(ids, self.router.block_size, seed, rendered.items)
        self.telemetry.image_prompts.labels("unkeyed").inc()
        text_only = None
        if chat is not None:
            msgs = [ChatMessage.model_validate(m) for m in text_parts(data)]
            text_only = ChatInput(msgs, chat.add_generation_prompt, chat.tools, chat.template_kwargs)
        ids, _, _ = await self._token_ids(body, model, lora, base, namespace, None, text_only)
        return (
            ids,
            [],
        )  # the text's ids (the prompt's size, images left out); no keys: never a hit on text alone

    def _render_url(self, model: str, lora: str | None) -> str | None:
        """A routable replica serving the model that may render chats (fewest in flight), or None."""
        images = self.images
        if images is None:
            return None
        reps = [r for r in self.table.routable(None if lora else model, lora) if images.supported(r.url)]
        return min(reps, key=lambda r: r.load.inflight_requests).url if reps else None

    async def _token_ids(
        self,
        body: RequestCommon,
        model: str,
        lora: str | None,
        base: str,
        namespace: str | None,
        prompt: Any,
        chat: ChatInput | None,
    ) -> tuple[list[int], FrontierIds | None, bool]:
        """The prompt's ids (and the frontier walk when it stopped early), and whether they are known to be in
        range (ids the client sent, validated by the schema)."""
        url = self._tokenize_url(model, lora)
        scope = self._frontier_scope(model, lora, chat is None)
        seed = self.router.seed_for(base, lora, body.cache_salt, namespace) if scope is not None else 0
        if chat is not None:
            msgs = await dump_messages(chat.messages)
            args = (chat.add_generation_prompt, chat.tools, chat.template_kwargs)
            if scope is not None:  # cache-frontier tokenization of the rendered template text
                ids, walked = await self._frontier_ids(scope, await scope.render(msgs, *args), False, seed)
                return ids, walked, False
            ids = await self.tokenizer.encode_chat(
                msgs,
                model=body.model,
                url=url,
                add_generation_prompt=args[0],
                tools=args[1],
                template_kwargs=args[2],
            )
            return ids, None, False
        first = (
            prompt[0] if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else prompt
        )
        if isinstance(first, list):
            return list(first), None, True  # already ints (validated as list[TokenId])
        if isinstance(first, str) and scope is not None:
            ids, walked = await self._frontier_ids(scope, first, True, seed)
            return ids, walked, False
        if isinstance(first, str):
            return await self.tokenizer.encode_prompt(first, model=body.model, url=url), None, False
        return list(first or []), None, False

    def _tokenize_url(self, model: str, lora: str | None) -> str | None:
        """For ``engine`` tokenizer mode: the URL of a routable replica serving the model (fewest in flight)."""
        if self.tokenizer.mode != "engine":
            return None
        reps = self.table.routable(None if lora else model, lora)
        if not reps:
            return None
        return min(reps, key=lambda r: r.load.inflight_requests).url

    def _frontier_scope(self, model: str, lora: str | None, add_special_tokens: bool) -> HfTokenizer | None:
        """The tokenizer for cache-frontier tokenization of this request's text (router/tokens/frontier.py), or
        None to tokenize it whole (``tokenize_scope=prompt``, or the tokenizer / fleet does not allow it)."""
        if self.config.tokenize_scope != "cached_prefix":
            return None
        return frontier_tokenizer(self.tokenizer, self.router, model, lora, add_special_tokens)

    async def _frontier_ids(
        self, tok: HfTokenizer, text: str, add_special_tokens: bool, seed: int
    ) -> tuple[list[int], FrontierIds | None]:
        """Ids of ``text``: whole when it is no longer than the lookahead (as without the frontier: exact ids),
        else only as deep as the fleet's cache (with the walk's ``FrontierIds``)."""
        lookahead = self.config.tokenize_lookahead_chars
        if len(text) <= lookahead:
            return await tok.encode_prefix(text, len(text), [], 0, add_special_tokens), None
        first = self.config.tokenize_first_prefix_chars
        walked = await frontier_ids(tok, text, add_special_tokens, lookahead, first, self.router, seed)
        return walked.token_ids, walked

    def _count_tokenized(self, tokenized: int, walked: FrontierIds | None) -> None:
        """Metrics of a prompt the router tokenized: its tokenized tokens, and for partial ids the estimated rest."""
        tel = self.telemetry
        tel.tokenize_tokens.labels("tokenized").inc(tokenized)
        if walked is not None and not walked.complete:
            tel.tokenize_tokens.labels("estimated").inc(walked.estimated_tokens - tokenized)
            tel.partial_ids.inc()

    # -- 2 to 4 for a generation request -------------------------------------------------------------------
    async def prepare(self, path: str, headers: Mapping[str, str], raw: bytes) -> Prepared:
        """Parse, identify and tokenize a generation request for ``path`` (any other path: a body with
        ``messages`` is a chat request, else a completions one). With tracing on, the request's trace starts
        here (its caller's ``traceparent`` continued); a refusal ends it."""
        if path in ENGINE_POST_ROUTES:
            return await self.prepare_engine("POST", path, headers, raw)
        trace = request_trace(self.tracing, headers, path)
        if trace is None:
            return await self._prepare(path, headers, raw, None)
        try:
            prepared = await self._prepare(path, headers, raw, trace)
        except BaseException as exc:
            trace.fail(as_refusal(exc))
            raise
        prepared.inp.trace = trace
        return prepared

    async def _prepare(
        self, path: str, headers: Mapping[str, str], raw: bytes, trace: RequestTrace | None
    ) -> Prepared:
        """``prepare``'s steps, each a child span of ``trace`` when there is one."""
        kind = GENERATION_ROUTES.get(path) or (ChatRequest if b'"messages"' in raw else CompletionRequest)
        with _step(trace, "kvroute.intake"):
            parsed = await self.parse(raw, kind)
            body = parsed.model
            chat = chat_input(body)
            max_out = body.max_completion_tokens if isinstance(body, ChatRequest) else None
            ident = await self.identify(headers, body, max_out)
        prompt = body.prompt if isinstance(body, CompletionRequest) else None
        image_chat = self.scope_images(parsed, ident) if chat is not None else None
        with _step(trace, "kvroute.tokenize") as span, self._engine_calls(trace, span):
            inp = await self.tokenize(
                headers, body, ident, prompt=prompt, chat=chat, max_out=max_out, image_chat=image_chat
            )
            if span is not None:
                self._tokenize_attributes(span, inp.prompt_tokens, len(inp.token_ids), inp.ids_partial)
        if trace is not None and trace.recording:
            _request_attributes(trace, inp, body.stream)
        return Prepared(path, inp, parsed.body, body.stream, self._ids(parsed, inp))

    def _engine_calls(self, trace: RequestTrace | None, span: Any) -> AbstractContextManager[Any]:
        """The trace context the engine tokenizer's ``/tokenize`` calls carry within a step: ``span``'s (else the
        request's, unsampled); nothing when the request is not traced or the tokenizer is a local one."""
        if trace is None or self.tokenizer.mode != "engine":
            return _UNTRACED
        return engine_call_headers(trace.headers(span))

    def scope_images(self, parsed: Parsed[Any], ident: Identity) -> dict[str, Any] | None:
        """For a chat with image parts: its client uuids rewritten per tenant (``router.tokens.images``: one
        tenant's uuid never names another tenant's image) in the JSON and the body that goes on; returns the
        JSON (None for a chat without images)."""
        data = parsed.data
        if not isinstance(data, dict) or not has_image_parts(data):
            return None
        scoped = scope_image_uuids(data, tenant_scope(ident.tenant))
        if scoped:
            self.telemetry.image_prompts.labels("scoped_uuids").inc()
        # orjson: the body carries the images (a 1 MB data URL: 0.07 ms instead of the stdlib's 1.8); what it
        # parsed (``Intake.parse``: no lone surrogates, integers past 64 bits read as floats, nesting capped by
        # ``max_json_depth`` <= 200, under its serializer's 254 levels) it can always write back
        parsed.body = orjson.dumps(data)
        return data

    def _tokenize_attributes(self, span: Any, prompt_tokens: int, tokens: int, estimated: bool) -> None:
        """The tokenize span's attributes: mode, prompt tokens (estimated or not), tokens tokenized (only what
        explains the step: each attribute costs the exporter)."""
        span.set_attributes(
            {
                "kvroute.tokenize.mode": self.tokenizer.mode,
                "kvroute.prompt_tokens": prompt_tokens,
                "kvroute.tokenize.tokens": tokens,
                "kvroute.tokenize.estimated": estimated,
            }
        )

    def _ids(self, parsed: Parsed[Any], inp: RoutingInput) -> IdsPrompt | None:
        """A completions prompt as the router's ids, for replicas that take them (router/tokens/token_ids.py):
        only when they are all of the prompt's ids (cache-frontier tokenization may stop early: text then)."""
        check = self.token_ids
        if not isinstance(parsed.model, CompletionRequest) or check.mode == "off":
            return None
        if inp.lora is not None or inp.ids_partial:
            return None
        return ids_prompt(parsed.data, inp.token_ids)

    def prepare_headers_only(self, headers: Mapping[str, str]) -> Prepared:
        """A request without a body (no prompt): routed by load among the replicas of the model named by
        ``x-gateway-model-name`` (set by a gateway's body-based routing), else of any routable replica's first
        model. Raises NoReplica when there is none."""
        model = headers.get("x-gateway-model-name") or next(
            (r.models[0] for r in self.table.all() if r.routable and r.models), None
        )
        if model is None:
            raise NoReplica("no routable replica")
        model, lora, base = self.router.resolve_model(model)
        inp = self.router.make_input(
            model,
            lora,
            [],
            base_model=base,
            session_id=headers.get(self.config.session_header.lower()),
            request_id=new_request_id(headers.get("x-request-id")),
        )
        inp.identity = self.tenants.identify(headers)
        self._regional(inp, headers, inp.identity)
        inp.trace = request_trace(self.tracing, headers, "")
        if inp.trace is not None and inp.trace.recording:
            _request_attributes(inp.trace, inp, False)
        return Prepared("", inp, b"", False)

    # -- 2 to 4 for the engines' other endpoints (router/serve/endpoints.py) -------------------------------
    async def prepare_engine(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        raw: bytes,
        *,
        query: str = "",
        content_type: str | None = None,
    ) -> Prepared:
        """Parse, identify and tokenize a request to one of the engines' other endpoints (``path`` normalized,
        ``query`` the query string without ``?``; see router/serve/endpoints.py for how each is routed). Its trace
        starts here as a generation request's does (the same spans; a refusal ends it).

        Raises:
            KvrouteError: 404 for a path that is none of them; the refusals of ``parse`` and ``identify``;
            a stored response the router cannot reach (``owner``).
        """
        trace = request_trace(self.tracing, headers, route_key(path))
        if trace is None:
            return await self._prepare_engine(method, path, headers, raw, query, content_type, None)
        try:
            prepared = await self._prepare_engine(method, path, headers, raw, query, content_type, trace)
        except BaseException as exc:
            trace.fail(as_refusal(exc))
            raise
        prepared.inp.trace = trace
        if trace.recording:
            _request_attributes(trace, prepared.inp, prepared.stream)
        return prepared

    async def _prepare_engine(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        raw: bytes,
        query: str,
        content_type: str | None,
        trace: RequestTrace | None,
    ) -> Prepared:
        """``prepare_engine``'s steps, child spans of ``trace`` when there is one: the intake (parse, identity),
        and the tokenization of the endpoints that have a prompt (Responses, SGLang's ``/generate``)."""
        found = response_route(path)
        if found is not None:
            target = path + ("?" + query if query else "")
            with _step(trace, "kvroute.intake"):
                return await self._prepare_stored_response(
                    method, found[1], target, headers, "stream=true" in query
                )
        kind = ENGINE_POST_ROUTES.get(path)
        if kind is None:
            raise KvrouteError(f"no route {path!r}", status=404, code="not_found")
        if kind is Kind.RESPONSES:
            return await self._prepare_responses(headers, raw, trace)
        if kind is Kind.SGLANG_GENERATE:
            return await self._prepare_sglang_generate(headers, raw, trace)
        with _step(trace, "kvroute.intake"):
            if kind is Kind.MULTIPART:
                return await self._prepare_multipart(path, headers, raw, content_type or "")
            parsed = await self.parse(raw, EngineBody)
            inp = await self._engine_input(headers, parsed.model.model, [], parsed.model.model_extra)
        return Prepared(path, inp, parsed.body, False, None, Wire(openai_stream=False, feedback=False))

    async def _engine_input(
        self,
        headers: Mapping[str, str],
        model: str | None,
        token_ids: list[int],
        extra: Mapping[str, Any] | None,
        *,
        max_out: int | None = None,
        cache_salt: str | None = None,
        ident: Identity | None = None,
    ) -> RoutingInput:
        """Identity (and the tenant's quota precheck; ``ident``: done already) and the routing input of an engine
        endpoint's request (``model`` None: the fleet's first model; ``token_ids`` empty: routed by load)."""
        if ident is None:
            ident = await self._engine_identity(headers, extra, max_out)
        name = model or self._default_model()
        resolved, lora, base = self.router.resolve_model(name)
        namespace = ident.tenant if ident.policy.isolate_cache else None
        inp = self.router.make_input(
            resolved,
            lora,
            token_ids,
            base_model=base,
            cache_salt=cache_salt,
            request_id=new_request_id(headers.get("x-request-id")),
            expected_output_tokens=max_out or 0,
            namespace=namespace,
            ttft_target_s=ident.ttft_target_s,
            priority=ident.priority,
        )
        inp.identity = ident
        self._regional(
            inp, headers, ident
        )  # residency and the hop hold for every endpoint, not generation only
        return inp

    async def _engine_identity(
        self, headers: Mapping[str, str], extra: Mapping[str, Any] | None, max_out: int | None
    ) -> Identity:
        """An engine endpoint's request's identity, its tenant's quota prechecked (``max_out`` tokens)."""
        tenants = self.tenants
        ident = tenants.identify(headers, (extra or {}).get(tenants.cfg.priority_body_field))
        await tenants.precheck(ident, max_out)
        return ident

    def _default_model(self) -> str:
        """The first model of a routable replica (a request that names none). Raises NoReplica."""
        model = next((r.models[0] for r in self.table.all() if r.routable and r.models), None)
        if model is None:
            raise NoReplica("no routable replica")
        return model

    async def owner(self, response_id: str, param: str) -> Replica:
        """The replica holding stored response ``response_id`` (``param``: the field that named it).

        Raises:
            KvrouteError: 404 ``response_not_found`` when no replica is known to hold it; 410
            ``response_replica_gone`` when its replica left the fleet (the engine kept the response in its memory:
            it is lost); 503 ``response_replica_unavailable`` while its replica cannot take requests.
        """
        name = await self.chains.owner(response_id)
        if name is None:
            raise KvrouteError(
                f"Response with id '{response_id}' not found: no replica is known to hold it",
                status=404,
                code="response_not_found",
                param=param,
            )
        rep = self.table.get(name)
        if rep is None:
            raise KvrouteError(
                f"response '{response_id}' was stored on replica {name}, which has left the fleet; an engine keeps "
                "stored responses in its own memory, so the chain cannot continue: start a new one (send the "
                "whole conversation as input)",
                status=410,
                code="response_replica_gone",
                param=param,
            )
        if not rep.routable:
            raise KvrouteError(
                f"response '{response_id}' is stored on replica {name}, which is {rep.state.value}: only that "
                "replica holds it (an engine keeps stored responses in its own memory); retry later, or start a "
                "new chain (send the whole conversation as input)",
                status=503,
                code="response_replica_unavailable",
                param=param,
                retry=True,
            )
        return rep

    async def _prepare_stored_response(
        self, method: str, response_id: str, target: str, headers: Mapping[str, str], stream: bool
    ) -> Prepared:
        """``GET`` / ``DELETE /v1/responses/{id}``, ``POST .../cancel``: pinned to the replica holding it."""
        rep = await self.owner(response_id, "response_id")
        inp = await self._engine_input(headers, rep.models[0] if rep.models else None, [], None)
        inp.pinned_to = rep.index
        return Prepared(
            target, inp, b"", stream, None, Wire(method=method, openai_stream=False, feedback=False)
        )

    async def _prepare_responses(
        self, headers: Mapping[str, str], raw: bytes, trace: RequestTrace | None
    ) -> Prepared:
        """``POST /v1/responses``: the conversation the engine will render tokenized and routed like a chat
        request; a follow-up (``previous_response_id``) pinned to the replica holding its chain. Intake and
        tokenization are child spans of ``trace`` (when there is one)."""
        with _step(trace, "kvroute.intake"):
            parsed = await self.parse(raw, ResponsesRequest)
            body = parsed.model
            chains = self.chains
            pin: Replica | None = None
            history = None
            if body.previous_response_id is not None:
                pin = await self.owner(body.previous_response_id, "previous_response_id")
                history = await chains.history(body.previous_response_id)
            msgs = conversation(parsed.data, history)
            model = body.model or self._default_model()
            ident = await self._engine_identity(headers, body.model_extra, body.max_output_tokens)
        with _step(trace, "kvroute.tokenize") as span, self._engine_calls(trace, span):
            ids = await self._responses_ids(model, msgs)
            if span is not None:
                self._tokenize_attributes(span, len(ids), len(ids), False)
        inp = await self._engine_input(
            headers,
            model,
            ids,
            body.model_extra,
            max_out=body.max_output_tokens,
            cache_salt=body.cache_salt,
            ident=ident,
        )
        inp.pinned_to = pin.index if pin is not None else None
        watch = chains.watch(msgs, body.store is not False)
        return Prepared(
            "/v1/responses", inp, parsed.body, body.stream, None, Wire(openai_stream=False, watch=watch)
        )

    async def _responses_ids(self, model: str, msgs: list[dict[str, Any]]) -> list[int]:
        """The token ids of a Responses conversation as vLLM makes them: the chat template rendered, then
        tokenized with the special tokens (a local tokenizer); an engine tokenizer renders it itself."""
        tok = self.tokenizer
        resolved, lora, _ = self.router.resolve_model(model)
        url = self._tokenize_url(resolved, lora)
        if isinstance(tok, HfTokenizer):
            return await tok.encode_prompt(await tok.render(msgs, True), model=model)
        return await tok.encode_chat(msgs, model=model, url=url)

    async def _prepare_multipart(
        self, path: str, headers: Mapping[str, str], raw: bytes, content_type: str
    ) -> Prepared:
        """An audio request: a multipart body (bounded by ``max_request_bytes`` at the door) routed by load, its
        ``model`` field naming the replicas; relayed with the client's content type."""
        if not content_type.startswith("multipart/form-data"):
            raise KvrouteError(
                f"{path} takes a multipart/form-data body (got {content_type or 'none'!r})",
                status=400,
                code="invalid_content_type",
            )
        stream = (multipart_field(raw, "stream") or "").lower() == "true"
        inp = await self._engine_input(headers, multipart_field(raw, "model"), [], None)
        return Prepared(
            path, inp, raw, stream, None, Wire(content_type=content_type, openai_stream=False, feedback=False)
        )

    async def _prepare_sglang_generate(
        self, headers: Mapping[str, str], raw: bytes, trace: RequestTrace | None
    ) -> Prepared:
        """SGLang's ``/generate``: its ``text`` or ``input_ids`` (the first of a batch) tokenized and routed by
        the cost model (intake and tokenization child spans of ``trace`` when there is one)."""
        with _step(trace, "kvroute.intake"):
            parsed = await self.parse(raw, EngineBody)
            data = parsed.data if isinstance(parsed.data, dict) else {}
            model = parsed.model.model or self._default_model()
            params = data.get("sampling_params")
            max_out = params.get("max_new_tokens") if isinstance(params, dict) else None
            max_out = max_out if isinstance(max_out, int) else None
            ident = await self._engine_identity(headers, None, max_out)
        text, given = data.get("text"), data.get("input_ids")
        text = text[0] if isinstance(text, list) and text else text
        given = given[0] if isinstance(given, list) and given and isinstance(given[0], list) else given
        ids: list[int] = []
        with _step(trace, "kvroute.tokenize") as span, self._engine_calls(trace, span):
            if isinstance(given, list) and all(isinstance(t, int) and 0 <= t < 1 << 32 for t in given):
                ids = list(given)
            elif isinstance(text, str):
                ids = await self.tokenizer.encode_prompt(
                    text, model=model, url=self._tokenize_url(model, None)
                )
                if span is not None:
                    self._tokenize_attributes(span, len(ids), len(ids), False)
        inp = await self._engine_input(headers, model, ids, None, max_out=max_out, ident=ident)
        stream = data.get("stream") is True
        return Prepared(
            "/generate", inp, parsed.body, stream, None, Wire(openai_stream=False, feedback=False)
        )

    # -- 5. admit ------------------------------------------------------------------------------------------
    async def admit(self, inp: RoutingInput, exclude: Sequence[int] = ()) -> Admitted:
        """Admission and the decision: a request with a TTFT target is priced first (an unattainable target is
        refused, not queued); the tenant's quota and the fair in-flight queue give a slot held until the
        response ends; the decision is taken (again) after any wait. ``exclude``: replicas that may not be
        picked (the picker's subset hint). A refusal ends the request's trace."""
        trace = inp.trace
        if trace is None:
            return await self._admit(inp, exclude, None)
        try:
            return await self._admit(inp, exclude, trace)
        except BaseException as exc:
            trace.fail(as_refusal(exc))
            raise

    async def _admit(self, inp: RoutingInput, exclude: Sequence[int], trace: RequestTrace | None) -> Admitted:
        """``admit``'s steps (the admission wait a child span of ``trace`` when there is one)."""
        tenants = self.tenants
        ident: Identity = inp.identity if inp.identity is not None else tenants.identify({})
        routed: Routed | None = None
        if ident.ttft_target_s is not None:
            routed = await self.decide(inp, exclude)
        with _step(trace, "kvroute.admission") as span:
            if routed is not None:
                tenants.check_slo(
                    ident, best_predicted_ttft_s(routed.decision.scores, routed.decision.ranking)
                )
            ticket = await tenants.admit(ident, inp.prompt_tokens, inp.expected_output_tokens or None)
            if span is not None:
                span.set_attribute("kvroute.admission.wait_s", ticket.waited_s)
                span.set_attribute("kvroute.tenant", ident.tenant)
        try:
            if routed is None or ticket.waited_s > 0:  # decided after any wait: the fleet moved meanwhile
                routed = await self.decide(inp, exclude)
        except BaseException:
            ticket.release()
            raise
        chosen = routed.decision.chosen
        score = next((s for s in routed.decision.scores if s.index == chosen), None)
        tenants.serving(
            ident, predicted_ttft_s(score) if score is not None else None, routed.cached_tokens.get(chosen, 0)
        )
        return Admitted(routed, ticket)

    # -- 6. decide -----------------------------------------------------------------------------------------
    async def decide(self, inp: RoutingInput, exclude: Sequence[int] = ()) -> Routed:
        """The decision for a request to serve (session affinity first, when on), counted and logged."""
        # session affinity (opt-in; X-Session-Id pinned through Redis while routable)
        if inp.pinned_to is not None:  # only that replica holds the request's state
            if inp.pinned_to in exclude:
                raise NoReplica("the replica holding the request's state is not among the allowed replicas")
            exclude = [r.index for r in self.table.all() if r.index != inp.pinned_to]
        mem = (
            self.membership
            if self.config.session_affinity and inp.session_id and inp.pinned_to is None
            else None
        )
        pinned = await mem.session_replica(inp.session_id) if mem is not None else None
        if pinned is not None and pinned.index in exclude:
            pinned = None
        with _step(inp.trace, "kvroute.decide") as span:
            try:
                pin = (
                    [r.index for r in self.table.all() if r is not pinned] if pinned is not None else exclude
                )
                routed = self.router.decide(inp, exclude=pin)
            except RoutingError:
                if pinned is None:
                    raise
                routed = self.router.decide(
                    inp, exclude
                )  # the pinned replica cannot take it now: route normally
            if span is not None:
                _decision_attributes(span, routed, self.table, pinned is not None)
        self._count_decision(routed)
        chosen = self.table.by_index(routed.decision.chosen)
        if mem is not None and chosen is not None:
            await mem.remember_session(inp.session_id, chosen)
        self.telemetry.routed.labels(
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

    def _count_decision(self, routed: Routed) -> None:
        self.telemetry.decision_seconds.observe(routed.decision_s)
        if routed.decision.reuse is not None:
            self.telemetry.observe_reuse(routed.decision.reuse)

    def explain(self, inp: RoutingInput) -> Routed:
        """The decision ``/route`` answers: taken as for a request to serve, not admitted, nothing held."""
        routed = self.router.decide(inp)
        self.telemetry.decision_seconds.observe(routed.decision_s)
        return routed

    # -- 7. dispatch ---------------------------------------------------------------------------------------
    async def dispatch(self, prepared: Prepared, admitted: Admitted, receive: Callable[[], Any]) -> Response:
        """Send the request to the decision's replicas (in place, or by the plan) and return the client's answer;
        the ticket is released when the answer ends. ``receive``: the client's ASGI receive (a disconnect
        cancels the upstream request). The request's trace ends with the answer."""
        trace = prepared.inp.trace
        ticket = admitted.ticket
        on_done: Callable[[], None] = ticket.release
        if trace is not None:

            def on_done() -> None:
                ticket.release()
                trace.done()

        try:
            resp = await self.dispatcher.forward(
                receive,
                admitted.routed,
                prepared.path,
                prepared.body,
                stream=prepared.stream,
                request_id=prepared.inp.request_id,
                on_done=on_done,
                ids=prepared.ids,
                wire=prepared.wire,
            )
        except BaseException as exc:
            if trace is not None:
                trace.fail(as_refusal(exc))
            raise
        if trace is not None:
            trace.respond(resp.status_code)
        return resp

    async def serve(self, prepared: Prepared, receive: Callable[[], Any]) -> Response:
        """Admit, decide and dispatch a prepared request (steps 5-8)."""
        try:
            exclude = self.not_serving(prepared.path)
        except KvrouteError as exc:
            if prepared.inp.trace is not None:
                prepared.inp.trace.fail(exc)
            raise
        return await self.dispatch(prepared, await self.admit(prepared.inp, exclude), receive)

    def not_serving(self, path: str) -> list[int]:
        """Replicas known not to serve ``path`` (they answered it with their framework's 404:
        ``router.engine.gaps``), left out of the decision.

        Raises:
            KvrouteError: 404 ``endpoint_not_served`` when that is every routable replica.
        """
        gaps = self.dispatcher.in_place.gaps
        if not gaps:  # None, or no gap known: nothing to look up per replica
            return []
        lacking = [r for r in self.table.all() if gaps.lacks(r.name, path)]
        if lacking and all(r in lacking for r in self.table.all() if r.routable):
            names = ", ".join(sorted(r.name for r in lacking))
            raise KvrouteError(
                f"no replica serves {path.partition('?')[0]} (each answered it 404 Not Found: {names})",
                status=404,
                code="endpoint_not_served",
            )
        return [r.index for r in lacking]


def _request_attributes(trace: RequestTrace, inp: RoutingInput, stream: bool) -> None:
    """The request span's attributes known once it is prepared: model, adapter, request id, tenant, priority
    (when not 0), stream (OpenTelemetry GenAI names where they fit)."""
    attrs: dict[str, Any] = {
        "gen_ai.request.model": inp.model,
        "kvroute.request_id": inp.request_id,
        "kvroute.stream": stream,
    }
    if inp.priority:
        attrs["kvroute.priority"] = inp.priority
    if inp.lora is not None:
        attrs["kvroute.lora"] = inp.lora
    if inp.identity is not None:
        attrs["kvroute.tenant"] = inp.identity.tenant
    trace.set_many(attrs)


def _decision_attributes(span: Any, routed: Routed, table: ReplicaTable, pinned: bool) -> None:
    """The decide span's attributes: policy and branch; the chosen replica, its predicted cached tokens and
    TTFT terms (Q queue, R fetch, C compute, s; p hit probability; the predicted TTFT ``E``, else ``T``, s); the best
    alternative's predicted TTFT; candidates; reuse available vs achieved (tokens); a PD plan's kind, pair and
    handoff terms. Set at once (one lock of the span)."""
    decision = routed.decision
    chosen = decision.chosen
    rep = table.by_index(chosen)
    attrs: dict[str, Any] = {
        "kvroute.policy": decision.policy,
        "kvroute.branch": decision.branch,
        "kvroute.replica": rep.name if rep is not None else str(chosen),
        "kvroute.candidates": len(routed.candidates),
        "kvroute.predicted.cached_tokens": routed.cached_tokens.get(chosen, 0),
        "kvroute.decision_s": routed.decision_s,
    }
    if pinned:
        attrs["kvroute.session_pinned"] = True
    alternative = math.inf
    for score in decision.scores:
        if score.index == chosen:
            for term, value in score.parts.items():
                if term in ("Q", "R", "C", "p"):
                    attrs[f"kvroute.predicted.{term}"] = float(value)
            attrs["kvroute.predicted.ttft_s"] = predicted_ttft_s(score)
        else:
            value = predicted_ttft_s(score)
            if math.isfinite(value) and value < alternative:
                alternative = value
    if math.isfinite(alternative):
        attrs["kvroute.alternative.predicted_ttft_s"] = alternative
    if decision.reuse is not None:
        attrs["kvroute.reuse.available_tokens"] = decision.reuse.available_tokens
        attrs["kvroute.reuse.achieved_tokens"] = decision.reuse.achieved_tokens
    if routed.plan is not None:
        _plan_attributes(attrs, routed, table)
    span.set_attributes(attrs)


def _plan_attributes(attrs: dict[str, Any], routed: Routed, table: ReplicaTable) -> None:
    """A PD plan's attributes of the decide span: kind, policy, the pair, its predicted TTFT and terms (s)."""
    assert routed.plan is not None
    plan = routed.plan.chosen
    decode = table.by_index(plan.decode)
    attrs["kvroute.plan.kind"] = plan.kind
    attrs["kvroute.plan.policy"] = routed.plan.policy
    attrs["kvroute.plan.predicted_ttft_s"] = plan.predicted_ttft_s
    attrs["kvroute.plan.decode_replica"] = decode.name if decode is not None else str(plan.decode)
    if plan.prefill is not None:
        prefill = table.by_index(plan.prefill)
        attrs["kvroute.plan.prefill_replica"] = prefill.name if prefill is not None else str(plan.prefill)
    for term, value in plan.terms.items():
        attrs[f"kvroute.plan.{term}"] = float(value)
