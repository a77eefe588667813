"""Errors as clients see them: OpenAI-style JSON ``{"error": {"message", "type", "code", "param"}}``.

A leaf of the router: every layer may use it, it imports nothing of the router.
"""

from __future__ import annotations

import orjson
from starlette.responses import Response


def error_body(
    status: int, message: str, code: str, param: str | None = None, err_type: str | None = None
) -> bytes:
    """OpenAI-style error JSON bytes."""
    if err_type is None:
        err_type = "invalid_request_error" if status < 500 else "server_error"
    return orjson.dumps({"error": {"message": message, "type": err_type, "code": code, "param": param}})


def error_response(
    status: int, message: str, code: str, param: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    """An OpenAI-style JSON error response."""
    return Response(
        error_body(status, message, code, param),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )
