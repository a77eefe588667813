"""The stand-in engine's Responses API, with vLLM 0.32's behaviour (``vllm/entrypoints/openai/responses/``).

* ``POST /v1/responses``: ``input`` (a string, or message items), ``instructions``, ``max_output_tokens``,
  ``stream``, ``store``, ``background``, ``previous_response_id``, ``request_id`` (the response id, like vLLM's
  extra field; default ``resp_`` + 16 hex digits), ``cache_salt``, a LoRA adapter as ``model``.
* ``GET /v1/responses/{id}`` (``?stream=true&starting_after=N`` replays a background stream's events),
  ``POST /v1/responses/{id}/cancel``. vLLM serves no ``DELETE``: it answers 405 (FastAPI's
  ``{"detail": "Method Not Allowed"}``).

State lives in this process's memory only, never expires (vLLM's ``response_store`` / ``msg_store``): a restart, or
another engine, knows none of it, and a follow-up naming an unknown ``previous_response_id`` gets 404
``{"error": {"message": "Response with id '<id>' not found.", "type": "invalid_request_error", "param":
"response_id", "code": 404}}``. ``store: true`` (OpenAI's default) is honoured only when the engine runs with
``VLLM_ENABLE_RESPONSES_API_STORE=1`` in its environment or ``--enable-responses-store``; otherwise it is silently
ignored, and ``background`` (which needs the store) answers 400.

The prompt of a request is its conversation rendered with the chat template and tokenized *with* special tokens
(so the tiny test model's prompt starts with two BOS, as vLLM's does): ``instructions`` as a system message, then
the chain's earlier turns (the stored input messages of ``previous_response_id`` without their system message,
then its output text as an assistant message), then ``input``. A follow-up's prompt therefore begins with its
predecessor's prompt, and the engine's prefix cache serves that part when the chain stays on one replica.

Streams are vLLM's event sequence, one SSE event (``event: <type>`` + ``data:``) per HTTP chunk:
``response.created``, ``response.in_progress``, then for a non-empty answer ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per token, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; last ``response.completed`` with the final response
and its usage. A stored response is stored when it completes; a background one at once with status ``queued``
(kept until it completes: vLLM never shows ``in_progress``), ``cancelled`` after a cancel.

Served on both dialects with vLLM's semantics (SGLang's own ``/v1/responses`` store is not modelled).

Differences from vLLM, on purpose: a background stream whose response was cancelled ends (vLLM's stays open
forever), and ``GET ...?stream=true`` of a response that has no stream answers 400 (vLLM fails inside the
stream after its 200).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fakes.engine_api import (
    BadRequest,
    EngineCore,
    FaultsBefore,
    Generation,
    check_prompt_fits,
    json_object,
    message_text,
    new_id,
    output_text,
    resolve_model,
    sse_named,
    until_disconnected,
    validation_error,
    vllm_validation,
)

#: the environment variable that turns vLLM's response store on (any of these values)
STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
_TRUE = ("1", "true", "True", "TRUE")


def store_enabled(flag: bool) -> bool:
    """Whether ``store: true`` is honoured: the ``--enable-responses-store`` flag or ``STORE_ENV`` set."""
    return flag or os.environ.get(STORE_ENV, "") in _TRUE


def not_found(response_id: str) -> BadRequest:
    """vLLM's answer for an unknown response id (404, ``param`` ``response_id``)."""
    return BadRequest(
        f"Response with id '{response_id}' not found.", 404, "invalid_request_error", "response_id"
    )


@dataclass(slots=True)
class Turn:
    """One parsed ``POST /v1/responses``.

    Attributes:
        rid: the response id.
        body: the request body (echoed fields are read from it).
        model_name: the served name the response reports (the LoRA adapter's when one is named).
        lora: the LoRA adapter, or None.
        salt: vLLM's ``cache_salt``, or None.
        messages: the conversation the prompt renders (chain history included).
        ids: the prompt's token ids.
        max_tokens: output tokens the engine generates.
        stream, background, store: the request's switches (``store`` already False when the store is off).
    """

    rid: str
    body: dict[str, Any]
    model_name: str
    lora: str | None
    salt: str | None
    messages: list[dict[str, Any]]
    ids: list[int]
    max_tokens: int
    stream: bool
    background: bool
    store: bool


@dataclass(slots=True)
class EventLog:
    """A background stream's events (vLLM's ``event_store``), replayable from any sequence number."""

    events: list[bytes] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False

    def append(self, event: bytes) -> None:
        """Record one event and wake the readers."""
        self.events.append(event)
        self.changed.set()

    def finish(self) -> None:
        """No more events will come."""
        self.finished = True
        self.changed.set()

    async def read(self, start: int) -> AsyncIterator[bytes]:
        """Events from index ``start`` on, waiting for new ones until the log is finished."""
        i = start
        while True:
            self.changed.clear()
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.finished:
                return
            await self.changed.wait()


@dataclass
class ResponsesStore:
    """Everything the Responses API keeps in the engine process (never expired, like vLLM's)."""

    responses: dict[str, dict[str, Any]] = field(default_factory=dict)
    messages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    logs: dict[str, EventLog] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)


# -- the response object -----------------------------------------------------------------------------------


def usage_of(st: Generation, n: int) -> dict[str, Any]:
    """The Responses ``usage`` of a generation that produced ``n`` tokens (cached tokens always reported)."""
    return {
        "input_tokens": st.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": st.cached_tokens,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": n,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": st.prompt_tokens + n,
    }


def text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An assistant ``message`` output item (no content part when the text is empty, like vLLM)."""
    content = [text_part(text, None)] if text and status == "completed" else []
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def _float(body: dict[str, Any], key: str, default: float) -> float:
    v = body.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else default


def response_object(
    turn: Turn, created: int, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """vLLM's ``ResponsesResponse`` of ``turn`` (field order as vLLM serializes it)."""
    b = turn.body
    tools = b.get("tools") or []
    choice = b.get("tool_choice", "auto")
    return {
        "id": turn.rid,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": b.get("instructions"),
        "metadata": b.get("metadata"),
        "model": turn.model_name,
        "object": "response",
        "output": output,
        "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
        "temperature": _float(b, "temperature", 1.0),
        "tool_choice": "none" if not tools and choice in ("auto", "none") else choice,
        "tools": tools,
        "top_p": _float(b, "top_p", 1.0),
        "background": turn.background,
        "max_output_tokens": turn.max_tokens,
        "max_tool_calls": b.get("max_tool_calls"),
        "previous_response_id": b.get("previous_response_id"),
        "prompt": None,
        "reasoning": b.get("reasoning"),
        "service_tier": b.get("service_tier") or "auto",
        "status": status,
        "text": b.get("text"),
        "top_logprobs": None,
        "truncation": b.get("truncation") or "disabled",
        "usage": usage,
        "user": b.get("user"),
        "presence_penalty": _float(b, "presence_penalty", 0.0),
        "frequency_penalty": _float(b, "frequency_penalty", 0.0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def final_status(turn: Turn, n: int) -> str:
    """``incomplete`` when the generation stopped at ``max_output_tokens`` (the stand-in's always do), else
    ``completed``."""
    return "incomplete" if n >= turn.max_tokens else "completed"


# -- request parsing ---------------------------------------------------------------------------------------


def input_messages(value: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input``: a string is one user message; items with a ``role`` (plain or
    ``type: message``) keep it, ``function_call_output`` becomes a tool message, ``function_call`` and
    ``reasoning`` items add nothing to the text. Anything else: vLLM's 400 validation error."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise validation_error("input", "Input should be a valid string or list", "string_type", body)
    out: list[dict[str, Any]] = []
    for item in value:
        if not isinstance(item, dict):
            raise validation_error("input", "Input should be a valid dictionary", "dict_type", body)
        kind = item.get("type")
        if isinstance(item.get("role"), str) and kind in (None, "message"):
            out.append({"role": item["role"], "content": message_text(item.get("content"))})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": message_text(item.get("output"))})
        elif kind not in ("function_call", "reasoning"):
            raise validation_error(
                "input", "Input item is not a message or a known item type", "union_tag_invalid", body
            )
    return out


def checked_switches(body: dict[str, Any], store_on: bool) -> tuple[bool, bool, bool]:
    """``(stream, background, store)`` of a request, refused like vLLM: ``background`` without ``store`` (400),
    ``background`` while the store is off (400); ``store`` silently off when the store is off."""
    stream, background = bool(body.get("stream")), bool(body.get("background"))
    store = body.get("store", True) is not False
    if background and not store:
        raise vllm_validation("background can only be used when `store` is true", "background")
    if body.get("prompt") is not None:
        raise vllm_validation("prompt template is not supported", "prompt")
    if background and not store_on:
        raise BadRequest(
            "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
            "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
            "launching the vLLM server.",
            400,
            "invalid_request_error",
            "background",
        )
    if body.get("previous_input_messages") and body.get("previous_response_id"):
        raise BadRequest(
            "Only one of `previous_input_messages` and `previous_response_id` can be set.",
            400,
            "invalid_request_error",
            "previous_response_id",
        )
    return stream, background, store and store_on


def max_output_tokens(body: dict[str, Any], default: int, prompt_len: int, max_model_len: int) -> int:
    """Tokens to generate: ``max_output_tokens`` (the stand-in's default when absent) within the context left."""
    mt = body.get("max_output_tokens")
    if mt is None:
        mt = default
    if not isinstance(mt, int) or isinstance(mt, bool):
        raise validation_error("max_output_tokens", "Input should be a valid integer", "int_type", body)
    if mt < 1:
        raise vllm_validation(f"max_tokens must be at least 1, got {mt}.", "max_tokens", mt)
    return min(mt, max_model_len - prompt_len)


# -- the API -----------------------------------------------------------------------------------------------


class ResponsesApi:
    """``/v1/responses`` over one engine, with the engine process's store.

    Args:
        engine: the engine generating the answers.
        faults_before: the HTTP faults applied before a request is queued (the faulty response, if any).
    """

    def __init__(self, engine: EngineCore, faults_before: FaultsBefore) -> None:
        self.engine = engine
        self.faults_before = faults_before
        self.store_on = store_enabled(bool(getattr(engine.opts, "enable_responses_store", False)))
        self.store = ResponsesStore()

    def forget_all(self) -> None:
        """Drop every stored response and cancel the background ones (the engine process restarted)."""
        for task in list(self.store.tasks.values()):
            task.cancel()
        self.store = ResponsesStore()

    # -- parsing -------------------------------------------------------------------------------------------
    def conversation(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The messages the request's prompt renders: instructions, the chain's history, the new input."""
        if "input" not in body:
            raise validation_error("input", "Field required", "missing", body)
        msgs: list[dict[str, Any]] = []
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise validation_error("instructions", "Input should be a valid string", "string_type", body)
        if instructions:
            msgs.append({"role": "system", "content": instructions})
        prev_id = body.get("previous_response_id")
        if prev_id is not None:
            if not isinstance(prev_id, str):
                raise validation_error(
                    "previous_response_id", "Input should be a valid string", "string_type", body
                )
            prev = self.store.responses.get(prev_id)
            if prev is None:
                raise not_found(prev_id)
            msgs += [m for m in self.store.messages.get(prev_id, []) if m.get("role") != "system"]
            msgs += [
                {"role": "assistant", "content": part.get("text", "")}
                for item in prev.get("output", [])
                if item.get("type") == "message"
                for part in item.get("content", [])
            ]
        return msgs + input_messages(body["input"], body)

    def parse(self, body: dict[str, Any]) -> Turn:
        """Validate a request and render its prompt, in vLLM's order of checks."""
        stream, background, store = checked_switches(body, self.store_on)
        lora = resolve_model(self.engine, body.get("model"))
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise validation_error(
                "cache_salt", "String should have at least 1 character", "string_too_short", body
            )
        msgs = self.conversation(body)
        tok = self.engine.tokenizer
        try:
            ids = tok.encode(tok.render_chat(msgs, True), add_special_tokens=True)
        except Exception as exc:
            raise BadRequest(f"chat template failed: {exc}") from None
        opts = self.engine.opts
        check_prompt_fits(len(ids), opts.max_model_len)
        rid = body.get("request_id")
        return Turn(
            rid=rid if isinstance(rid, str) and rid else new_id("resp_"),
            body=body,
            model_name=lora or opts.model,
            lora=lora,
            salt=salt,
            messages=msgs,
            ids=ids,
            max_tokens=max_output_tokens(body, opts.default_max_tokens, len(ids), opts.max_model_len),
            stream=stream,
            background=background,
            store=store,
        )

    # -- POST /v1/responses --------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        """Serve one ``POST /v1/responses``: JSON, SSE, or a queued background response."""
        turn = self.parse(await json_object(request))
        faulty = await self.faults_before()
        if faulty is not None:
            return faulty
        st = self.engine.submit(turn.ids, turn.max_tokens, turn.lora, turn.salt)
        created = int(time.time())
        if turn.store:
            self.store.messages[turn.rid] = turn.messages
        if turn.background:
            return self.start_background(turn, st, created)
        if turn.stream:
            return StreamingResponse(
                self.foreground_stream(turn, st, created), media_type="text/event-stream"
            )
        n = await self.generated_or_abort(st, request)
        if n is None:
            return Response(status_code=499)
        out = self.finished(turn, st, n, created, new_id("msg_"))
        return JSONResponse(out)

    def finished(self, turn: Turn, st: Generation, n: int, created: int, item_id: str) -> dict[str, Any]:
        """The final response of a generation of ``n`` tokens, stored when asked (a cancelled one stays so)."""
        text = output_text(self.engine, n)
        output = [message_item(item_id, text, "completed")]
        out = response_object(turn, created, final_status(turn, n), output, usage_of(st, n))
        if turn.store:
            stored = self.store.responses.get(turn.rid)
            if stored is None or stored.get("status") != "cancelled":
                self.store.responses[turn.rid] = out
        return out

    async def generated_or_abort(self, st: Generation, request: Request) -> int | None:
        """Wait for a non-streamed generation; abort it and return None when the client goes away first."""
        engine = self.engine
        engine.requests_running_http += 1
        gen = asyncio.ensure_future(st.generated())
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({gen, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            engine.requests_running_http -= 1
            gone.cancel()
            if not gen.done():
                gen.cancel()
                engine.abort(st)
        return gen.result() if gen.done() and not gen.cancelled() else None

    # -- streams -------------------------------------------------------------------------------------------
    async def events(self, turn: Turn, st: Generation, created: int) -> AsyncIterator[bytes]:
        """vLLM's event sequence for one generation (see module doc); stores the final response."""
        seq = 0

        def event(kind: str, fields: dict[str, Any]) -> bytes:
            nonlocal seq
            out = sse_named(kind, dict(sorted({**fields, "sequence_number": seq, "type": kind}.items())))
            seq += 1
            return out

        start = response_object(turn, created, "in_progress", [], None)
        yield event("response.created", {"response": start})
        yield event("response.in_progress", {"response": start})
        item_id, n = new_id("msg_"), 0
        where = {"item_id": item_id, "output_index": 0}
        while True:
            kind, _ = await st.queue.get()
            if kind == "done":
                break
            if kind != "token":
                continue
            if n == 0:
                yield event(
                    "response.output_item.added",
                    {"item": message_item(item_id, "", "in_progress"), "output_index": 0},
                )
                yield event(
                    "response.content_part.added", {"content_index": 0, **where, "part": text_part("", [])}
                )
            yield event(
                "response.output_text.delta",
                {
                    "content_index": 0,
                    "delta": self.engine.word(n),
                    "item_id": item_id,
                    "logprobs": [],
                    "output_index": 0,
                },
            )
            n += 1
            self.engine.note_streamed_token()
        text = output_text(self.engine, n)
        if n:
            yield event(
                "response.output_text.done",
                {"content_index": 0, "item_id": item_id, "logprobs": [], "output_index": 0, "text": text},
            )
            yield event(
                "response.content_part.done", {"content_index": 0, **where, "part": text_part(text, None)}
            )
            yield event(
                "response.output_item.done",
                {"item": message_item(item_id, text, "completed"), "output_index": 0},
            )
        yield event("response.completed", {"response": self.finished(turn, st, n, created, item_id)})

    async def foreground_stream(self, turn: Turn, st: Generation, created: int) -> AsyncIterator[bytes]:
        """A streamed response; a client that leaves aborts the generation."""
        self.engine.requests_running_http += 1
        try:
            async for chunk in self.events(turn, st, created):
                yield chunk
        finally:
            self.engine.requests_running_http -= 1
            self.engine.abort(st)

    # -- background ----------------------------------------------------------------------------------------
    def start_background(self, turn: Turn, st: Generation, created: int) -> Response:
        """Store the response as ``queued``, run it in a task, answer the queued object (or its event stream)."""
        queued = response_object(turn, created, "queued", [], None)
        self.store.responses[turn.rid] = queued
        log = EventLog() if turn.stream else None
        if log is not None:
            self.store.logs[turn.rid] = log
        task = asyncio.ensure_future(self.run_background(turn, st, created, log))
        self.store.tasks[turn.rid] = task
        task.add_done_callback(lambda _: self.store.tasks.pop(turn.rid, None))
        if log is not None:
            return StreamingResponse(log.read(0), media_type="text/event-stream")
        return JSONResponse(queued)

    async def run_background(self, turn: Turn, st: Generation, created: int, log: EventLog | None) -> None:
        """Generate a background response to the end (or until cancelled), then store its final state."""
        try:
            if log is not None:
                async for chunk in self.events(turn, st, created):
                    log.append(chunk)
            else:
                n = await st.generated()
                self.finished(turn, st, n, created, new_id("msg_"))
        except asyncio.CancelledError:
            self.engine.abort(st)
            raise
        finally:
            if log is not None:
                log.finish()

    # -- GET /v1/responses/{id}, POST /v1/responses/{id}/cancel --------------------------------------------
    def retrieve(self, response_id: str, stream: bool, starting_after: int | None) -> Response:
        """The stored response, or (``stream``) a background stream's events after ``starting_after``."""
        stored = self.store.responses.get(response_id)
        if stored is None:
            raise not_found(response_id)
        if not stream:
            return JSONResponse(stored)
        log = self.store.logs.get(response_id)
        if log is None:
            raise vllm_validation(f"Unknown response_id: {response_id}", "response_id", response_id)
        start = 0 if starting_after is None else max(0, starting_after + 1)
        return StreamingResponse(log.read(start), media_type="text/event-stream")

    async def cancel(self, response_id: str) -> Response:
        """Cancel a queued background response (its generation is aborted); 400 for any other."""
        stored = self.store.responses.get(response_id)
        if stored is None:
            raise not_found(response_id)
        if stored.get("status") not in ("queued", "in_progress"):
            raise BadRequest(
                "Cannot cancel a synchronous response.", 400, "invalid_request_error", "response_id"
            )
        stored["status"] = "cancelled"
        task = self.store.tasks.get(response_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return JSONResponse(stored)


def add_responses_routes(app: FastAPI, api: ResponsesApi) -> None:
    """Register ``/v1/responses`` (POST), ``/v1/responses/{id}`` (GET) and ``/v1/responses/{id}/cancel``."""

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await api.create(request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(
        response_id: str, stream: bool = False, starting_after: int | None = None
    ) -> Response:
        return api.retrieve(response_id, stream, starting_after)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return await api.cancel(response_id)
