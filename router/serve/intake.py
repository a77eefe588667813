"""Request bodies in: cheap limits before expensive work, and the expensive work off the event loop.

A 16 MiB body costs little to receive and a lot to turn into Python objects: ~620k tiny chat messages took
orjson ~0.3-4 s, pydantic 12 s and ``model_dump`` 6 s on this machine, all holding the GIL, so one request froze
every other one and the liveness probe. So a body of ``SCAN_MIN_BYTES`` or more is first parsed by simdjson into
its own tape (no Python object per value; ~50 ms for 16 MiB) and its shape checked against ``InputLimits``:

* ``messages``: at most ``max_messages`` (413 ``too_many_messages``);
* ``prompt`` batches: at most ``max_batch_prompts`` prompts (413 ``too_many_prompts``);
* the routed prompt: its characters (a text prompt, or all the text of the chat messages) at most
  ``context x chars_per_token`` and its token ids at most ``context`` (400 ``context_length_exceeded``), where
  ``context`` is the longest context of the model's replicas (``max_model_len``), or ``default_context_tokens``
  when one of them reports none;
* every other JSON value (extra fields, tools, content parts, further prompts of a batch) counts against
  ``max_json_values`` (413 ``too_many_json_values``).

Every body, small or large, is nested at most ``max_json_depth`` levels (400 ``json_too_deep``), checked on the
parsed value when the body has that many brackets at all: the prefill/decode legs re-serialize the body, and the
serializer stops at 254 levels, so every door refuses absurd depth alike instead of one path failing later.
Every body, small or large, is also refused when it asks for more than ``max_sequences`` sequences in its ``n``
or (vLLM) ``best_of`` (400 ``too_many_sequences``, ``param`` naming the field): a request counts as that many in
flight on its replica, so an absurd ``n`` would block the replica's accounting.

Only a body that passes is given to orjson and pydantic, and all of it runs in a worker thread: the bounded C
parts hold the GIL for tens of milliseconds at most, the Python parts let the loop in every switch interval.
Smaller bodies cannot exceed the limits by much and are parsed inline, as before (no cost on the hot path).
A scanned body whose bulk is text (a long prompt: under ``LIGHT_MAX_BYTES``, at most ``LIGHT_MAX_VALUES`` JSON
values and token ids) is the common large body, and its whole intake costs less than the trip to a worker thread
(an 85 KB prompt: ~45 us of CPU on the loop against ~70 us for the thread hand-off alone, measured): it is scanned
on the loop; the scan stops at that many values (before walking a body of more messages or token ids than
that) and the body goes on to the thread with its simdjson view (``HeavyBody``).

Units: bytes, characters, tokens, JSON values.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import simdjson
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from router.core.large_parse import scan_in_thread
from router.errors import KvrouteError
from router.tokens.tokenizer import THREAD_MIN_MESSAGES

if TYPE_CHECKING:
    from router.config import ClientEdgeSettings
    from router.serve.client_fields import ClientFields

_M = TypeVar("_M", bound=BaseModel)

#: bodies at least this large are shape-checked with simdjson before they are parsed, bytes
SCAN_MIN_BYTES = 64 * 1024
#: a scanned body under this size holding at most ``LIGHT_MAX_VALUES`` JSON values (its text aside) and token
#: ids is checked and parsed on the event loop; any other scanned body in a worker thread, bytes
LIGHT_MAX_BYTES = 1 << 20
#: see ``LIGHT_MAX_BYTES``, JSON values / token ids
LIGHT_MAX_VALUES = 512

_OBJ = (dict, simdjson.Object)
_ARR = (list, simdjson.Array)
_CONTAINER = _OBJ + _ARR


class LimitExceeded(KvrouteError):
    """A request over one of the input limits: answered ``status`` with ``code``, ``message`` and ``param``
    (counted in ``kvroute_rejected_total`` under its code)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message, status=status, code=code, param=param, counted_as=code)


@dataclass(frozen=True, slots=True)
class InputLimits:
    """The input limits (from ``Settings``; see the module docstring).

    Attributes:
        max_messages: chat messages per request.
        max_batch_prompts: prompts per batched completions request.
        chars_per_token: characters allowed per token of context.
        default_context_tokens: the context of a model none of whose replicas reports one, tokens.
        max_json_values: JSON values outside prompt text, token ids and message text.
        max_json_depth: nesting levels of the body (the body itself is level 1).
        max_sequences: sequences one request may ask for (``n``, ``best_of``).
    """

    max_messages: int
    max_batch_prompts: int
    chars_per_token: float
    default_context_tokens: int
    max_json_values: int
    max_json_depth: int
    max_sequences: int

    @classmethod
    def from_settings(cls, edge: ClientEdgeSettings) -> InputLimits:
        """The limits configured in the client edge's sub-config (``Settings.client_edge``)."""
        return cls(
            max_messages=edge.max_chat_messages,
            max_batch_prompts=edge.max_batch_prompts,
            chars_per_token=edge.max_prompt_chars_per_token,
            default_context_tokens=edge.max_prompt_tokens,
            max_json_values=edge.max_json_values,
            max_json_depth=edge.max_json_depth,
            max_sequences=edge.max_sequences_per_request,
        )


def model_contexts(replicas: Iterable[Any]) -> dict[str, int]:
    """``{model or LoRA name: longest context of the replicas serving it}`` (0 when one of them reports none),
    from replicas with ``models``, ``loras`` and ``profile.max_context_tokens`` (tokens)."""
    out: dict[str, int] = {}
    unknown: set[str] = set()
    for rep in replicas:
        ctx = int(getattr(rep.profile, "max_context_tokens", 0) or 0)
        for name in (*rep.models, *rep.loras):
            if ctx <= 0:
                unknown.add(name)
            out[name] = max(out.get(name, 0), ctx)
    for name in unknown:
        out[name] = 0
    return out


class _Heavy(Exception):
    """Internal: a body checked with a ``light_values`` cap holds more than that: it goes to the worker thread."""


class _Budget:
    """Counts JSON values against ``max_json_values`` (raises ``LimitExceeded`` once over); with a ``light``
    cap below it, raises ``_Heavy`` once over the cap (and early, for token ids or many messages: ``bulk``)."""

    def __init__(self, limit: int, light: int | None = None) -> None:
        self.limit = limit
        self.light = light
        self.stop = limit if light is None else min(limit, light)
        self.used = 0

    def take(self, n: int, where: str) -> None:
        self.used += n
        if self.used > self.stop:
            self._over(where)

    def bulk(self, n: int) -> None:
        """Give up early (light cap only): ``n`` token ids (not JSON values of the limit: they are the prompt), or
        about ``n`` values of messages still to walk."""
        if self.light is not None and n > self.light:
            raise _Heavy

    def _over(self, where: str) -> None:
        if self.used > self.limit:
            raise LimitExceeded(
                413,
                "too_many_json_values",
                f"request body has more than {self.limit} JSON values outside the prompt text and "
                f"token ids (max_json_values; over at {where!r})",
                where,
            )
        raise _Heavy

    def walk(self, value: Any, where: str) -> None:
        """Count ``value`` and everything inside it."""
        stack = [value]
        while stack:
            v = stack.pop()
            self.take(1, where)
            if isinstance(v, _ARR):
                self.take(len(v), where)
                stack.extend(e for e in v if isinstance(e, _CONTAINER))
            elif isinstance(v, _OBJ):
                self.take(2 * len(v), where)
                stack.extend(e for e in v.values() if isinstance(e, _CONTAINER))


def check_body(
    doc: Any, limits: InputLimits, contexts: dict[str, int], light_values: int | None = None
) -> None:
    """Check a parsed request body (a dict, or a simdjson Object) against ``limits``.

    ``contexts``: ``model_contexts`` of the fleet. A body that is not a JSON object passes (validation answers it).
    ``light_values``: stop with ``_Heavy`` once the body holds more JSON values than this (outside its text), or a
    token-id prompt of more ids; a limit exceeded before that point is raised as without it.

    Raises:
        LimitExceeded: the first limit exceeded.
    """
    if not isinstance(doc, _OBJ):
        if isinstance(doc, _ARR):  # refused by validation, but parsed first
            _Budget(limits.max_json_values, light_values).walk(doc, "body")
        return
    model = doc.get("model")
    ctx = contexts.get(model, 0) if isinstance(model, str) else 0
    ctx = ctx or limits.default_context_tokens
    max_chars = int(ctx * limits.chars_per_token)
    budget = _Budget(limits.max_json_values, light_values)
    for key in list(doc.keys()):
        value = doc[key]
        if key == "messages" and isinstance(value, _ARR):
            _check_messages(value, limits, max_chars, ctx, budget)
        elif key == "prompt":
            _check_prompt(value, limits, max_chars, ctx, budget)
        elif key == "token_ids" and isinstance(value, _ARR):
            _check_ids(value, ctx, "token_ids", budget)
        elif isinstance(value, _CONTAINER):
            budget.walk(value, key)


def _too_long(what: str, size: int, limit: int, unit: str, ctx: int, param: str) -> LimitExceeded:
    return LimitExceeded(
        400,
        "context_length_exceeded",
        f"{what} has {size} {unit}, more than the model's context of {ctx} tokens allows "
        f"({limit} {unit}; max_prompt_chars_per_token / max_model_len)",
        param,
    )


def _all_numbers(ids: Any) -> bool:
    """True when every element of the simdjson array is a number (checked at C speed by ``as_buffer``)."""
    try:
        ids.as_buffer(of_type="d")
    except (TypeError, ValueError):
        return False
    return True


def _check_ids(ids: Any, ctx: int, param: str, budget: _Budget) -> None:
    """A token-id prompt: at most ``ctx`` ids; anything but numbers inside it counts as JSON values."""
    if len(ids) > ctx:
        raise _too_long("prompt", len(ids), ctx, "token ids", ctx, param)
    budget.bulk(len(ids))
    if isinstance(ids, simdjson.Array) and _all_numbers(ids):
        return
    for e in ids:
        if isinstance(e, _CONTAINER):
            budget.walk(e, param)


def _check_prompt(prompt: Any, limits: InputLimits, max_chars: int, ctx: int, budget: _Budget) -> None:
    """A completions prompt: text, token ids, or a batch of either (routed by its first prompt)."""
    if isinstance(prompt, str):
        if len(prompt) > max_chars:
            raise _too_long("prompt", len(prompt), max_chars, "characters", ctx, "prompt")
        return
    if isinstance(prompt, _OBJ):
        budget.walk(prompt, "prompt")  # not a prompt (validation refuses it), but it must be parsed first
        return
    if not isinstance(prompt, _ARR) or len(prompt) == 0:
        return
    first = prompt[0]
    if not isinstance(first, (str, *_ARR)):
        _check_ids(prompt, ctx, "prompt", budget)
        return
    if len(prompt) > limits.max_batch_prompts:
        raise LimitExceeded(
            413,
            "too_many_prompts",
            f"batch of {len(prompt)} prompts is over {limits.max_batch_prompts} (max_batch_prompts)",
            "prompt",
        )
    for i, item in enumerate(prompt):
        if i == 0 and isinstance(item, str):
            if len(item) > max_chars:
                raise _too_long("prompt[0]", len(item), max_chars, "characters", ctx, "prompt")
        elif i == 0 and isinstance(item, _ARR):
            _check_ids(item, ctx, "prompt", budget)
        elif isinstance(item, _ARR):
            budget.take(len(item), "prompt")  # further prompts of a batch are not tokenized, only parsed
            if len(item) > ctx:
                raise _too_long(f"prompt[{i}]", len(item), ctx, "token ids", ctx, "prompt")
        elif isinstance(item, _OBJ):
            budget.walk(item, "prompt")
        else:
            budget.take(1, "prompt")


def _check_messages(messages: Any, limits: InputLimits, max_chars: int, ctx: int, budget: _Budget) -> None:
    """Chat messages: at most ``max_messages``; all their text at most ``max_chars``; the rest in the budget."""
    n = len(messages)
    if n > limits.max_messages:
        raise LimitExceeded(
            413,
            "too_many_messages",
            f"{n} messages are over {limits.max_messages} (max_chat_messages)",
            "messages",
        )
    budget.bulk(3 * n)  # each message is at least itself, a role and a content
    chars = 0
    for msg in messages:
        budget.take(1, "messages")
        if isinstance(msg, _ARR):
            budget.walk(msg, "messages")
        if not isinstance(msg, _OBJ):
            continue
        for key, value in msg.items():
            budget.take(1, "messages")
            if isinstance(value, str):
                chars += len(value)
            elif key == "content" and isinstance(value, _ARR):
                budget.take(len(value), "messages")
                for part in value:
                    if isinstance(part, str):
                        chars += len(part)
                    elif isinstance(part, _ARR):
                        budget.walk(part, "messages")
                    elif isinstance(part, _OBJ):
                        for pv in part.values():
                            budget.take(2, "messages")
                            if isinstance(pv, str):
                                chars += len(pv)
                            elif isinstance(pv, _CONTAINER):
                                budget.walk(pv, "messages")
            elif isinstance(value, _CONTAINER):
                budget.walk(value, "messages")
    if chars > max_chars:
        raise _too_long("the messages' text", chars, max_chars, "characters", ctx, "messages")


# ---------------------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------------------


def _invalid_json(msg: str) -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": msg, "input": None}])


#: a list longer than this makes ``check_depth`` count the body's brackets before walking on, elements
WALK_MAX_LIST = 64


def check_depth(raw: bytes, data: Any, limit: int) -> None:
    """Refuse ``data`` (parsed from ``raw``) when it nests more than ``limit`` levels.

    The parsed value is walked, container by container. A body with at most ``limit`` brackets cannot nest that
    deep, so when the walk meets a long list (token ids, many messages: more than ``WALK_MAX_LIST`` elements to
    look at) the brackets of ``raw`` are counted first (two C scans) and such a body is not walked on. A body
    whose bulk is text (a long prompt: a few containers, ~85 KB of characters) is walked in a microsecond instead
    of scanned (~40 us for 85 KB).

    Raises:
        LimitExceeded: 400 ``json_too_deep``.
    """
    counted = False
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            raise LimitExceeded(
                400,
                "json_too_deep",
                f"request body is nested more than {limit} levels deep (max_json_depth)",
                "body",
            )
        if isinstance(value, dict):
            children: Iterable[Any] = value.values()
        else:
            if not counted and len(value) > WALK_MAX_LIST:
                if raw.count(b"[") + raw.count(b"{") <= limit:
                    return
                counted = True
            children = value
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def parse_json(raw: bytes, model: type[_M], max_depth: int | None = None) -> tuple[_M, Any]:
    """Parse ``raw`` with orjson, check its depth (``max_depth`` levels; None: unchecked) and validate it against
    ``model``; returns (validated model, parsed JSON).

    Raises:
        RequestValidationError: invalid JSON (``json_invalid``, answered 400) or invalid fields (422).
        LimitExceeded: nested deeper than ``max_depth``.
    """
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _invalid_json(str(exc)) from None
    if max_depth is not None and isinstance(data, dict | list):
        check_depth(raw, data, max_depth)
    try:
        return model.model_validate(data), data
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def scan_and_parse(
    raw: bytes, model: type[_M], limits: InputLimits, contexts: dict[str, int], heavy: HeavyBody | None = None
) -> tuple[_M, Any]:
    """``check_body`` on simdjson's view of ``raw``, then ``parse_json`` (synchronous; run it in a thread).
    ``heavy``: what the light path gave up on, holding that view already (taken out of it here).

    Raises:
        LimitExceeded, RequestValidationError.
    """
    _scan(raw, limits, contexts, None, heavy.take() if heavy is not None else None)
    return parse_json(raw, model, limits.max_json_depth)


class HeavyBody:
    """The light path gave up on a body (more than ``LIGHT_MAX_VALUES``): its simdjson view, handed to the thread
    (``take`` leaves nothing behind: no frame of the loop's keeps the view alive while or after it is used)."""

    __slots__ = ("_doc",)

    def __init__(self, doc: Any) -> None:
        self._doc = doc

    def take(self) -> Any:
        """The view, once (None after)."""
        doc, self._doc = self._doc, None
        return doc


def scan_and_parse_light(
    raw: bytes, model: type[_M], limits: InputLimits, contexts: dict[str, int]
) -> tuple[_M, Any] | HeavyBody:
    """``scan_and_parse`` for a body whose bulk is text; a ``HeavyBody`` as soon as the scan finds more than
    ``LIGHT_MAX_VALUES`` JSON values or token ids (nothing else was done: give it to ``scan_and_parse`` in a
    thread). Same answers as ``scan_and_parse`` otherwise (a limit exceeded before that point is raised as there).

    Raises:
        LimitExceeded, RequestValidationError.
    """
    doc = _parse_doc(raw)
    try:
        _scan(raw, limits, contexts, LIGHT_MAX_VALUES, doc)
    except _Heavy:
        return HeavyBody(doc)
    except LimitExceeded:
        del doc  # the exception's traceback keeps this frame: not the document (``_scan``)
        raise
    del doc
    return parse_json(raw, model, limits.max_json_depth)


def _parse_doc(raw: bytes) -> Any:
    """simdjson's view of ``raw``.

    Raises:
        RequestValidationError: invalid JSON or UTF-8.
    """
    try:
        return simdjson.Parser().parse(raw)
    except (ValueError, RuntimeError) as exc:  # invalid UTF-8 / JSON, nesting too deep
        raise _invalid_json(str(exc).split(":  ")[0]) from None


def _scan(
    raw: bytes, limits: InputLimits, contexts: dict[str, int], light_values: int | None, doc: Any
) -> None:
    """``check_body`` on simdjson's view of ``raw`` (``doc``, parsed here when None; ``light_values``: see there)."""
    if doc is None:
        doc = _parse_doc(raw)
    try:
        check_body(doc, limits, contexts, light_values)
    except (LimitExceeded, _Heavy) as exc:
        # without check_body's frames: they hold the simdjson document (several times the body's size), and the
        # exception -> traceback -> frames references would keep it until a garbage collection happens to run
        raise exc.with_traceback(None) from None
    finally:
        del doc


class Intake:
    """Turns request bodies into validated models under ``limits``.

    Args:
        limits: the input limits.
        contexts: returns ``model_contexts`` of the fleet now (called on the event loop).
    """

    def __init__(
        self,
        limits: InputLimits,
        contexts: Callable[[], dict[str, int]],
        fields: ClientFields | None = None,
    ) -> None:
        self.limits = limits
        self.contexts = contexts
        #: strips router-controlled fields from the bodies that go on (router/serve/client_fields.py); None: kept
        self.fields = fields

    async def parse(self, raw: bytes, model: type[_M]) -> tuple[_M, Any]:
        """Validate ``raw`` against ``model``: inline when small; when large, shape-checked first, on the loop when
        its bulk is text (``scan_and_parse_light``), else in a worker thread.

        Raises:
            LimitExceeded: a limit is exceeded (nothing was validated).
            RequestValidationError: invalid JSON (400) or fields (422).
        """
        n, limits = len(raw), self.limits
        if n < SCAN_MIN_BYTES:
            parsed = parse_json(raw, model, limits.max_json_depth)
        elif n < LIGHT_MAX_BYTES:
            # a long prompt's text is scanned and parsed on the loop in well under a millisecond; a body with many
            # values goes on to a thread with its simdjson view
            contexts = self.contexts()
            light = scan_and_parse_light(raw, model, limits, contexts)
            if isinstance(light, HeavyBody):
                parsed = await asyncio.to_thread(scan_and_parse, raw, model, limits, contexts, light)
            else:
                parsed = light
        else:  # in a thread; one large scan at a time (router.core.large_parse: ~7x the body in memory)
            parsed = await scan_in_thread(n, scan_and_parse, raw, model, limits, self.contexts())
        check_sequences(parsed[1], limits.max_sequences)
        return parsed


async def dump_messages(messages: Sequence[BaseModel]) -> list[dict[str, Any]]:
    """``model_dump(exclude_none=True)`` of chat messages; a long conversation is dumped in a worker thread."""
    if len(messages) <= THREAD_MIN_MESSAGES:
        return [m.model_dump(exclude_none=True) for m in messages]
    return await asyncio.to_thread(lambda: [m.model_dump(exclude_none=True) for m in messages])


def check_sequences(body: Any, max_sequences: int) -> None:
    """Refuse a body whose ``n`` or ``best_of`` asks for more than ``max_sequences`` sequences (other values,
    e.g. 0 or a fraction, are the engine's to refuse).

    Raises:
        LimitExceeded: 400 ``too_many_sequences`` naming the field.
    """
    if not isinstance(body, dict):
        return
    for key in ("n", "best_of"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > max_sequences:
            raise LimitExceeded(
                400,
                "too_many_sequences",
                f"{key} = {value} asks for more than {max_sequences} sequences (max_sequences_per_request)",
                key,
            )


def sequences(extra: dict[str, Any] | None) -> int:
    """Sequences a request asks the engine for: the larger of its ``n`` and ``best_of`` (vLLM) when they are
    integers >= 1, else 1 (the engine validates them)."""
    count = 1
    for key in ("n", "best_of"):
        value = (extra or {}).get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > count:
            count = value
    return count


def not_a_bool(value: Any) -> Any:
    """Validator of token ids: a JSON boolean is not an integer (pydantic would read ``true`` as 1). Integral
    numbers written as ``2.0`` stay accepted: JSON has one number type and the OpenAPI ``integer`` includes them;
    fractions are refused by the ``int`` type itself.

    Raises:
        ValueError: ``value`` is a boolean.
    """
    if isinstance(value, bool):
        raise ValueError("a boolean is not a token id")
    return value
