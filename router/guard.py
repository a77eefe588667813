"""The router's front gate: what is decided from a request's headers alone, before its body is read.

``Guard.admit`` runs first for every HTTP request (``router.app._KvrouteApp.__call__``), ahead of the data-plane
fast path and of FastAPI:

* **authorization** (``authorize``, the one decision every front door takes: the HTTP app here, the endpoint
  picker ``router.epp`` on the gateway's request headers), made on the *normalized* request (``request_path``:
  percent-decoded once, as the engines decode, dot-segments resolved): ``/v1/*`` and ``/route`` need one of
  ``api_keys`` when any is configured (401 ``unauthorized``); ``/replicas`` and ``/index/stats`` need
  ``admin_token`` when it is configured (401 without a bearer token, 403 ``forbidden`` with another), else one of
  ``api_keys`` when those are configured. A door that forwards to engines (the picker) passes its route table:
  every request then needs a key, and a path or method outside the table is 404 / 405. Rejected
  before a byte of the body is read, with ``connection: close`` when a large body was announced, so an
  unauthenticated client cannot make the router buffer (or even read) bodies. Tokens are compared as bytes (constant time), so any header
  value, ASCII or not, gets a 401, never a 500.
* **overload shedding** (``router.loop_lag``): while the event loop's measured lag is over ``max_event_loop_lag_s``,
  new ``/v1/*`` POSTs and ``/route`` get ``503 event_loop_lag`` with ``Retry-After`` (counted in
  ``kvroute_rejected_total{reason="event_loop_lag"}``). ``/healthz``, ``/readyz``, ``/metrics`` and the admin
  views are never shed.

``Auth`` also says who may see replica URLs (``is_admin``) and scopes idempotency keys by client (``principal``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import unquote

from starlette.types import Scope, Send

from router.loop_lag import LoopLag
from router.proxy import error_response

#: routes counted under their own name in kvroute_requests_total (others: "other")
_DATA_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/route"})
_ADMIN_ROUTES = frozenset({"/replicas", "/index/stats"})
#: data-plane routes that are shed under event-loop lag (they do the work; /v1/models is a cheap read)
_SHED_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/route"})

Header = bytes | str | None

#: what the endpoint picker lets through to engines: normalized path -> methods (anything else: 404 / 405)
PICKER_ROUTES: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "/v1/completions": frozenset({"POST"}),
        "/v1/chat/completions": frozenset({"POST"}),
        "/v1/models": frozenset({"GET"}),
    }
)


def _bearer(value: Header) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header value as bytes (None when absent or empty)."""
    if value is None:
        return None
    raw = value.encode("latin-1", "replace") if isinstance(value, str) else value  # str: Starlette's latin-1
    if raw[:7].lower() != b"bearer ":
        return None
    token = raw[7:].strip()
    return token or None


class Auth:
    """Client API keys and the admin token (bytes, compared in constant time).

    Args:
        api_keys: accepted client keys (empty: no client authentication).
        admin_token: the admin token (None: admin views follow ``api_keys``).
    """

    def __init__(self, api_keys: Iterable[str], admin_token: str | None) -> None:
        self.api_keys = [k.encode("utf-8") for k in api_keys]
        self.admin_token = admin_token.encode("utf-8") if admin_token else None

    def _is_key(self, token: bytes | None) -> bool:
        found = False
        for key in self.api_keys:  # every key compared: the time does not say which one matched
            found |= token is not None and hmac.compare_digest(token, key)
        return found

    def client_ok(self, authorization: Header) -> bool:
        """True when the request may use the data plane: no keys configured, or one of them presented (or the
        admin token: an admin may do what a client does, e.g. ``/route`` with replica URLs)."""
        if not self.api_keys:
            return True
        token = _bearer(authorization)
        admin = (
            self.admin_token is not None
            and token is not None
            and hmac.compare_digest(token, self.admin_token)
        )
        return self._is_key(token) or admin

    def admin_status(self, authorization: Header) -> tuple[int, str]:
        """``(0, "")`` when the request may read the admin views, else ``(401 | 403, message)``."""
        token = _bearer(authorization)
        if self.admin_token is not None:
            if token is None:
                return 401, "missing admin token (Authorization: Bearer <admin_token>)"
            if not hmac.compare_digest(token, self.admin_token):
                return 403, "the bearer token is not the admin token (admin_token)"
            return 0, ""
        if self.api_keys and not self._is_key(token):
            return 401, "missing or invalid API key (Authorization: Bearer <key>)"
        return 0, ""

    def is_admin(self, authorization: Header) -> bool:
        """True when the caller may see internal addresses (replica URLs): it presented ``admin_token``, or no
        authentication is configured at all."""
        if self.admin_token is not None:
            token = _bearer(authorization)
            return token is not None and hmac.compare_digest(token, self.admin_token)
        return not self.api_keys

    def principal(self, authorization: Header) -> str:
        """A short stable id of the calling client (a hash of its API key), "" when no keys are configured."""
        if not self.api_keys:
            return ""
        return hashlib.sha256(_bearer(authorization) or b"").hexdigest()[:24]


@dataclass(frozen=True)
class Denial:
    """A request the authorization decision refuses: HTTP status, stable code, message, extra response headers."""

    status: int
    code: str
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)


def resolve_dots(path: str) -> str:
    """``path`` with its dot-segments resolved (RFC 3986 section 5.2.4: ``/a/./b`` -> ``/a/b``, ``/a/../b`` ->
    ``/b``, never above the root); runs of ``/`` are kept (``//v1`` is not ``/v1``)."""
    if "." not in path:
        return path
    parts: list[str] = []
    for seg in path.split("/")[1:]:
        if seg == "..":
            if parts:
                parts.pop()
        elif seg != ".":
            parts.append(seg)
    last = path.rsplit("/", 1)[-1]
    out = "/" + "/".join(parts)
    return out + "/" if last in (".", "..") and not out.endswith("/") else out


def normalize_path(raw: str | bytes) -> str:
    """The path a server acting on the request target ``raw`` serves: the query string dropped, percent-decoded
    once (as uvicorn, and so the engines, decode: ``/v1%2Fcompletions`` and ``/%761/completions`` are
    ``/v1/completions``), dot-segments resolved; always absolute."""
    text = raw.decode("latin-1") if isinstance(raw, bytes) else raw
    text = text.split("?", 1)[0]
    if "%" in text:
        text = unquote(text, errors="replace")
    if not text.startswith("/"):
        text = "/" + text
    return resolve_dots(text)


def request_path(scope: Scope) -> str:
    """The normalized path of an ASGI request (from ``raw_path`` when the server gave it, decoded once)."""
    raw = scope.get("raw_path")
    if raw is not None:
        return normalize_path(bytes(raw))
    return resolve_dots(str(scope.get("path", "/")) or "/")  # already decoded by the server


def authorize(
    auth: Auth,
    method: str,
    path: str,
    authorization: Header,
    routes: Mapping[str, frozenset[str]] | None = None,
) -> Denial | None:
    """The authorization decision on a normalized request (``path`` from ``normalize_path``); None = allowed.

    Without ``routes`` (the HTTP app, which serves its own routes): ``/v1/*`` and ``/route`` need a client key,
    the admin views the admin token (see ``Auth``); other paths are the app's to answer. With ``routes`` (a door
    that forwards every request to an engine, the endpoint picker): every request needs a client key, and only
    the listed paths with their methods pass (404 ``not_found`` / 405 ``method_not_allowed`` otherwise).
    """
    if routes is not None:
        if not auth.client_ok(authorization):
            return _unauthorized()
        methods = routes.get(path)
        if methods is None:
            return Denial(404, "not_found", f"no route {path!r} (routed: {', '.join(sorted(routes))})")
        if method not in methods:
            allow = ", ".join(sorted(methods))
            return Denial(405, "method_not_allowed", f"{method} is not allowed on {path}", {"allow": allow})
        return None
    if path in _DATA_ROUTES or path.startswith("/v1/"):
        return None if auth.client_ok(authorization) else _unauthorized()
    if path in _ADMIN_ROUTES:
        status, message = auth.admin_status(authorization)
        if status == 401:
            return Denial(401, "unauthorized", message, {"www-authenticate": "Bearer"})
        if status:
            return Denial(status, "forbidden", message)
    return None


def _unauthorized() -> Denial:
    return Denial(
        401,
        "unauthorized",
        "missing or invalid API key (Authorization: Bearer <key>)",
        {"www-authenticate": "Bearer"},
    )


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


#: a rejected request announcing a larger body than this (bytes; uvicorn's read buffer) gets ``connection: close``
_DRAIN_MAX_BYTES = 64 * 1024


def _large_body(scope: Scope) -> bool:
    """True when the request announces a body over ``_DRAIN_MAX_BYTES`` or of unknown length (chunked).

    A rejected request with a small body keeps its connection (uvicorn reads and drops the rest of the body, so a
    client that sent it at once reads its answer instead of a reset); a large one is closed, not read.
    """
    if _header(scope, b"transfer-encoding") is not None:
        return True
    length = _header(scope, b"content-length")
    return length is not None and (not length.strip().isdigit() or int(length) > _DRAIN_MAX_BYTES)


class Guard:
    """Admission from headers (see the module docstring).

    Args:
        auth: the keys.
        lag: the loop-lag probe (None: never shed).
        max_lag_s: shed new work while ``lag.lag_s()`` is over this, seconds (0: never).
        retry_after_s: ``Retry-After`` of a shed request, seconds.
        telemetry: the router's ``Telemetry`` (requests and rejected counters).
    """

    def __init__(
        self, auth: Auth, lag: LoopLag | None, max_lag_s: float, retry_after_s: int, telemetry: Any
    ) -> None:
        self.auth = auth
        self.lag = lag
        self.max_lag_s = max_lag_s
        self.retry_after_s = retry_after_s
        self.telemetry = telemetry
        self.shed = 0

    async def admit(self, scope: Scope, send: Send) -> bool:
        """Check an HTTP request's headers; False when it was answered here (the app must not run)."""
        if scope.get("method") == "OPTIONS":
            return True  # CORS preflights carry no credentials (the CORS middleware answers them)
        path = request_path(scope)
        denial = authorize(self.auth, str(scope.get("method", "")), path, _header(scope, b"authorization"))
        if denial is not None:
            await self._reject(scope, send, denial.status, denial.message, denial.code, dict(denial.headers))
            return False
        if path in _DATA_ROUTES or path.startswith("/v1/"):
            if (
                path in _SHED_ROUTES
                and self.max_lag_s > 0
                and self.lag is not None
                and scope.get("method") == "POST"
            ):
                lag = self.lag.lag_s()
                if lag > self.max_lag_s:
                    self.shed += 1
                    self.telemetry.rejected.labels("event_loop_lag").inc()
                    await self._reject(
                        scope,
                        send,
                        503,
                        f"router overloaded: its event loop lags {lag:.3f}s "
                        f"(max_event_loop_lag_s {self.max_lag_s:g}s); retry shortly",
                        "event_loop_lag",
                        {"retry-after": str(self.retry_after_s)},
                    )
                    return False
        return True

    async def _reject(
        self, scope: Scope, send: Send, status: int, message: str, code: str, headers: dict[str, str]
    ) -> None:
        if _large_body(scope):
            headers = {**headers, "connection": "close"}  # do not read what was announced
        resp = error_response(status, message, code, headers=headers)
        await send({"type": "http.response.start", "status": status, "headers": resp.raw_headers})
        await send({"type": "http.response.body", "body": resp.body})
        path = scope.get("path", "")
        self.telemetry.requests.labels(
            path if path in _DATA_ROUTES | _ADMIN_ROUTES else "other", str(status)
        ).inc()
