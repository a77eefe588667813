"""What every HTTP endpoint module of the stand-in engine shares: errors in the engines' shapes, JSON bodies, SSE,
ids, and the narrow view of the engine an endpoint module needs (``EngineCore``; ``fakes.fake_engine.FakeEngine``
is one).

Error shapes, as the released engines answer them:

* vLLM (0.32): ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as ``code``
  (``vllm/entrypoints/serve/engine/protocol.py`` ``ErrorResponse``); a request that fails pydantic validation gets
  type ``"Bad Request"``, a message listing the errors and ``param`` ``"body.<field>"``; an unknown path or method
  FastAPI's own ``{"detail": "Not Found"}`` / ``{"detail": "Method Not Allowed"}``.
* SGLang: the OpenAI-compatible endpoints answer the older flat ``{"object": "error", "message", "type", "param",
  "code"}``; the native ``/generate`` answers ``{"error": {"message"}}`` (see ``fakes.sglang_native``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

#: the HTTP faults an endpoint applies before queueing a request: the faulty response to send instead, if any
FaultsBefore = Callable[[], Awaitable[Response | None]]


class BadRequest(Exception):
    """A client error with an HTTP status, an error type and the offending parameter (rendered in the dialect's
    error shape by the app's exception handler).

    Args:
        message: the human-readable reason.
        status: HTTP status.
        err_type: the error's ``type`` (vLLM: ``BadRequestError``, ``NotFoundError``, ``invalid_request_error``,
            ``Bad Request`` for validation errors, ...).
        param: the request field at fault, or None.
    """

    def __init__(
        self, message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param


def error_body(
    dialect: str, message: str, status: int, err_type: str = "BadRequestError", param: str | None = None
) -> dict[str, Any]:
    """The JSON error body ``dialect`` (``vllm`` / ``sglang``) answers for a failed request (see module doc)."""
    if dialect == "sglang":
        return {"object": "error", "message": message, "type": err_type, "param": param, "code": status}
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(
    dialect: str, message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
) -> JSONResponse:
    """``error_body`` as a response with HTTP ``status``."""
    return JSONResponse(error_body(dialect, message, status, err_type, param), status_code=status)


def validation_error(field: str, msg: str, kind: str, body: Any) -> BadRequest:
    """A request that fails vLLM's pydantic validation of ``field`` (``kind``: pydantic's error type, e.g.
    ``missing``, ``string_type``): 400, type ``Bad Request``, ``param`` ``body.<field>``, vLLM's message form."""
    shown = f"<dict of {len(body)} items>" if isinstance(body, dict) else repr(body)[:200]
    detail = {"type": kind, "loc": f"body.{field}", "msg": msg, "input": shown}
    return BadRequest(f"1 validation error:\n  {detail}", 400, "Bad Request", f"body.{field}")


def vllm_validation(message: str, param: str, value: Any = None) -> BadRequest:
    """vLLM's ``VLLMValidationError`` rendered: ``<message> (parameter=<param>[, value=<value>])``."""
    suffix = f"parameter={param}" if value is None else f"parameter={param}, value={value}"
    return BadRequest(f"{message} ({suffix})", 400, "BadRequestError", param)


async def json_object(request: Request) -> dict[str, Any]:
    """The request's JSON object body; ``BadRequest`` when it is not JSON or not an object."""
    raw = await request.body()
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def until_disconnected(request: Request) -> None:
    """Return once the client has closed its connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse_data(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as compact JSON (``data: ...``)."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse_named(event: str, obj: Any) -> bytes:
    """One SSE event with an ``event:`` line (the Responses API's framing)."""
    return f"event: {event}\n".encode() + sse_data(obj)


def new_id(prefix: str) -> str:
    """A fresh id like vLLM's: ``prefix`` + 16 hex digits."""
    return prefix + uuid.uuid4().hex[:16]


def message_text(content: Any) -> str:
    """The text of an OpenAI message ``content`` (a string, or parts whose ``text`` is kept: ``text``,
    ``input_text``, ``output_text``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text")
        )
    return "" if content is None else str(content)


# -- the engine as an endpoint module sees it ----------------------------------------------------------------


class Generation(Protocol):
    """One request in the engine: ``queue`` yields ``("first", ev)``, ``("token", i)`` ..., ``("done", ev)``."""

    prompt_tokens: int
    max_tokens: int
    cached_tokens: int
    done: bool
    queue: asyncio.Queue[tuple[str, Any]]

    async def generated(self) -> int:
        """Wait until done; the number of tokens generated."""
        ...


class Tokenizer(Protocol):
    """The engine's tokenizer (``fakes.fake_engine.EngineTokenizer``)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        ...

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The chat template applied to ``messages``."""
        ...


class EngineCore(Protocol):
    """What an endpoint module uses of the engine: its options, tokenizer, served names, and generation."""

    requests_running_http: int

    @property
    def opts(self) -> argparse.Namespace:
        """The engine's command line."""
        ...

    @property
    def tokenizer(self) -> Tokenizer:
        """Its tokenizer."""
        ...

    @property
    def served(self) -> list[str]:
        """Model names it serves (the first is reported)."""
        ...

    @property
    def loras(self) -> set[str]:
        """LoRA adapter names it serves."""
        ...

    def submit(
        self,
        token_ids: list[int],
        max_tokens: int,
        lora: str | None = None,
        salt: str | None = None,
        remote_kv_tokens: int = 0,
    ) -> Generation:
        """Queue a request now; its state."""
        ...

    def abort(self, state: Any) -> None:
        """Drop a request whose client went away."""
        ...

    def word(self, i: int) -> str:
        """The text of output token ``i``."""
        ...

    def note_streamed_token(self) -> None:
        """Count a streamed token (fault injection)."""
        ...


def output_text(engine: EngineCore, n: int) -> str:
    """The text of a generation's first ``n`` tokens."""
    return "".join(engine.word(i) for i in range(n))


def resolve_model(engine: EngineCore, name: Any) -> str | None:
    """The LoRA adapter a request's ``model`` names (None for the base model or no name); vLLM's 404 otherwise."""
    if name is None or name in engine.served:
        return None
    if isinstance(name, str) and name in engine.loras:
        return name
    aliases = ", ".join(engine.served)
    raise BadRequest(
        f"The model `{name}` does not exist. Valid aliases: {aliases}.", 404, "NotFoundError", "model"
    )


def token_ids_or_none(value: Any) -> list[int] | None:
    """``value`` as a list of token ids when it is one (ints in [0, 2**32)), else None."""
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value
    ):
        return list(value)
    return None


def check_prompt_fits(prompt_len: int, max_model_len: int, output_tokens: int = 1) -> None:
    """vLLM's refusal of a prompt that leaves no room for ``output_tokens`` (1 when generating, 0 when pooling)
    within ``max_model_len`` (400, ``param`` ``input_tokens``)."""
    if prompt_len + output_tokens > max_model_len:
        raise vllm_validation(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains at "
            f"least {prompt_len} input tokens, which exceeds this limit even without any output tokens. Please "
            "reduce the length of the input prompt.",
            "input_tokens",
            prompt_len,
        )


def nonempty_str_list(value: Any) -> Sequence[str] | None:
    """``value`` as a list of strings when it is a string or a non-empty list of strings, else None."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    return None
