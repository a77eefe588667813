"""SGLang's native ``POST /generate`` on the stand-in's SGLang dialect (``sglang/srt/entrypoints/http_server.py``,
``managers/io_struct.py`` ``GenerateReqInput``, the tokenizer manager's output dicts).

* Body: exactly one of ``text`` / ``input_ids`` (one prompt, or a list of prompts: a batch answers a list);
  ``sampling_params`` (``max_new_tokens``; default ``--default-max-tokens``); ``stream``; ``rid`` (the request
  id, default 32 hex digits); ``return_logprob`` and the rest are accepted and not modelled.
* Answer: ``{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "length", "length": n},
  "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens", "completion_tokens",
  "cached_tokens", "e2e_latency"}}``. A stream sends one ``data:`` event per token carrying the text *so far* (SGLang's
  default, ``incremental_streaming_output`` off), ``finish_reason`` null until the last, then ``data: [DONE]``.
* Errors: a request SGLang's input normalisation refuses answers 400 ``{"error": {"message"}}`` (SGLang's
  ``_create_error_response``); a body that is not a JSON object 400 in the flat OpenAI-era shape
  (``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fakes.engine_api import (
    BadRequest,
    EngineCore,
    FaultsBefore,
    Generation,
    output_text,
    sse_data,
    token_ids_or_none,
)


class GenerateError(Exception):
    """A ``/generate`` request SGLang refuses with ``{"error": {"message"}}`` (400)."""


@dataclass(slots=True)
class GenerateInput:
    """One parsed ``/generate`` request: its prompts (ids), output budget, switches and request id."""

    prompts: list[list[int]]
    batch: bool
    max_new_tokens: int
    stream: bool
    rid: str


def prompts_of(engine: EngineCore, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
    """The prompts of ``text`` or ``input_ids`` (exactly one of them), and whether the request is a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise GenerateError("Either text, input_ids or input_embeds should be provided.")
    tok = engine.tokenizer
    if isinstance(text, str):
        return [tok.encode(text)], False
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return [tok.encode(t) for t in text], True
    one = token_ids_or_none(ids)
    if one:
        return [one], False
    if isinstance(ids, list) and ids:
        many = [token_ids_or_none(x) for x in ids]
        if all(many):
            return [m for m in many if m], True
    raise GenerateError(
        "text must be a string or a list of strings; input_ids a list of token ids or of such lists"
    )


def parse(engine: EngineCore, body: dict[str, Any]) -> GenerateInput:
    """Validate a ``/generate`` body like SGLang's ``GenerateReqInput.normalize_batch_and_arguments``."""
    prompts, batch = prompts_of(engine, body)
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise GenerateError("sampling_params must be an object")
    mt = sp.get("max_new_tokens", engine.opts.default_max_tokens)
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise GenerateError(f"max_new_tokens must be at least 1, got {mt}.")
    limit = engine.opts.max_model_len
    for p in prompts:
        if len(p) + mt > limit:
            raise GenerateError(
                f"Requested token count exceeds the model's maximum context length of {limit} tokens. You "
                f"requested a total of {len(p) + mt} tokens: {len(p)} tokens from the input messages and {mt} "
                "tokens for the completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit."
            )
    rid = body.get("rid")
    return GenerateInput(
        prompts, batch, mt, bool(body.get("stream")), rid if isinstance(rid, str) else uuid.uuid4().hex
    )


class SGLangGenerate:
    """SGLang's ``/generate`` over one engine.

    Args:
        engine: the engine generating the text.
        faults_before: the HTTP faults applied before a request is queued (the faulty response, if any).
    """

    def __init__(self, engine: EngineCore, faults_before: FaultsBefore) -> None:
        self.engine = engine
        self.faults_before = faults_before

    def output(self, st: Generation, n: int, rid: str, t0: float, finished: bool) -> dict[str, Any]:
        """One output dict after ``n`` tokens (``finished``: with its finish reason and e2e latency)."""
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": {"type": "length", "length": n} if finished else None,
            "prompt_tokens": st.prompt_tokens,
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": n,
            "cached_tokens": st.cached_tokens,
        }
        if finished:
            meta["e2e_latency"] = round(time.monotonic() - t0, 6)
        return {
            "text": output_text(self.engine, n),
            "output_ids": [100 + i % 16 for i in range(n)],
            "meta_info": meta,
        }

    async def serve(self, request: Request) -> Response:
        """One ``/generate``: JSON (a list for a batch) or SSE."""
        try:
            body = _json_object(await request.body())
            req = parse(self.engine, body)
        except GenerateError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        faulty = await self.faults_before()
        if faulty is not None:
            return faulty
        t0 = time.monotonic()
        states = [self.engine.submit(p, req.max_new_tokens) for p in req.prompts]
        rids = [req.rid] if not req.batch else [f"{req.rid}-{i}" for i in range(len(states))]
        if req.stream:
            return StreamingResponse(self.stream(states, rids, t0), media_type="text/event-stream")
        self.engine.requests_running_http += 1
        try:
            outs = [
                self.output(st, await st.generated(), rid, t0, True)
                for st, rid in zip(states, rids, strict=True)
            ]
        finally:
            self.engine.requests_running_http -= 1
            for st in states:
                self.engine.abort(st)
        return JSONResponse(outs if req.batch else outs[0])

    async def stream(self, states: list[Generation], rids: list[str], t0: float) -> AsyncIterator[bytes]:
        """Each prompt's events in turn (batch outputs carry their ``index``), then ``[DONE]``."""
        engine = self.engine
        engine.requests_running_http += 1
        try:
            for i, (st, rid) in enumerate(zip(states, rids, strict=True)):
                n = 0
                while True:
                    kind, _ = await st.queue.get()
                    if kind == "token":
                        n += 1
                        out = self.output(st, n, rid, t0, n >= st.max_tokens)
                        if len(states) > 1:
                            out["index"] = i
                        yield sse_data(out)
                        engine.note_streamed_token()
                    elif kind == "done":
                        break
            yield b"data: [DONE]\n\n"
        finally:
            engine.requests_running_http -= 1
            for st in states:
                engine.abort(st)


def _json_object(raw: bytes) -> dict[str, Any]:
    import json

    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise BadRequest(f"JSON decode error: {exc}", 400, "Bad Request") from None
    if not isinstance(body, dict):
        raise BadRequest(
            "Input should be a valid dictionary or object to extract fields from", 400, "Bad Request"
        )
    return body


def add_sglang_generate_route(app: FastAPI, api: SGLangGenerate) -> None:
    """Register SGLang's ``/generate`` (POST and PUT, like SGLang)."""

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        return await api.serve(request)
