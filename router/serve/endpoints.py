"""The engines' endpoints the router relays besides the OpenAI generation routes, and how each is routed.

* ``POST /v1/responses`` (the Responses API): tokenized like a chat request (the conversation the engine will
  render, the chain's earlier turns included when the router knows them) and routed by the cost model; a request
  naming ``previous_response_id`` goes to the replica holding that response (``router.serve.responses``).
* ``GET`` / ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``: to the replica holding the response.
* vLLM's pooling endpoints (``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``, ``/v1/score``,
  ``/rerank``, ``/v1/rerank``, ``/v2/rerank``) and ``/tokenize``, ``/detokenize``: JSON bodies, routed by load
  (predicted completion time with an empty prompt), the engine's answer relayed unchanged.
* ``/v1/audio/transcriptions``, ``/v1/audio/translations``: multipart bodies (bounded by ``max_request_bytes``:
  413 over it), routed by load, relayed unchanged with the client's content type.
* SGLang's native ``POST /generate``: its ``text`` (or ``input_ids``) is the prompt, routed by the cost model.

Units: bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType


class Kind(enum.Enum):
    """How an engine endpoint is routed (see the module docstring)."""

    RESPONSES = "responses"
    RESPONSE_BY_ID = "response_by_id"
    BY_LOAD = "by_load"
    MULTIPART = "multipart"
    SGLANG_GENERATE = "sglang_generate"


#: POST routes relayed to engines (besides ``/v1/completions`` and ``/v1/chat/completions``) -> how routed
ENGINE_POST_ROUTES: Mapping[str, Kind] = MappingProxyType(
    {
        "/v1/responses": Kind.RESPONSES,
        "/v1/embeddings": Kind.BY_LOAD,
        "/pooling": Kind.BY_LOAD,
        "/classify": Kind.BY_LOAD,
        "/score": Kind.BY_LOAD,
        "/v1/score": Kind.BY_LOAD,
        "/rerank": Kind.BY_LOAD,
        "/v1/rerank": Kind.BY_LOAD,
        "/v2/rerank": Kind.BY_LOAD,
        "/tokenize": Kind.BY_LOAD,
        "/detokenize": Kind.BY_LOAD,
        "/v1/audio/transcriptions": Kind.MULTIPART,
        "/v1/audio/translations": Kind.MULTIPART,
        "/generate": Kind.SGLANG_GENERATE,
    }
)

#: the route patterns of a stored response (``{id}``: one path segment) and their methods
RESPONSE_RETRIEVE = "/v1/responses/{id}"
RESPONSE_CANCEL = "/v1/responses/{id}/cancel"
RESPONSE_ROUTES: Mapping[str, frozenset[str]] = MappingProxyType(
    {RESPONSE_RETRIEVE: frozenset({"GET", "DELETE"}), RESPONSE_CANCEL: frozenset({"POST"})}
)


def response_route(path: str) -> tuple[str, str] | None:
    """``(pattern, response id)`` when ``path`` (normalized) names a stored response (``/v1/responses/{id}`` or
    ``/v1/responses/{id}/cancel``), else None."""
    if not path.startswith("/v1/responses/"):
        return None
    rest = path[len("/v1/responses/") :].split("/")
    if len(rest) == 1 and rest[0]:
        return RESPONSE_RETRIEVE, rest[0]
    if len(rest) == 2 and rest[0] and rest[1] == "cancel":
        return RESPONSE_CANCEL, rest[0]
    return None


def route_key(path: str) -> str:
    """The route table key of a normalized path: a stored response's pattern, else the path itself."""
    found = response_route(path)
    return found[0] if found is not None else path


def multipart_field(body: bytes, name: str, max_scan_bytes: int = 65536) -> str | None:
    """The value of the short text field ``name`` of a ``multipart/form-data`` body (searched in its first
    ``max_scan_bytes``), or None: enough to route an audio request by its ``model`` and see ``stream``."""
    head = body[:max_scan_bytes]
    marker = b'name="' + name.encode("ascii") + b'"'
    at = head.find(marker)
    if at < 0:
        return None
    start = head.find(b"\r\n\r\n", at)
    if start < 0:
        return None
    start += 4
    end = head.find(b"\r\n", start)
    if end < 0 or end - start > 512:
        return None
    return head[start:end].decode("utf-8", "replace").strip()
