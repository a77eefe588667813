"""A lean HTTP/1.1 client for the router -> engine hop: pooled keep-alive connections on raw asyncio protocols.

The proxy sends one POST per attempt and relays the answer chunk by chunk. A general-purpose client (aiohttp,
httpx) spends most of its per-request CPU on machinery this hop does not need (cookie jars, redirects,
decompression, tracing hooks, per-request timeout objects, stream reader layers). This module does only what
the hop needs, with ``httptools`` (the llhttp parser uvicorn uses) parsing the engine's responses:

* ``EnginePool.post(base_url, path, body, headers)`` writes the request in one ``transport.write`` on an idle
  pooled connection to that engine (or a new one, within ``connect_timeout_s``) and returns an
  ``EngineResponse`` once the status line and headers have arrived;
* ``EngineResponse.read_chunk()`` returns the body as it arrives (chunked transfer decoding done by the parser),
  ``b""`` at the end; reading pauses the socket when more than ``_HIGH_WATER`` bytes wait unread;
* ``release()`` returns a fully read keep-alive connection to the pool, ``close()`` drops it (the engine sees
  the close and aborts the request). Idle connections older than ``keepalive_timeout_s`` are not reused
  (engines close idle connections themselves: uvicorn after 5 s).

Failures raise ``EngineError`` subclasses the proxy maps to retry decisions: ``EngineConnectError`` (cannot
connect; ``EngineTLSError`` when the TLS handshake or certificate check failed), ``EngineConnectTimeout``,
``EngineConnectionLost`` (closed or reset), ``EngineProtocolError`` (not HTTP, or response headers over
``max_header_bytes`` / ``max_headers``), ``EngineResponseTooLarge`` (a body over the caller's byte limit,
``EngineResponse.read_body``). Read timeouts are the caller's (``asyncio.timeout`` around the awaits, or the
``timeout_s`` / ``idle_timeout_s`` arguments of the reads).

``https://`` engines are reached over TLS with certificate and host-name verification (the context comes from
``membership.engine_tls``: ``engine_ca_bundle``, optional client certificate), on the same pooled keep-alive
connections.

Units: seconds, bytes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import httptools

from membership import engine_tls

#: unread body bytes above which the connection stops reading from the socket (bytes)
_HIGH_WATER = 1 << 20


class EngineError(Exception):
    """An engine request failed at the HTTP or connection level."""


class EngineConnectError(EngineError):
    """The connection could not be established (refused, unreachable, DNS)."""


class EngineConnectTimeout(EngineError):
    """The connection was not established within ``connect_timeout_s``."""


class EngineConnectionLost(EngineError):
    """The connection was closed or reset before the response was complete."""


class EngineProtocolError(EngineError):
    """The engine's bytes are not a valid HTTP/1.1 response (or its headers exceed the pool's limits)."""


class EngineTLSError(EngineConnectError):
    """The TLS handshake with an ``https://`` engine failed (certificate not trusted, wrong host name, ...)."""


class EngineResponseTooLarge(EngineError):
    """A response body exceeded the byte limit it was read with."""


#: Connection key: (host, port, TLS)
ConnKey = tuple[str, int, bool]


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine and the response currently being read on it."""

    __slots__ = (
        "key",
        "transport",
        "parser",
        "status",
        "headers",
        "chunks",
        "buffered",
        "complete",
        "error",
        "waiter",
        "header_waiter",
        "closed",
        "idle_since",
        "paused",
        "_delimited",
        "accounted",
        "keep_alive",
        "on_idle_lost",
        "max_header_bytes",
        "max_headers",
        "head_bytes",
        "nheaders",
        "sink",
    )

    def __init__(self, key: ConnKey, max_header_bytes: int = 65536, max_headers: int = 100) -> None:
        self.key = key
        #: limits on the status line + headers of each response (bytes, count)
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.accounted = True  # counted in the pool's open connections until dropped once
        #: set while the connection sits idle in the pool: called when the engine closes it there
        self.on_idle_lost: Callable[[_Conn], None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.error: EngineError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.header_waiter: asyncio.Future[None] | None = None
        self.paused = False
        self._delimited = False
        self.keep_alive = False
        self.head_bytes = 0  # bytes received before the headers were complete
        self.nheaders = 0
        #: takes body pieces from the read callback while set (``EngineResponse.attach``)
        self.sink: Callable[[bytes], bool] | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport; Nagle off (small SSE chunks must not wait for ACKs)."""
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not a TCP socket (tests may hand in others)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        """Feed the parser; a parse error fails the response and the connection."""
        if self.complete or self.header_waiter is None:
            # bytes outside any request (or after the response): the connection cannot be trusted any more
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            return
        heading = not self.status
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(EngineProtocolError("engine answered with a protocol upgrade"))
            return
        except httptools.HttpParserError as exc:
            self._fail(EngineProtocolError(f"invalid HTTP response: {exc}"))
            return
        if heading and self.error is None:
            # bounded header memory: the parser keeps an unfinished header line in memory, so an engine sending
            # endless headers (or one endless header) must be cut off by bytes, not only by count
            if self.nheaders > self.max_headers:
                self._fail(
                    EngineProtocolError(
                        f"engine response has over {self.max_headers} headers (engine_max_headers)"
                    )
                )
            elif not self.status:
                self.head_bytes += len(data)
                if self.head_bytes > self.max_header_bytes:
                    self._fail(
                        EngineProtocolError(
                            f"engine response headers over {self.max_header_bytes} bytes "
                            "(engine_max_header_bytes)"
                        )
                    )

    def eof_received(self) -> bool:
        """The engine closed its side: end a read-until-close body, else the response is lost."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """Mark the connection dead; a response still being read ends with EngineConnectionLost (or completes
        when its body was delimited by the close)."""
        self.closed = True
        idle_lost = self.on_idle_lost
        if idle_lost is not None:
            self.on_idle_lost = None
            idle_lost(self)  # frees its pool slot now, not when the pool next looks at this engine
            return
        if self.complete:
            return
        if self.header_waiter is not None and self.status and not self._delimited and self.error is None:
            self.complete = True  # no Content-Length, not chunked: the body ended with the connection
            self._wake()
            return
        what = f": {exc}" if exc else ""
        self._fail(EngineConnectionLost(f"connection closed by the engine{what}"), close=False)

    # -- httptools callbacks ---------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        """One response header (names lower-cased; repeated names keep the last value)."""
        self.nheaders += 1
        if self.nheaders > self.max_headers:
            return  # data_received fails the response once the parser returns
        n = name.decode("latin-1").lower()
        self.headers[n] = value.decode("latin-1")
        if n == "content-length" or (n == "transfer-encoding" and b"chunked" in value.lower()):
            self._delimited = True

    def on_headers_complete(self) -> None:
        """Status and headers are known: wake ``post`` (unless there were too many headers)."""
        if self.nheaders > self.max_headers:
            return
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # only valid before the message completes
        fut = self.header_waiter
        if fut is not None and not fut.done():
            fut.set_result(None)

    def on_body(self, body: bytes) -> None:
        """A piece of the (de-chunked) body: to the attached sink, else buffered for ``read_chunk``."""
        sink = self.sink
        if sink is not None:
            if not self.chunks and sink(body):
                return
            self.sink = None  # declined: buffered from now on, and the reader is woken
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        """The response is complete."""
        self.complete = True
        self._wake()

    # -- helpers ---------------------------------------------------------------------------------------------
    def _wake(self) -> None:
        fut = self.waiter
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _fail(self, err: EngineError, *, close: bool = True) -> None:
        self.sink = None
        if self.error is None:
            self.error = err
        for fut in (self.header_waiter, self.waiter):
            if fut is not None and not fut.done():
                fut.set_result(None)
        if close and self.transport is not None:
            self.transport.abort()
        self.closed = True

    @property
    def reusable(self) -> bool:
        """A fully read keep-alive response on a live connection."""
        return (
            self.complete
            and self.error is None
            and not self.closed
            and self.transport is not None
            and not self.transport.is_closing()
            and self.keep_alive
            and not self.chunks
        )


class EngineResponse:
    """The answer of one ``EnginePool.post``: status, headers and the body as it arrives.

    Attributes:
        status: HTTP status code.
        headers: response headers, names lower-cased.
    """

    __slots__ = ("_conn", "_pool", "status", "headers", "_done")

    def __init__(self, conn: _Conn, pool: EnginePool) -> None:
        self._conn = conn
        self._pool = pool
        self.status = conn.status
        self.headers = conn.headers
        self._done = False

    async def read_chunk(self, timeout_s: float | None = None) -> bytes:
        """Everything of the body received so far and not yet read (de-chunked; pieces that arrived together
        are returned joined); waits for more when nothing is buffered; ``b""`` when the body is over.

        Args:
            timeout_s: longest wait for data (seconds); None waits without limit. No timer is armed when data
                is already buffered.

        Raises:
            TimeoutError: nothing arrived within ``timeout_s``.
            EngineConnectionLost, EngineProtocolError: the connection failed before the body was complete.
        """
        conn = self._conn
        while True:
            chunks = conn.chunks
            if chunks:
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                conn.buffered = 0
                if conn.paused and conn.transport is not None:
                    conn.paused = False
                    conn.transport.resume_reading()
                return data
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return b""
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            conn.waiter = fut
            timer = None if timeout_s is None else loop.call_later(max(0.0, timeout_s), _expire, fut)
            try:
                await fut
            finally:
                conn.waiter = None
                if timer is not None:
                    timer.cancel()

    def attach(self, sink: Callable[[bytes], bool] | None) -> None:
        """Hand body pieces to ``sink`` in the connection's read callback as they arrive, instead of buffering
        them for ``read_chunk`` (a relay writes them on without a task switch per piece).

        ``sink(piece)`` runs inside the event loop's read callback: it must be quick and must not raise. It
        returns True when it took the piece; False keeps the piece buffered, detaches the sink and wakes a
        waiting ``read_chunk`` (the caller takes over). While a sink is attached, ``read_chunk`` returns only
        buffered pieces, the end of the body (``b""``) or the connection's failure (so its timeout does not
        mean silence: the sink's owner tracks when it last got a piece). A sink is never given a piece while
        older ones are buffered (attach when ``read_chunk`` has emptied the buffer); None detaches.
        """
        self._conn.sink = sink

    async def read_all(self, limit: int | None = None) -> bytes:
        """The rest of the body (at most ``limit`` bytes when given: the read stops there)."""
        parts: list[bytes] = []
        size = 0
        while limit is None or size < limit:
            chunk = await self.read_chunk()
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        data = b"".join(parts)
        return data if limit is None else data[:limit]

    async def read_body(
        self, first: bytes, *, max_bytes: int, idle_timeout_s: float, deadline: float | None = None
    ) -> bytes:
        """The whole body (``first``: what was already read), bounded in size and in silence.

        Args:
            first: body bytes the caller has already read.
            max_bytes: largest body accepted, bytes.
            idle_timeout_s: longest wait for the next piece of the body, seconds.
            deadline: ``time.monotonic()`` by which the body must be complete (None: no deadline).

        Raises:
            EngineResponseTooLarge: the body exceeded ``max_bytes`` (nothing more is read).
            TimeoutError: nothing arrived for ``idle_timeout_s`` (``args[0] == "idle"``) or ``deadline`` passed
                (``args[0] == "deadline"``).
            EngineConnectionLost, EngineProtocolError: the connection failed.
        """
        chunks = [first] if first else []
        size = len(first)
        if size > max_bytes:
            raise EngineResponseTooLarge(f"engine response body over {max_bytes} bytes")
        while True:
            wait = idle_timeout_s
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("deadline")
                wait = min(wait, left)
            try:
                chunk = await self.read_chunk(wait)
            except TimeoutError:
                raise TimeoutError("idle" if wait >= idle_timeout_s else "deadline") from None
            if not chunk:
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            size += len(chunk)
            if size > max_bytes:
                raise EngineResponseTooLarge(f"engine response body over {max_bytes} bytes")
            chunks.append(chunk)

    @property
    def complete(self) -> bool:
        """The whole body has been received (it may still be unread)."""
        return self._conn.complete and self._conn.error is None

    @property
    def at_end(self) -> bool:
        """The whole body has been received and read: the next ``read_chunk`` returns ``b""`` at once."""
        conn = self._conn
        return conn.complete and conn.error is None and not conn.chunks

    def release(self) -> None:
        """Done with the response: a fully read keep-alive connection goes back to the pool, others close."""
        if self._done:
            return
        self._done = True
        self._conn.sink = None
        self._pool._give_back(self._conn)

    def close(self) -> None:
        """Drop the connection now (the engine sees the close and aborts the request)."""
        if self._done:
            return
        self._done = True
        self._conn.sink = None
        self._pool._drop(self._conn)

    def __del__(self) -> None:
        # safety net: a response abandoned without release() / close() must not keep its pool slot forever
        if not self._done:
            with contextlib.suppress(Exception):  # at interpreter shutdown there is nothing left to free
                self.close()


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class EnginePool:
    """Keep-alive connections to engines, per (host, port); POST requests on them.

    Args:
        connect_timeout_s: limit for establishing a new connection (seconds).
        keepalive_timeout_s: idle connections older than this are closed instead of reused (seconds); keep it
            below the engines' own idle timeout (uvicorn: 5 s) so the pool never sends on a connection the
            engine is closing.
        max_connections: open connections at most (in use + idle, all engines); ``post`` waits for a free one.
        max_idle_per_host: idle connections kept per engine.
        headers: sent with every request (e.g. ``authorization``).
        max_header_bytes: largest status line + headers of a response, bytes (over it: EngineProtocolError).
        max_headers: most header lines in a response (over it: EngineProtocolError).
        ssl_context: TLS context for ``https://`` engines (default: ``membership.engine_tls.client_context()``,
            taken when the first ``https://`` engine is contacted).
    """

    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        keepalive_timeout_s: float = 4.0,
        max_connections: int = 1000,
        max_idle_per_host: int = 64,
        headers: Mapping[str, str] | None = None,
        max_header_bytes: int = 65536,
        max_headers: int = 100,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self._ssl = ssl_context
        self.keepalive_timeout_s = keepalive_timeout_s
        self.max_idle_per_host = max_idle_per_host
        self._extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self._idle: dict[ConnKey, list[_Conn]] = {}
        self._slots = asyncio.Semaphore(max_connections) if max_connections > 0 else None
        self._open = 0
        #: base URL -> ((host, port, tls), path prefix, Host header), parsed once per engine
        self._targets: dict[str, tuple[ConnKey, bytes, bytes]] = {}
        self.closed = False

    @property
    def open_connections(self) -> int:
        """Connections currently open (in use + idle)."""
        return self._open

    def _target(self, base_url: str) -> tuple[ConnKey, bytes, bytes]:
        got = self._targets.get(base_url)
        if got is None:
            parts = urlsplit(base_url)
            scheme = parts.scheme.lower()
            if scheme not in ("http", "https") or not parts.hostname:
                raise EngineConnectError(
                    f"unsupported engine URL {base_url!r} (http(s)://host:port expected)"
                )
            tls = scheme == "https"
            port = parts.port or (443 if tls else 80)
            prefix = parts.path.rstrip("/").encode()
            host_header = parts.netloc.encode("latin-1")
            got = ((parts.hostname, port, tls), prefix, host_header)
            self._targets[base_url] = got
        return got

    async def post(self, base_url: str, path: str, body: bytes, headers: Mapping[str, str]) -> EngineResponse:
        """POST ``body`` to ``base_url + path``; return when the status line and headers arrived.

        Raises:
            EngineConnectError, EngineConnectTimeout, EngineConnectionLost, EngineProtocolError.
        """
        return await self._request(b"POST", base_url, path, body, headers)

    async def request(
        self, method: str, base_url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> EngineResponse:
        """``method`` (``POST``, ``GET``, ``DELETE``, ...) ``base_url + path`` (a query string included) with
        ``body``; like ``post`` otherwise."""
        return await self._request(method.encode("ascii"), base_url, path, body, headers)

    async def get(self, base_url: str, path: str, headers: Mapping[str, str]) -> EngineResponse:
        """GET ``base_url + path`` (e.g. an engine's ``/metrics``); like ``post`` otherwise."""
        return await self._request(b"GET", base_url, path, b"", headers)

    async def _request(
        self, method: bytes, base_url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> EngineResponse:
        if self.closed:
            raise EngineConnectError("the engine connection pool is closed")
        key, prefix, host_header = self._target(base_url)
        conn = self._idle_conn(key)
        if conn is None:
            conn = await self._connect(key)
        loop = asyncio.get_running_loop()
        conn._reset()
        fut = loop.create_future()
        conn.header_waiter = fut
        fields = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())
        assert conn.transport is not None
        head = b"%b %b%b HTTP/1.1\r\nhost: %b\r\n%b%bcontent-length: %d\r\n\r\n" % (
            method,
            prefix,
            path.encode(),
            host_header,
            self._extra,
            fields,
            len(body),
        )
        # the body (a long prompt's: ~100 KB) is not copied onto the head: one vectored write on uvloop
        conn.transport.writelines((head, body))
        try:
            await fut
        except BaseException:
            self._drop(conn)
            raise
        if conn.error is not None:
            self._drop(conn)
            raise conn.error
        return EngineResponse(conn, self)

    def _idle_conn(self, key: ConnKey) -> _Conn | None:
        stack = self._idle.get(key)
        if not stack:
            return None
        now = time.monotonic()
        while stack:
            conn = stack.pop()  # most recently used first: its peer has not timed it out
            conn.on_idle_lost = None
            if (
                not conn.closed
                and conn.transport is not None
                and not conn.transport.is_closing()
                and now - conn.idle_since < self.keepalive_timeout_s
            ):
                return conn
            self._drop(conn)
        return None

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = engine_tls.client_context()
        return self._ssl

    async def _connect(self, key: ConnKey) -> _Conn:
        if self._slots is not None:
            await self._slots.acquire()
        loop = asyncio.get_running_loop()
        host, port, tls = key
        hb, nh = self.max_header_bytes, self.max_headers
        try:
            ctx = self._tls_context() if tls else None
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(key, hb, nh), host, port, ssl=ctx, server_hostname=host if tls else None
                )
        except TimeoutError:
            self._release_slot()
            raise EngineConnectTimeout(
                f"connect to {host}:{port} timed out after {self.connect_timeout_s:g}s"
            ) from None
        except (ssl.SSLError, ssl.CertificateError) as exc:
            self._release_slot()
            if isinstance(exc, ssl.SSLCertVerificationError):
                # the OpenSSL reason (CERTIFICATE_VERIFY_FAILED) and the detail, as httpx words it
                reason = f"certificate verify failed ({exc.reason}): {exc.verify_message or exc.reason}"
            else:
                reason = str(getattr(exc, "reason", None) or exc)
            raise EngineTLSError(
                f"TLS handshake with {host}:{port} failed: {reason} (is the engine's CA in engine_ca_bundle?)"
            ) from None
        except OSError as exc:
            self._release_slot()
            raise EngineConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        except BaseException:
            self._release_slot()
            raise
        self._open += 1
        return conn

    def _release_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    def _drop(self, conn: _Conn) -> None:
        """Close ``conn`` (abort when its response is unfinished) and free its slot, once."""
        if conn.transport is not None and not conn.transport.is_closing():
            if conn.complete:
                conn.transport.close()
            else:
                conn.transport.abort()
        conn.closed = True
        if conn.accounted:
            conn.accounted = False
            self._open -= 1
            self._release_slot()

    def _give_back(self, conn: _Conn) -> None:
        if self.closed or not conn.reusable:
            self._drop(conn)
            return
        stack = self._idle.setdefault(conn.key, [])
        if len(stack) >= self.max_idle_per_host:
            self._drop(conn)
            return
        conn.header_waiter = None
        conn.idle_since = time.monotonic()
        conn.on_idle_lost = self._idle_lost
        stack.append(conn)

    def _idle_lost(self, conn: _Conn) -> None:
        """An idle pooled connection was closed by the engine (keep-alive expiry, restart, pod gone)."""
        stack = self._idle.get(conn.key)
        if stack is not None and conn in stack:
            stack.remove(conn)
            if not stack:
                del self._idle[conn.key]
        self._drop(conn)

    async def aclose(self) -> None:
        """Close every idle connection; later ``post`` calls fail."""
        self.closed = True
        idle = [conn for stack in self._idle.values() for conn in stack]
        self._idle.clear()
        for conn in idle:
            conn.on_idle_lost = None
            self._drop(conn)
