"""The OpenAI request bodies every door parses (documented in OpenAPI; unknown fields are kept and forwarded to the
engine), and request ids.

Units: tokens.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from router.serve.intake import not_a_bool


def new_request_id(given: str | None) -> str:
    """The client's ``X-Request-Id`` when sane (<= 128 printable chars), else a fresh one."""
    if given and len(given) <= 128 and given.isprintable():
        return given
    return uuid.uuid4().hex


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


class RequestCommon(BaseModel):
    """The fields every generation request has."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, description="model id (or LoRA adapter name) to serve the request")
    stream: bool = Field(default=False, description="stream the answer as server-sent events")
    max_tokens: int | None = Field(
        default=None, ge=0, le=_MAX_TOKENS, description="maximum tokens to generate"
    )
    cache_salt: str | None = Field(default=None, description="isolates the prefix cache (vLLM cache_salt)")


class CompletionRequest(RequestCommon):
    """``POST /v1/completions`` body (OpenAI completions; extra fields are forwarded unchanged)."""

    prompt: PromptT = Field(description="prompt text or token ids (a batch is routed by its first prompt)")


class ChatRequest(RequestCommon):
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


class RouteBody(RequestCommon):
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
