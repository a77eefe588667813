"""The serving pipeline: one request's way through the router, the same for every front door.

The HTTP app (``router.http``) and the endpoint picker (``router.epp``) only translate (ASGI, ext_proc) and call
these steps in this order; a rule added here reaches every door:

1. ``guard``: authorization on the normalized request and load shedding, from the headers alone;
2. ``parse``: body limits, JSON, the request model, router-controlled fields stripped (``router.serve.intake``);
3. ``identify``: tenant, priority class, TTFT target; the tenant's quota precheck, before any tokenizing;
4. ``tokenize``: the prompt's token ids (the cache frontier or the whole prompt) and block keys ->
   ``RoutingInput``; ``prepare`` runs 2-4 for a generation request (``Prepared``);
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from starlette.responses import Response

from membership.replicas import ReplicaTable
from membership.runtime import Membership
from policies.admission_slo import best_predicted_ttft_s, predicted_ttft_s
from router.config import Settings
from router.core.routing import NoReplica, Routed, Router, RoutingError, RoutingInput
from router.core.tenant_admission import TenantAdmission, Ticket
from router.core.tenants import Identity
from router.errors import BadTokenIds
from router.serve.dispatch import Dispatcher
from router.serve.guard import Guard
from router.serve.intake import Intake, dump_messages, sequences
from router.serve.requests import ChatMessage, ChatRequest, CompletionRequest, RequestCommon, new_request_id
from router.telemetry import Telemetry
from router.tokens.frontier import FrontierIds, frontier_ids, frontier_tokenizer
from router.tokens.token_ids import IdsPrompt, TokenIdsCheck, ids_prompt
from router.tokens.tokenizer import HfTokenizer, Tokenizer

log = logging.getLogger("kvroute.app")
_M = TypeVar("_M", bound=BaseModel)

#: the generation routes and the body each takes
GENERATION_ROUTES: Mapping[str, type[CompletionRequest] | type[ChatRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
}


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
    """

    path: str
    inp: RoutingInput
    body: bytes
    stream: bool
    ids: IdsPrompt | None = None


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
        settings: the router's settings (session affinity, tokenize scope, ...).
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
    """

    def __init__(
        self,
        settings: Settings,
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
    ) -> None:
        self.settings = settings
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
    ) -> RoutingInput:
        """Tokenize (unless ids were given), hash and bundle what the request contributes to a decision."""
        model, lora, base = self.router.resolve_model(body.model)
        namespace = ident.tenant if ident.policy.isolate_cache else None
        walked: FrontierIds | None = None
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
            session_id=headers.get(self.settings.session_header.lower()),
            request_id=new_request_id(headers.get("x-request-id")),
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
        if self.settings.tokenize_scope != "cached_prefix":
            return None
        return frontier_tokenizer(self.tokenizer, self.router, model, lora, add_special_tokens)

    async def _frontier_ids(
        self, tok: HfTokenizer, text: str, add_special_tokens: bool, seed: int
    ) -> tuple[list[int], FrontierIds | None]:
        """Ids of ``text``: whole when it is no longer than the lookahead (as without the frontier: exact ids),
        else only as deep as the fleet's cache (with the walk's ``FrontierIds``)."""
        lookahead = self.settings.tokenize_lookahead_chars
        if len(text) <= lookahead:
            return await tok.encode_prefix(text, len(text), [], 0, add_special_tokens), None
        walked = await frontier_ids(tok, text, add_special_tokens, lookahead, self.router, seed)
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
        ``messages`` is a chat request, else a completions one)."""
        kind = GENERATION_ROUTES.get(path) or (ChatRequest if b'"messages"' in raw else CompletionRequest)
        parsed = await self.parse(raw, kind)
        body = parsed.model
        chat = chat_input(body)
        max_out = body.max_completion_tokens if isinstance(body, ChatRequest) else None
        ident = await self.identify(headers, body, max_out)
        prompt = body.prompt if isinstance(body, CompletionRequest) else None
        inp = await self.tokenize(headers, body, ident, prompt=prompt, chat=chat, max_out=max_out)
        return Prepared(path, inp, parsed.body, body.stream, self._ids(parsed, inp))

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
            session_id=headers.get(self.settings.session_header.lower()),
            request_id=new_request_id(headers.get("x-request-id")),
        )
        inp.identity = self.tenants.identify(headers)
        return Prepared("", inp, b"", False)

    # -- 5. admit ------------------------------------------------------------------------------------------
    async def admit(self, inp: RoutingInput, exclude: Sequence[int] = ()) -> Admitted:
        """Admission and the decision: a request with a TTFT target is priced first (an unattainable target is
        refused, not queued); the tenant's quota and the fair in-flight queue give a slot held until the
        response ends; the decision is taken (again) after any wait. ``exclude``: replicas that may not be
        picked (the picker's subset hint)."""
        tenants = self.tenants
        ident: Identity = inp.identity if inp.identity is not None else tenants.identify({})
        routed: Routed | None = None
        if ident.ttft_target_s is not None:
            routed = await self.decide(inp, exclude)
            tenants.check_slo(ident, best_predicted_ttft_s(routed.decision.scores, routed.decision.ranking))
        ticket = await tenants.admit(ident, inp.prompt_tokens, inp.expected_output_tokens or None)
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
        mem = self.membership if self.settings.session_affinity and inp.session_id else None
        pinned = await mem.session_replica(inp.session_id) if mem is not None else None
        if pinned is not None and pinned.index in exclude:
            pinned = None
        try:
            pin = [r.index for r in self.table.all() if r is not pinned] if pinned is not None else exclude
            routed = self.router.decide(inp, exclude=pin)
        except RoutingError:
            if pinned is None:
                raise
            routed = self.router.decide(inp, exclude)  # the pinned replica cannot take it now: route normally
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
        cancels the upstream request)."""
        return await self.dispatcher.forward(
            receive,
            admitted.routed,
            prepared.path,
            prepared.body,
            stream=prepared.stream,
            request_id=prepared.inp.request_id,
            on_done=admitted.ticket.release,
            ids=prepared.ids,
        )

    async def serve(self, prepared: Prepared, receive: Callable[[], Any]) -> Response:
        """Admit, decide and dispatch a prepared request (steps 5-8)."""
        return await self.dispatch(prepared, await self.admit(prepared.inp), receive)
