"""Client abuse against a running router, shared by the abuse tests (tests/integration/test_abuse_http.py) and the
soak's ``--abuse`` mode (``loadtest.soak``): raw-socket HTTP/1.1 helpers, huge-body builders, a /healthz latency
poller, and :class:`AbuseClients`, bounded abuse clients running in threads next to a load.

Every abuse request is expected to end in a 4xx (401, 408, 413, 422, 431, 400) with a JSON reason, or in the
router closing the connection (a slow head cut by ``client_header_timeout_s``): never a 5xx, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

#: statuses an abuse request may get by design ("closed": the router closed the connection without an answer)
ABUSE_OK_STATUSES = frozenset({"400", "401", "408", "413", "422", "431", "closed"})


# -- raw HTTP/1.1 over a socket -------------------------------------------------------------------------------------


def request_head(
    path: str, *extra: str, length: int | None = None, auth: str | None = None, method: str = "POST"
) -> bytes:
    """A request head (latin-1; ``auth``: the bearer token, None: no authorization header)."""
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json"]
    if auth is not None:
        lines.append(f"authorization: Bearer {auth}")
    if length is not None:
        lines.append(f"content-length: {length}")
    return ("\r\n".join([*lines, *extra]) + "\r\n\r\n").encode("latin-1")


def read_until_closed(s: socket.socket, deadline_s: float = 10.0) -> tuple[bytes, bool]:
    """Everything the server sends until it closes the connection; (bytes, closed) within ``deadline_s`` (s)."""
    s.settimeout(deadline_s)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out, True
            out += chunk
    except TimeoutError:
        return out, False
    except ConnectionResetError:
        return out, True


def response_status(raw: bytes) -> int:
    """The status code of a raw HTTP/1.1 response (0: none)."""
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0


def response_json(raw: bytes) -> dict[str, object]:
    """The JSON body of a raw HTTP/1.1 response (no chunked encoding)."""
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])  # type: ignore[no-any-return]


# -- huge bodies ---------------------------------------------------------------------------------------------------


def huge_chat_body(model: str, messages: int = 620_000) -> bytes:
    """~620k tiny chat messages in < 16 MiB (over ``max_chat_messages``: 413 too_many_messages)."""
    return orjson.dumps({"model": model, "messages": [{"role": "u", "content": "x"}] * messages})


def huge_text_body(model: str, repeats: int = 5 * 1024 * 1024) -> bytes:
    """A ~16 MiB text prompt, far more characters than a 131072-token context allows (400 context_length_exceeded)."""
    return orjson.dumps({"model": model, "prompt": "ab " * repeats})


def huge_ids_body(model: str, ids: int = 1_000_000) -> bytes:
    """1M token ids (400 context_length_exceeded for a context under 1M tokens)."""
    return orjson.dumps({"model": model, "prompt": [7] * ids})


# -- /healthz poller -----------------------------------------------------------------------------------------------


class HealthzPoller:
    """Polls ``url/healthz`` back to back on one connection in a thread; ``polls``: (start, end, error) of every
    poll (monotonic s; error "" when it answered 200). A poll that fails ends at start + ``timeout_s``."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.polls: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="healthz-poller")

    def start(self) -> HealthzPoller:
        """Start polling."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (waits for the poll in progress)."""
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 3)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    status = c.get(self.url + "/healthz").status_code
                    err = "" if status == 200 else f"status {status}"
                except httpx.HTTPError as exc:
                    err = repr(exc)
                self.polls.append((t0, t0 + self.timeout_s if err else time.monotonic(), err))
                self._stop.wait(0.01)  # ~100 polls/s at most: measures stalls, does not load the router

    def max_latency_s(self) -> float | None:
        """The longest poll (s; a failed poll counts as ``timeout_s``), None before the first poll."""
        return max((end - start for start, end, _ in self.polls), default=None)

    def slowest(self, n: int = 3) -> list[tuple[float, float]]:
        """The ``n`` longest polls as (start s after the first poll, latency s), longest first."""
        if not self.polls:
            return []
        first = self.polls[0][0]
        top = sorted(self.polls, key=lambda p: p[0] - p[1])[:n]
        return [(round(start - first, 2), round(end - start, 4)) for start, end, _ in top]

    def failures(self) -> list[str]:
        """The errors of the polls that failed."""
        return [err for _, _, err in self.polls if err]


# -- bounded abuse clients next to a load (the soak's --abuse) -----------------------------------------------------


@dataclass
class AbuseOptions:
    """What :class:`AbuseClients` sends. Counts are per kind for the whole run (bounded); times in seconds."""

    url: str
    model: str
    api_key: str | None = None
    #: a key that may name tenants (the router's tenant_header_keys), for requests that carry a tenant header
    edge_key: str | None = None
    huge_count: int = 6
    slow_sockets: int = 3
    slow_rounds: int = 2
    slow_byte_every_s: float = 0.2
    bad_auth_count: int = 12
    bad_input_count: int = 12
    pause_s: float = 0.5
    #: a slow client gives up this long after the router should have cut it (its header/body timeouts + margin)
    cut_within_s: float = 10.0


@dataclass
class _Tally:
    statuses: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def add(self, status: int | str) -> None:
        key = str(status)
        self.statuses[key] = self.statuses.get(key, 0) + 1


class AbuseClients:
    """Abuse clients in threads against ``opts.url``: huge bodies, slowloris heads and slow bodies, bad
    authentication (only when ``opts.api_key``), bad input (booleans as token ids, malformed JSON, a body that is
    not an object), and a /healthz poller. Each kind sends a bounded number of requests and stops early on
    :meth:`stop`. :meth:`result` gives counts and statuses per kind."""

    def __init__(self, opts: AbuseOptions) -> None:
        self.o = opts
        self.tallies: dict[str, _Tally] = {}
        self.healthz = HealthzPoller(opts.url)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._huge = [
            ("/v1/chat/completions", huge_chat_body(opts.model)),
            ("/v1/completions", huge_text_body(opts.model)),
            ("/v1/completions", huge_ids_body(opts.model)),
        ]
        self._auth = {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}

    # -- lifecycle -------------------------------------------------------------------------------------------
    def kinds(self) -> list[tuple[str, Callable[[], None]]]:
        """The clients to run: (thread name, the client); the kind is the name up to its first ``-``."""
        kinds: list[tuple[str, Callable[[], None]]] = [
            ("huge_body", self._huge_bodies),
            ("bad_input", self._bad_input),
        ]
        kinds += [(f"slowloris-{i}", self._slowloris) for i in range(self.o.slow_sockets)]
        if self.o.api_key:
            kinds.append(("bad_auth", self._bad_auth))
        return kinds

    def designed(self, kind: str) -> frozenset[str]:
        """The answers ``kind`` may get by design (others count as ``unexpected``)."""
        return ABUSE_OK_STATUSES

    def start(self) -> AbuseClients:
        """Start the poller and every abuse client."""
        self.healthz.start()
        for name, fn in self.kinds():
            th = threading.Thread(target=self._guarded, args=(name, fn), daemon=True, name=f"abuse-{name}")
            th.start()
            self._threads.append(th)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask every client to stop after its current request; wait for them (s) and stop the poller."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for th in self._threads:
            th.join(timeout=max(0.1, deadline - time.monotonic()))
        self.healthz.stop()

    def result(self) -> dict[str, Any]:
        """``{kind: {"count", "statuses", "errors"}}`` plus ``unexpected`` (statuses outside what the kind may get
        by design: :meth:`designed`), ``server_errors`` (5xx answers), ``answered_500``, ``healthz_max_s``, ``healthz_polls``,
        ``healthz_slowest`` and ``healthz_failures``."""
        out: dict[str, Any] = {}
        unexpected, fives, five_hundreds = 0, 0, 0
        with self._lock:
            for kind, t in sorted(self.tallies.items()):
                out[kind] = {
                    "count": sum(t.statuses.values()),
                    "statuses": dict(sorted(t.statuses.items())),
                    "errors": t.errors[:5],
                }
                ok = self.designed(kind)
                unexpected += sum(n for s, n in t.statuses.items() if s not in ok)
                fives += sum(n for s, n in t.statuses.items() if s.isdigit() and int(s) >= 500)
                five_hundreds += t.statuses.get("500", 0)
        lat = self.healthz.max_latency_s()
        out.update(
            {
                "unexpected": unexpected,
                "server_errors": fives,
                "answered_500": five_hundreds,
                "healthz_max_s": None if lat is None else round(lat, 4),
                "healthz_polls": len(self.healthz.polls),
                "healthz_slowest": self.healthz.slowest(),
                "healthz_failures": len(self.healthz.failures()),
            }
        )
        return out

    # -- helpers ---------------------------------------------------------------------------------------------
    def _record(self, kind: str, status: int | str, error: str = "") -> None:
        with self._lock:
            t = self.tallies.setdefault(kind, _Tally())
            t.add(status)
            if error:
                t.errors.append(error[:200])

    def _guarded(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a client that crashed is a result, recorded
            self._record(name.split("-")[0], "client_crash", f"{type(exc).__name__}: {exc}")

    def _post(self, c: httpx.Client, kind: str, path: str, body: bytes, headers: dict[str, str]) -> None:
        try:
            r = c.post(
                self.o.url + path, content=body, headers={"content-type": "application/json", **headers}
            )
            self._record(kind, r.status_code, "" if r.status_code < 500 else r.text[:200])
        except httpx.HTTPError as exc:
            self._record(kind, "error", f"{type(exc).__name__}: {exc}")

    def _connect(self) -> socket.socket:
        host, port = self.o.url.removeprefix("http://").rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=10)
        s.settimeout(10)
        return s

    # -- the clients -----------------------------------------------------------------------------------------
    def _huge_bodies(self) -> None:
        """(a) huge bodies, repeatedly: 413 / 400 from cheap checks."""
        with httpx.Client(timeout=60) as c:
            for i in range(self.o.huge_count):
                if self._stop.is_set():
                    return
                path, body = self._huge[i % len(self._huge)]
                self._post(c, "huge_body", path, body, self._auth)
                self._stop.wait(self.o.pause_s)

    def _slowloris(self) -> None:
        """(b) a head dribbled a byte at a time (cut: closed), then a body that stops half-way (408)."""
        for _ in range(self.o.slow_rounds):
            if self._stop.is_set():
                return
            self._slow_head()
            self._slow_body()

    def _slow_head(self) -> None:
        s = self._connect()
        try:
            t0 = time.monotonic()
            for b in request_head("/v1/completions", length=10, auth=self.o.api_key):
                try:
                    s.send(bytes([b]))
                except (BrokenPipeError, ConnectionResetError):
                    self._record("slow_head", "closed")
                    return
                if time.monotonic() - t0 > self.o.cut_within_s:
                    self._record("slow_head", "not_cut", "the router did not cut a slow head in time")
                    return
                threading.Event().wait(self.o.slow_byte_every_s)  # the client's send rate
            raw, closed = read_until_closed(s, 3)  # the head got through: whatever the router answers
            self._record("slow_head", response_status(raw) or ("closed" if closed else "no_answer"))
        finally:
            s.close()

    def _slow_body(self) -> None:
        s = self._connect()
        try:
            s.sendall(
                request_head("/v1/completions", length=1000, auth=self.o.api_key) + b'{"model": "m", "p'
            )
            raw, closed = read_until_closed(s, self.o.cut_within_s)
            status = response_status(raw)
            self._record("slow_body", status or ("closed" if closed else "not_cut"))
        finally:
            s.close()

    def _bad_auth(self) -> None:
        """(c) no key announcing 16 MiB (401 from the head, the body never sent), a wrong key, a non-ASCII key."""
        with httpx.Client(timeout=30) as c:
            for i in range(self.o.bad_auth_count):
                if self._stop.is_set():
                    return
                which = i % 3
                if which == 0:
                    s = self._connect()
                    try:
                        s.sendall(request_head("/v1/completions", length=16 * 1024 * 1024, auth=None))
                        raw, closed = read_until_closed(s, 10)
                        self._record(
                            "bad_auth", response_status(raw) or ("closed" if closed else "no_answer")
                        )
                    finally:
                        s.close()
                elif which == 1:
                    self._post(
                        c,
                        "bad_auth",
                        "/v1/completions",
                        orjson.dumps({"model": self.o.model, "prompt": "x"}),
                        {"authorization": "Bearer wrong-key"},
                    )
                else:
                    try:
                        r = c.post(
                            self.o.url + "/v1/completions",
                            content=b'{"model": "m", "prompt": "x"}',
                            headers={b"authorization": "Bearer cl\u00e9-\u00fcn\u00efcode".encode()},
                        )
                        self._record("bad_auth", r.status_code)
                    except httpx.HTTPError as exc:
                        self._record("bad_auth", "error", f"{type(exc).__name__}: {exc}")
                self._stop.wait(self.o.pause_s)

    def _bad_input(self) -> None:
        """(c) booleans / fractions as token ids, malformed JSON, a body that is not an object."""
        m = self.o.model
        bodies = [
            ("/route", orjson.dumps({"model": m, "token_ids": [1, True]})),
            ("/v1/completions", orjson.dumps({"model": m, "prompt": [3, False]})),
            ("/route", orjson.dumps({"model": m, "token_ids": [0.5]})),
            ("/v1/completions", b'{"model": "' + m.encode() + b'", "prompt": [1, 2,'),
            ("/v1/chat/completions", b"[1, 2, 3]"),
        ]
        with httpx.Client(timeout=30) as c:
            for i in range(self.o.bad_input_count):
                if self._stop.is_set():
                    return
                path, body = bodies[i % len(bodies)]
                self._post(c, "bad_input", path, body, self._auth)
                self._stop.wait(self.o.pause_s)


# -- a flood of the router's own traffic (overload shedding) --------------------------------------------------------


@dataclass
class FloodResult:
    """What a :class:`Flood` got: ``statuses`` (status -> count; ``error``: connection failed or cut without an
    answer) and ``codes`` (error code of the JSON answers -> count)."""

    statuses: dict[str, int] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    retry_after: set[str] = field(default_factory=set)

    def add(self, status: int | str, code: str | None = None, retry_after: str | None = None) -> None:
        """Count one answer."""
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
        if code:
            self.codes[code] = self.codes.get(code, 0) + 1
        if retry_after is not None:
            self.retry_after.add(retry_after)


class Flood:
    """``connections`` closed-loop clients sending one prepared request again and again over keep-alive
    connections (raw HTTP/1.1 on an asyncio loop in a thread: cheap for the client, so the router's CPU is what
    runs out). Bounded: stops on :meth:`stop` or after ``max_s`` seconds."""

    def __init__(
        self,
        url: str,
        path: str,
        body: bytes,
        connections: int,
        max_s: float = 60.0,
        headers: tuple[str, ...] = (),
    ) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self._addr = (host, int(port))
        self._request = request_head(path, *headers, length=len(body)) + body
        self._connections = connections
        self._max_s = max_s
        self.result = FloodResult()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="flood")

    def start(self) -> Flood:
        """Start the clients."""
        self._thread.start()
        return self

    def stop(self) -> FloodResult:
        """Stop after the requests in progress (at most ~30 s) and return the counts."""
        self._stop.set()
        self._thread.join(timeout=40)
        return self.result

    def _run(self) -> None:
        async def main() -> None:
            deadline = time.monotonic() + self._max_s
            await asyncio.gather(*(self._client(deadline) for _ in range(self._connections)))

        asyncio.run(main())

    async def _client(self, deadline: float) -> None:
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                if conn is None:
                    conn = await asyncio.wait_for(asyncio.open_connection(*self._addr), 10)
                reader, writer = conn
                writer.write(self._request)
                keep = await asyncio.wait_for(self._answer(reader), 30)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
                self.result.add("error")
                keep = False
            if not keep and conn is not None:
                conn[1].close()
                conn = None
        if conn is not None:
            conn[1].close()

    async def _answer(self, reader: asyncio.StreamReader) -> bool:
        """Read one answer (content-length bodies only); True when the connection may be reused."""
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await reader.readexactly(int(fields.get("content-length", "0")))
        code = None
        if status >= 400:
            try:
                code = str(orjson.loads(body)["error"]["code"])
            except (orjson.JSONDecodeError, KeyError, TypeError):
                code = "not_json"
        self.result.add(status, code, fields.get("retry-after"))
        return fields.get("connection", "").lower() != "close"
