"""The kvroute error family and its one table: every refusal, whichever step raised it and whichever door renders it.

A step of the serving pipeline that refuses a request raises a ``KvrouteError`` (or a subclass defined next to the
step: ``RoutingError`` in ``router.core.routing``, ``Rejected`` in ``router.core.admission``, ``LimitExceeded`` in
``router.serve.intake``, ...). The error carries everything a client sees: HTTP ``status``, a stable ``code``, the
``message``, the ``param`` it is about, extra ``headers``, whether it is answered with ``Retry-After``, and the
label it is counted under in ``kvroute_rejected_total`` (``counted_as``). ``as_error`` maps anything else raised
on the way (the framework's validation error, a bug) onto the family: that is the one table, as httpx maps
transport errors to its own.

The doors only render: the HTTP app as OpenAI-style JSON (``body()`` + ``answer_headers()``), the endpoint picker as
an ext_proc ``ImmediateResponse`` with the same status, body and headers (``details`` names it). The body names the
request's trace in ``error.trace_id`` when it has one (the doors pass it: router/tracing.py).

A leaf of the router: every layer may use it, it imports nothing of the router.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response

#: response header naming why a request was refused (llm-d sends ``x-llm-d-request-dropped-reason``)
REASON_HEADER = "x-kvroute-rejected-reason"
#: response header naming the request's trace (on every answer of a request that has one: router/tracing.py)
TRACE_ID_HEADER = "x-kvroute-trace-id"


def error_body(
    status: int,
    message: str,
    code: str,
    param: str | None = None,
    err_type: str | None = None,
    trace_id: str | None = None,
) -> bytes:
    """OpenAI-style error JSON bytes (``error.trace_id``: the request's trace, when it has one)."""
    if err_type is None:
        err_type = "invalid_request_error" if status < 500 else "server_error"
    err: dict[str, Any] = {"message": message, "type": err_type, "code": code, "param": param}
    if trace_id:
        err["trace_id"] = trace_id
    return orjson.dumps({"error": err})


def error_response(
    status: int,
    message: str,
    code: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    trace_id: str | None = None,
) -> Response:
    """An OpenAI-style JSON error response (``error.trace_id``: the request's trace, when it has one)."""
    return Response(
        error_body(status, message, code, param, trace_id=trace_id),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


class KvrouteError(Exception):
    """A request the router answers with an error instead of an engine's answer.

    Class attributes (defaults of a subclass, each overridable per instance): ``status`` (HTTP), ``code`` (stable,
    machine-readable), ``retry`` (answered with ``Retry-After``), ``counted_as`` (the ``kvroute_rejected_total``
    reason label, None: not counted there).

    Args:
        message: what went wrong, for people.
        param: the request field or header the error is about.
        headers: extra response headers (``www-authenticate``, ``allow``, ...).
        wire_reason: the short reason told to the client in ``error.reason`` and ``x-kvroute-rejected-reason``.
        retry_after_s: seconds for ``Retry-After`` (None: the configured ``retry_after_s``).
        err_type: the OpenAI error ``type`` (None: ``invalid_request_error`` under 500, else ``server_error``).
        extra: more top-level fields of the JSON body (the validation ``detail`` list).
    """

    status: int = 500
    code: str = "internal_error"
    retry: bool = False
    counted_as: str | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        wire_reason: str | None = None,
        retry: bool | None = None,
        retry_after_s: float | None = None,
        counted_as: str | None = None,
        err_type: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        if retry is not None:
            self.retry = retry
        if counted_as is not None:
            self.counted_as = counted_as
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})
        self.wire_reason = wire_reason
        self.retry_after_s = retry_after_s
        self.err_type = err_type
        self.extra = dict(extra or {})

    @property
    def details(self) -> str:
        """The short name of the refusal (the picker's ``ImmediateResponse.details`` and reason header)."""
        return self.wire_reason or self.code

    def error_json(self, trace_id: str | None = None) -> dict[str, Any]:
        """The ``error`` object of the JSON body (``trace_id``: the request's trace, when it has one)."""
        err_type = self.err_type or ("invalid_request_error" if self.status < 500 else "server_error")
        out: dict[str, Any] = {
            "message": self.message,
            "type": err_type,
            "code": self.code,
            "param": self.param,
        }
        if self.wire_reason is not None:
            out["reason"] = self.wire_reason
        if trace_id:
            out["trace_id"] = trace_id
        return out

    def body(self, trace_id: str | None = None) -> bytes:
        """The OpenAI-style JSON body: ``{"error": {...}}`` plus ``extra`` (``error.trace_id``: the request's
        trace, when it has one)."""
        return orjson.dumps({"error": self.error_json(trace_id), **self.extra})

    def answer_headers(self, default_retry_after_s: int) -> dict[str, str]:
        """The response headers: ``headers``, ``Retry-After`` when ``retry`` (the error's own seconds, rounded up,
        else ``default_retry_after_s``) and the reason header when there is a ``wire_reason``."""
        out = dict(self.headers)
        if self.retry:
            seconds = (
                default_retry_after_s if self.retry_after_s is None else max(1, math.ceil(self.retry_after_s))
            )
            out["retry-after"] = str(seconds)
        if self.wire_reason is not None:
            out[REASON_HEADER] = self.wire_reason
        return out


class InvalidBody(KvrouteError):
    """The body is not JSON (400 ``invalid_json``) or its fields are invalid (422 ``invalid_request``, naming the
    first field; the whole list in ``detail``)."""

    status = 422
    code = "invalid_request"


class BadTokenIds(KvrouteError):
    """Token ids outside [0, 2**32), e.g. from an engine's ``/tokenize`` (422)."""

    status = 422
    code = "invalid_request"

    def __init__(self) -> None:
        super().__init__("token ids must be integers in [0, 2**32)", param="token_ids")


def invalid_body(exc: RequestValidationError) -> InvalidBody:
    """The family's form of a validation error: invalid JSON -> 400 ``invalid_json``; invalid fields -> 422
    ``invalid_request`` naming them (``param``: the first one; ``detail``: every one)."""
    errors = exc.errors()
    if any(e.get("type") in ("json_invalid", "json_type") for e in errors):
        msg = next((str(e.get("msg")) for e in errors if e.get("type") == "json_invalid"), "invalid JSON")
        return InvalidBody(f"request body is not valid JSON: {msg}", status=400, code="invalid_json")
    parts, first_param = [], None
    for e in errors:
        name = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        first_param = first_param or name
        parts.append(f"{name}: {e.get('msg')}")
    detail = [
        {"loc": list(e.get("loc", ())), "msg": str(e.get("msg")), "type": e.get("type")} for e in errors
    ]
    return InvalidBody("; ".join(parts), param=first_param, extra={"detail": detail})


def as_error(exc: BaseException) -> KvrouteError:
    """The one table: ``exc`` as a member of the family (a bug: 500 ``internal_error`` naming its type)."""
    if isinstance(exc, KvrouteError):
        return exc
    if isinstance(exc, RequestValidationError):
        return invalid_body(exc)
    return KvrouteError(f"internal error: {type(exc).__name__}")


def as_refusal(exc: BaseException) -> BaseException:
    """``exc`` as the client sees it: a body the framework refused becomes its kvroute refusal (400
    ``invalid_body``); anything else as it is (a cancelled or failed request is not turned into a 500)."""
    return invalid_body(exc) if isinstance(exc, RequestValidationError) else exc


def refusal_response(err: KvrouteError, default_retry_after_s: int, trace_id: str | None = None) -> Response:
    """The HTTP answer to ``err``: its JSON body, status and headers (``trace_id``: the request's trace, in
    ``error.trace_id``, when it has one)."""
    return Response(
        err.body(trace_id),
        status_code=err.status,
        media_type="application/json",
        headers=err.answer_headers(default_retry_after_s),
    )


#: the message of a request without a valid client key
NO_KEY_MESSAGE = "missing or invalid API key (Authorization: Bearer <key>)"


def unauthorized(message: str = NO_KEY_MESSAGE) -> KvrouteError:
    """401 ``unauthorized`` with ``WWW-Authenticate: Bearer``."""
    return KvrouteError(message, status=401, code="unauthorized", headers={"www-authenticate": "Bearer"})


def forbidden(message: str) -> KvrouteError:
    """403 ``forbidden``: authenticated, but not allowed this."""
    return KvrouteError(message, status=403, code="forbidden")
