"""The router's front gate: what is decided from a request's headers alone, before its body is read.

``Guard.check`` runs first for every request: the HTTP door calls it ahead of the data-plane fast path and of
FastAPI, the endpoint picker before it picks. It returns the refusal (a ``router.errors.KvrouteError``) and renders
nothing: each door answers it in its own protocol.

* **authorization** (``authorize``, the one decision every front door takes: the HTTP app here, the endpoint
  picker ``router.epp.picker`` on the gateway's request headers), made on the *normalized* request (``request_path``:
  percent-decoded once, as the engines decode, dot-segments resolved): ``/v1/*``, ``/route`` and the engines' other
  endpoints (``router.serve.endpoints``: ``/tokenize``, ``/pooling``, ``/generate``, ...) need one of
  ``api_keys`` when any is configured (401 ``unauthorized``); ``/replicas`` and ``/index/stats`` need
  ``admin_token`` when it is configured (401 without a bearer token, 403 ``forbidden`` with another), else one of
  ``api_keys`` when those are configured. A door that forwards to engines (the picker) passes its route table:
  every request then needs a key, and a path or method outside the table is 404 / 405. Rejected
  before a byte of the body is read (the HTTP door closes the connection when a large body was announced), so an
  unauthenticated client cannot make the router buffer (or even read) bodies. Tokens are compared as bytes
  (constant time), so any header value, ASCII or not, gets a 401, never a 500.
* **overload shedding** (``Shedder``, on ``router.serve.loop_lag``'s probes): new ``/v1/*`` POSTs and ``/route`` get
  ``503 event_loop_lag`` with ``Retry-After`` (counted in ``kvroute_rejected_total{reason="event_loop_lag"}``) only
  while the router's own work overloads it: over the last ``event_loop_lag_sustain_s`` the probes kept finding the
  loop late by more than ``max_event_loop_lag_s`` from its own work (the delay less the time it waited for a CPU),
  the process used the CPU time it could have (not starved by other processes, throttled by a CPU quota or
  stopped), and its request work did not shrink. A request arriving while the loop lags otherwise waits for an
  on-time probe, at most ``event_loop_lag_max_wait_s``, and is admitted. ``/healthz``, ``/readyz``, ``/metrics``
  and the admin views are never shed or held.

``Auth`` also says who may see replica URLs (``is_admin``) and scopes idempotency keys by client (``principal``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import hashlib
import hmac
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any
from urllib.parse import unquote

from router.errors import KvrouteError, forbidden, unauthorized
from router.serve.endpoints import ENGINE_POST_ROUTES, RESPONSE_ROUTES, route_key
from router.serve.loop_lag import LoopLag, Probe

_DATA_ROUTES = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/route", *ENGINE_POST_ROUTES, *RESPONSE_ROUTES}
)
_ADMIN_ROUTES = frozenset({"/replicas", "/index/stats"})
#: data-plane routes that are shed under event-loop lag (they do the work; /v1/models is a cheap read)
_SHED_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/route", *ENGINE_POST_ROUTES})

Header = bytes | str | None

#: what the endpoint picker lets through to engines: normalized path -> methods (anything else: 404 / 405)
PICKER_ROUTES: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "/v1/completions": frozenset({"POST"}),
        "/v1/chat/completions": frozenset({"POST"}),
        "/v1/models": frozenset({"GET"}),
        **{path: frozenset({"POST"}) for path in ENGINE_POST_ROUTES},
        **RESPONSE_ROUTES,
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


def route_label(path: str) -> str:
    """The ``route`` label of ``kvroute_requests_total`` for a request path: the router's own routes by name,
    anything else ``other``."""
    key = route_key(path)
    return key if key in _DATA_ROUTES or key in _ADMIN_ROUTES else "other"


def request_path(scope: Mapping[str, Any]) -> str:
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
    peer_hop: bool = False,
) -> KvrouteError | None:
    """The authorization decision on a normalized request (``path`` from ``normalize_path``); None = allowed.
    ``peer_hop``: a request another region's router forwarded, its peer key verified by the door (no client key).

    Without ``routes`` (the HTTP app, which serves its own routes): ``/v1/*`` and ``/route`` need a client key,
    the admin views the admin token (see ``Auth``); other paths are the app's to answer. With ``routes`` (a door
    that forwards every request to an engine, the endpoint picker): every request needs a client key, and only
    the listed paths with their methods pass (404 ``not_found`` / 405 ``method_not_allowed`` otherwise).
    """
    if routes is not None:
        if not auth.client_ok(authorization):
            return unauthorized()
        methods = routes.get(route_key(path))
        if methods is None:
            return KvrouteError(
                f"no route {path!r} (routed: {', '.join(sorted(routes))})", status=404, code="not_found"
            )
        if method not in methods:
            allow = ", ".join(sorted(methods))
            return KvrouteError(
                f"{method} is not allowed on {path}",
                status=405,
                code="method_not_allowed",
                headers={"allow": allow},
            )
        return None
    if path in _DATA_ROUTES or path.startswith("/v1/") or route_key(path) in _DATA_ROUTES:
        return None if peer_hop or auth.client_ok(authorization) else unauthorized()
    if path in _ADMIN_ROUTES:
        status, message = auth.admin_status(authorization)
        if status == 401:
            return unauthorized(message)
        if status:
            return forbidden(message)
    return None


class Guard:
    """Admission from headers (see the module docstring).

    Args:
        auth: the keys.
        shedder: the overload decision (None: never shed).
    """

    def __init__(self, auth: Auth, shedder: Shedder | None) -> None:
        self.auth = auth
        self.shedder = shedder
        self.shed = 0
        #: HTTP data-plane requests admitted here and not answered yet (``working``); part of the router's work
        self.in_progress = 0

    async def check(
        self, method: str, path: str, authorization: Header, peer_hop: bool = False
    ) -> KvrouteError | None:
        """The refusal of a request from its method, normalized path (``normalize_path``) and ``Authorization``
        header (None: it may go on, maybe after waiting out a lag from outside). Renders nothing: the door does.
        ``peer_hop``: as ``authorize``."""
        if method == "OPTIONS":
            return None  # CORS preflights carry no credentials (the CORS middleware answers them)
        denial = authorize(self.auth, method, path, authorization, peer_hop=peer_hop)
        if denial is not None:
            return denial
        if method == "POST" and path in _SHED_ROUTES:
            return await self._shed_check()
        return None

    async def _shed_check(self) -> KvrouteError | None:
        """The 503 ``event_loop_lag`` refusal when the request is shed here; may wait while the loop lags."""
        shedder = self.shedder
        if shedder is None or await shedder.admit():
            return None
        self.shed += 1
        return KvrouteError(
            f"router overloaded by its own work: its event loop lags {shedder.lag_now_s():.3f}s "
            f"(max_event_loop_lag_s {shedder.max_lag_s:g}s) for over {shedder.sustain_s:g}s "
            "(event_loop_lag_sustain_s); retry shortly",
            status=503,
            code="event_loop_lag",
            retry=True,
            counted_as="event_loop_lag",
        )

    def counts(self, method: str, path: str) -> bool:
        """True for the requests counted in ``in_progress`` (the data-plane POSTs that can be shed)."""
        return method == "POST" and path in _SHED_ROUTES

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Count one request in ``in_progress`` while the block runs."""
        self.in_progress += 1
        try:
            yield
        finally:
            self.in_progress -= 1


#: probes covering the window whose own lag is over ``max_lag_s`` before an overload counts: one stall never sheds
SUSTAINED_MIN_PROBES = 2
#: the router's own work saturates it when, over the window, the process used at least this share of the time it
#: could run (wall time less the loop thread's run-queue wait): its loop never idled (fraction)
OWN_WORK_MIN_BUSY = 0.9


class Verdict(enum.Enum):
    """What the shedding decision says about a new request now."""

    ADMIT = "admit"  # the loop is on time
    WAIT = "wait"  # the loop lags, not from an overload of the router's own work
    SHED = "shed"  # the router's own work overloads it


class Shedder:
    """The overload decision: shed new work only while the router's own work overloads its event loop.

    Fed by every probe of ``lag`` (``on_probe``), it keeps the probes that cover the last ``sustain_s`` (the
    window: the probes in it and the last one before it, the baseline). While the loop lags (the last probe, or the
    next one overdue, later than ``max_lag_s``), a new request is shed when (1) the last probe and at least
    ``SUSTAINED_MIN_PROBES`` of the window's had an *own* lag over ``max_lag_s`` (``router.serve.loop_lag``: the delay
    less the time the loop waited for a CPU, at most the CPU time used), (2) over the window the process used at
    least ``OWN_WORK_MIN_BUSY`` of the time it could run (wall time less the run-queue wait: a process starved by
    others, throttled or stopped idles through part of it), and (3) the request work (``work()``) is not below its
    baseline. Otherwise (one stall, starvation from outside, a backlog that drains) it waits for the next on-time
    probe, at most ``max_wait_s``, and is admitted.

    Args:
        lag: the loop-lag probe.
        max_lag_s: a probe later than this is a lagging one, s (0: never shed, never wait).
        sustain_s: the window, s.
        max_wait_s: longest wait of a request arriving while the loop lags, s.
        work: the router's request work now (requests in progress, queued or waiting; only its trend counts).
    """

    def __init__(
        self, lag: LoopLag, max_lag_s: float, sustain_s: float, max_wait_s: float, work: Callable[[], int]
    ) -> None:
        self.lag = lag
        self.max_lag_s = max_lag_s
        self.sustain_s = sustain_s
        self.max_wait_s = max_wait_s
        self.work = work
        self.waiting = 0  # requests waiting here for the lag to pass
        self.waited_total = 0
        #: the probes covering the window with the request work at each (history[0]: the baseline)
        self._history: collections.deque[tuple[Probe, int]] = collections.deque()
        self._tick: asyncio.Event | None = None  # set (and replaced) at every probe while someone waits
        if max_lag_s > 0:
            lag.listeners.append(self.on_probe)

    @property
    def _last(self) -> Probe | None:
        return self._history[-1][0] if self._history else None

    def on_probe(self, probe: Probe) -> None:
        """Keep the window's probes; wake the waiting requests."""
        history = self._history
        history.append((probe, self.work()))
        while len(history) > 2 and probe.at - history[1][0].at >= self.sustain_s:
            history.popleft()  # history[0] stays the last probe at or before the window's start
        tick, self._tick = self._tick, None
        if tick is not None:
            tick.set()

    def lag_now_s(self) -> float:
        """The loop's lag now: the last probe's delay, or how overdue the next one is (s)."""
        last = self._last.lag if self._last is not None else 0.0
        return max(last, self.lag.overdue_s())

    def verdict(self) -> Verdict:
        """What to do with a new request now."""
        if self.max_lag_s <= 0 or self.lag_now_s() <= self.max_lag_s:
            return Verdict.ADMIT
        return Verdict.SHED if self._own_overload() else Verdict.WAIT

    def _own_overload(self) -> bool:
        """True when the router's own work keeps its loop late and busy and the request work holds (the class)."""
        now = self._last
        if now is None or now.own_lag <= self.max_lag_s:
            return False
        history = self._history
        if sum(1 for probe, _ in history if probe.own_lag > self.max_lag_s) < SUSTAINED_MIN_PROBES:
            return False
        base, base_work = history[0]
        span = now.at - base.at
        if span < self.sustain_s:
            return False  # not a whole window yet
        could_run = span - (now.wait_s - base.wait_s)
        if now.cpu_s - base.cpu_s < OWN_WORK_MIN_BUSY * could_run:
            return (
                False  # the loop idled through part of the time it could run: starved, throttled or stopped
            )
        work = self.work()
        return work > 0 and work >= base_work

    async def admit(self) -> bool:
        """True when a new request may go on (at once, or after the lag passed); False: shed it."""
        self.lag.hurry()  # the lag probe back on its own period if it waited for the idle one
        verdict = self.verdict()
        if verdict is Verdict.WAIT:
            verdict = await self._wait_out()
        return verdict is not Verdict.SHED

    async def _wait_out(self) -> Verdict:
        """Wait for an on-time probe (or an overload verdict), at most ``max_wait_s``; ADMIT after that."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        self.waiting += 1
        self.waited_total += 1
        try:
            verdict = Verdict.WAIT
            while verdict is Verdict.WAIT and (left := deadline - loop.time()) > 0:
                if self._tick is None:
                    self._tick = asyncio.Event()
                try:
                    await asyncio.wait_for(self._tick.wait(), left)
                except TimeoutError:
                    return Verdict.ADMIT
                verdict = self.verdict()
            return Verdict.ADMIT if verdict is Verdict.WAIT else verdict
        finally:
            self.waiting -= 1
