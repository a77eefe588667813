"""router/engine/client.py against real loopback servers speaking raw HTTP/1.1 (every framing the engines use)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from router.engine.client import (
    EngineConnectError,
    EngineConnectionLost,
    EngineConnectTimeout,
    EnginePool,
    EngineProtocolError,
    EngineResponseTooLarge,
    EngineTLSError,
)
from tests.helpers import free_port


class RawServer:
    """A loopback HTTP server whose answer per request is given as raw bytes by ``answer(request_bytes)``.

    ``answer`` returns the bytes to write and whether to close the connection afterwards. Counts connections
    and requests.
    """

    def __init__(
        self, answer: Callable[[bytes], tuple[bytes, bool]], tls: ssl.SSLContext | None = None
    ) -> None:
        self.answer = answer
        self.tls = tls
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):  # peer gone
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":", 1)[1])
                    body = await reader.readexactly(length) if length else b""
                    self.requests.append(head + body)
                    data, close = self.answer(head + body)
                    writer.write(data)
                    await writer.drain()
                    if close:
                        break
        finally:
            writer.close()

    async def __aenter__(self) -> RawServer:
        self.port = free_port()
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, ssl=self.tls)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"{'https://localhost' if self.tls else 'http://127.0.0.1'}:{self.port}"


def chunked(*parts: bytes, status: int = 200, ctype: bytes = b"text/event-stream") -> bytes:
    head = b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % (status, ctype)
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def sized(body: bytes, status: int = 200, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status,
        len(body),
        extra,
        body,
    )


@pytest.fixture
async def pool() -> AsyncIterator[EnginePool]:
    p = EnginePool(connect_timeout_s=2.0, keepalive_timeout_s=4.0)
    yield p
    await p.aclose()


async def test_chunked_stream_is_decoded_and_the_connection_reused(pool: EnginePool) -> None:
    async with RawServer(lambda req: (chunked(b"data: 1\n\n", b"data: [DONE]\n\n"), False)) as srv:
        for i in range(3):
            r = await pool.post(
                srv.url, "/v1/completions", b'{"a": %d}' % i, {"content-type": "application/json"}
            )
            assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
            assert await r.read_all() == b"data: 1\n\ndata: [DONE]\n\n"
            assert r.complete
            r.release()
        assert srv.connections == 1  # keep-alive: one connection for all three
        assert pool.open_connections == 1
        req = srv.requests[2]
        assert req.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"content-length: 8\r\n" in req and req.endswith(b'{"a": 2}')
        assert b"host: 127.0.0.1:" in req


async def test_long_bodies_reach_the_engine_whole_after_their_head(pool: EnginePool) -> None:
    """A long prompt's body is written after its head without being joined to it: the
    engine reads the same request, and the connection serves the next one."""
    async with RawServer(lambda req: (sized(b"{}"), False)) as srv:
        bodies = [b'{"prompt": "%s"}' % (b"w%d " % i * n) for i, n in enumerate((10, 40_000, 5, 300_000))]
        for body in bodies:
            r = await pool.post(srv.url, "/v1/completions", body, {"x-request-id": "r"})
            assert r.status == 200 and await r.read_all() == b"{}"
            r.release()
        assert srv.connections == 1
        for body, req in zip(bodies, srv.requests, strict=True):
            head = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n" % srv.port
            assert req.startswith(head) and b"x-request-id: r\r\n" in req
            assert req.endswith(b"content-length: %d\r\n\r\n" % len(body) + body)


async def test_content_length_body_and_default_headers() -> None:
    pool = EnginePool(headers={"authorization": "Bearer k"})
    try:
        async with RawServer(lambda req: (sized(b'{"ok": true}'), False)) as srv:
            r = await pool.post(srv.url, "/x", b"{}", {"x-request-id": "r1"})
            assert (r.status, await r.read_chunk(), await r.read_chunk()) == (200, b'{"ok": true}', b"")
            r.release()
            assert (
                b"authorization: Bearer k\r\n" in srv.requests[0]
                and b"x-request-id: r1\r\n" in srv.requests[0]
            )
    finally:
        await pool.aclose()


async def test_body_delimited_by_close_and_connection_close_are_not_reused(pool: EnginePool) -> None:
    async with RawServer(
        lambda req: (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil close", True)
    ) as srv:
        for _ in range(2):
            r = await pool.post(srv.url, "/", b"", {})
            assert await r.read_all() == b"until close"
            r.release()
        assert srv.connections == 2
    async with RawServer(lambda req: (sized(b"x", extra=b"connection: close\r\n"), True)) as srv:
        for _ in range(2):
            r = await pool.post(srv.url, "/", b"", {})
            assert await r.read_all() == b"x"
            r.release()
        assert srv.connections == 2
    assert pool.open_connections == 0


async def test_connect_errors(pool: EnginePool) -> None:
    with pytest.raises(EngineConnectError):
        await pool.post(f"http://127.0.0.1:{free_port()}", "/", b"", {})
    with pytest.raises(EngineConnectError):
        await pool.post("https://127.0.0.1:1", "/", b"", {})
    assert pool.open_connections == 0


async def test_connect_timeout() -> None:
    # a listener that never accepts, its accept queue filled: further handshakes get no answer
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(0)
    fillers = []
    port = lsn.getsockname()[1]
    slow = EnginePool(connect_timeout_s=0.3)
    try:
        for _ in range(8):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        with pytest.raises(EngineConnectTimeout, match="timed out after 0.3s"):
            await slow.post(f"http://127.0.0.1:{port}", "/", b"", {})
        assert slow.open_connections == 0
    finally:
        await slow.aclose()
        for s in fillers:
            s.close()
        lsn.close()


async def test_connection_dropped_before_headers_and_mid_body(pool: EnginePool) -> None:
    async with RawServer(lambda req: (b"", True)) as srv:
        with pytest.raises(EngineConnectionLost):
            await pool.post(srv.url, "/", b"{}", {})
    partial = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"
    async with RawServer(lambda req: (partial, True)) as srv:
        r = await pool.post(srv.url, "/", b"{}", {})
        assert await r.read_chunk() == b"hello"
        with pytest.raises(EngineConnectionLost):
            await r.read_chunk()
        r.close()
    assert pool.open_connections == 0


async def test_garbage_is_a_protocol_error(pool: EnginePool) -> None:
    async with RawServer(lambda req: (b"SSH-2.0-OpenSSH\r\n\r\n", False)) as srv:
        with pytest.raises(EngineProtocolError):
            await pool.post(srv.url, "/", b"{}", {})
    assert pool.open_connections == 0


async def test_idle_connection_closed_by_the_engine_is_not_reused(pool: EnginePool) -> None:
    async with RawServer(lambda req: (sized(b"1"), False)) as srv:
        r = await pool.post(srv.url, "/", b"", {})
        assert await r.read_all() == b"1"
        r.release()
        for w in srv.writers:  # the engine closes its idle keep-alive connection
            w.close()
        # the pool notices at once: the connection leaves the pool and frees its slot (pods that went away must
        # not keep slots forever)
        await asyncio.wait_for(_until(lambda: pool.open_connections == 0 and not pool._idle), 5)
        r = await pool.post(srv.url, "/", b"", {})
        assert await r.read_all() == b"1"
        r.release()
        assert srv.connections == 2


async def test_abandoned_response_frees_its_slot(pool: EnginePool) -> None:
    async with RawServer(lambda req: (chunked(b"a", b"b"), False)) as srv:
        r = await pool.post(srv.url, "/", b"", {})
        assert pool.open_connections == 1
        del r  # neither released nor closed (a bug elsewhere): the slot must not leak
        gc.collect()
        assert pool.open_connections == 0


async def test_keepalive_timeout_drops_old_idle_connections() -> None:
    pool = EnginePool(keepalive_timeout_s=0.0)
    try:
        async with RawServer(lambda req: (sized(b"1"), False)) as srv:
            for _ in range(2):
                r = await pool.post(srv.url, "/", b"", {})
                await r.read_all()
                r.release()
            assert srv.connections == 2
    finally:
        await pool.aclose()


async def test_unread_response_is_not_reused_and_large_bodies_flow(pool: EnginePool) -> None:
    big = [b"x" * 65536 for _ in range(40)]  # 2.5 MiB: reading pauses above the high-water mark and resumes
    async with RawServer(lambda req: (chunked(*big, ctype=b"application/octet-stream"), False)) as srv:
        r = await pool.post(srv.url, "/", b"", {})
        first = await r.read_chunk()
        r.close()  # abandoned mid-body: dropped, not pooled
        assert first and pool.open_connections == 0
        r = await pool.post(srv.url, "/", b"", {})
        await asyncio.sleep(0)
        data = await r.read_all()
        assert len(data) == 40 * 65536
        r.release()
        assert srv.connections == 2 and pool.open_connections == 1


async def test_max_connections_waits_for_a_free_slot() -> None:
    pool = EnginePool(max_connections=1)
    try:
        async with RawServer(lambda req: (sized(b"1"), False)) as srv:
            r1 = await pool.post(srv.url, "/", b"", {})
            second = asyncio.ensure_future(pool.post(srv.url, "/", b"", {}))
            await asyncio.sleep(0.05)
            assert not second.done()  # the only slot is in use
            await r1.read_all()
            r1.close()  # frees the slot
            r2 = await asyncio.wait_for(second, 5)
            assert await r2.read_all() == b"1"
            r2.release()
    finally:
        await pool.aclose()


async def _until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.01)


async def test_at_end_only_once_the_whole_body_was_received_and_read(pool: EnginePool) -> None:
    """``at_end`` (the relay ends the client's response with the last chunk when it is set) must never be set
    while the engine may still send more, nor while received data is unread."""
    more = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        whole = chunked(b"data: 1\n\n", b"data: [DONE]\n\n")
        cut = whole.index(b"data: [DONE]") - 4  # the head and the first chunk only
        writer.write(whole[:cut])
        await writer.drain()
        await more.wait()
        writer.write(whole[cut:])
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the client closes
        writer.close()

    port = free_port()
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    try:
        r = await pool.post(f"http://127.0.0.1:{port}", "/x", b"{}", {})
        assert await r.read_chunk(5.0) == b"data: 1\n\n"
        assert not r.at_end  # the engine has not finished
        more.set()
        deadline = asyncio.get_running_loop().time() + 5.0
        while not r.complete:  # the rest arrives, unread
            assert asyncio.get_running_loop().time() < deadline, "the rest of the body never arrived"
            await asyncio.sleep(0.01)
        assert not r.at_end  # received but not read yet
        assert await r.read_chunk(5.0) == b"data: [DONE]\n\n"
        assert r.at_end
        assert await r.read_chunk(5.0) == b""
        r.release()
    finally:
        for w in writers:  # the handler waits for a close the pooled connection never sends
            w.close()
        server.close()
        await server.wait_closed()


# -- limits on what engines send back (issue 24, item 7) ---------------------------------------------------------


async def test_response_headers_over_the_byte_limit_fail_the_response() -> None:
    pool = EnginePool(max_header_bytes=4096)
    endless = b"HTTP/1.1 200 OK\r\nx-big: " + b"h" * (1 << 20)  # one 1 MiB header line, never finished
    try:
        async with RawServer(lambda req: (endless, False)) as srv:
            with pytest.raises(EngineProtocolError, match="engine_max_header_bytes"):
                await pool.post(srv.url, "/", b"{}", {})
            assert pool.open_connections == 0  # the connection was dropped
            # within the limit: fine
            ok = sized(b"{}", extra=b"x-small: " + b"s" * 1000 + b"\r\n")
            srv.answer = lambda req: (ok, False)
            r = await pool.post(srv.url, "/", b"{}", {})
            assert r.status == 200 and await r.read_all() == b"{}"
            r.release()
    finally:
        await pool.aclose()


async def test_too_many_response_headers_fail_the_response() -> None:
    pool = EnginePool(max_headers=50)
    many = sized(b"{}", extra=b"".join(b"x-h%d: v\r\n" % i for i in range(60)))
    try:
        async with RawServer(lambda req: (many, False)) as srv:
            with pytest.raises(EngineProtocolError, match="engine_max_headers"):
                await pool.post(srv.url, "/", b"{}", {})
    finally:
        await pool.aclose()


async def test_read_body_stops_at_the_byte_limit_and_on_silence(pool: EnginePool) -> None:
    big = b"x" * (300 * 1024)
    async with RawServer(lambda req: (sized(big), False)) as srv:
        r = await pool.post(srv.url, "/", b"{}", {})
        with pytest.raises(EngineResponseTooLarge):
            await r.read_body(b"", max_bytes=100 * 1024, idle_timeout_s=5)
        r.close()
        r = await pool.post(srv.url, "/", b"{}", {})
        assert await r.read_body(b"", max_bytes=len(big), idle_timeout_s=5) == big
        r.release()
    stalled = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"
    async with RawServer(lambda req: (stalled, False)) as srv:
        r = await pool.post(srv.url, "/", b"{}", {})
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            await r.read_body(await r.read_chunk(), max_bytes=1000, idle_timeout_s=0.3)
        assert info.value.args == ("idle",) and time.monotonic() - t0 < 3
        r.close()
        r = await pool.post(srv.url, "/", b"{}", {})
        with pytest.raises(TimeoutError) as info:
            await r.read_body(b"", max_bytes=1000, idle_timeout_s=5, deadline=time.monotonic() + 0.2)
        assert info.value.args == ("deadline",)
        r.close()
    assert pool.open_connections == 0


# -- TLS to engines (issue 24, item 9) -----------------------------------------------------------------------


def _self_signed(tmp: Path) -> tuple[Path, ssl.SSLContext]:
    from tests.integration.engine_standins import self_signed, server_context

    cert, key = self_signed(tmp)
    return cert, server_context(cert, key)


async def test_https_engine_with_a_trusted_ca(tmp_path: Path) -> None:
    cert, server_ctx = _self_signed(tmp_path)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    pool = EnginePool(ssl_context=client_ctx)
    try:
        async with RawServer(
            lambda req: (chunked(b"data: 1\n\n", b"data: [DONE]\n\n"), False), tls=server_ctx
        ) as srv:
            for _ in range(2):
                r = await pool.post(srv.url, "/v1/completions", b"{}", {})
                assert r.status == 200 and await r.read_all() == b"data: 1\n\ndata: [DONE]\n\n"
                r.release()
            assert srv.connections == 1  # pooled keep-alive over TLS too
            assert b"host: localhost:" in srv.requests[0]
    finally:
        await pool.aclose()


async def test_https_engine_with_an_untrusted_certificate_is_a_clear_tls_error(tmp_path: Path) -> None:
    _, server_ctx = _self_signed(tmp_path)
    pool = EnginePool(ssl_context=ssl.create_default_context())  # system CAs only
    try:
        async with RawServer(lambda req: (sized(b"{}"), False), tls=server_ctx) as srv:
            with pytest.raises(EngineTLSError, match="certificate verify failed.*engine_ca_bundle"):
                await pool.post(srv.url, "/", b"{}", {})
            assert srv.requests == []  # nothing was sent over an unverified connection
        assert pool.open_connections == 0
    finally:
        await pool.aclose()
