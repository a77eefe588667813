"""router/engine/scrape.py: the engine /metrics GET over the proxy's engine pool, with httpx's failure types."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from router.engine.client import EnginePool
from router.engine.scrape import PooledScrapeClient
from tests.helpers import free_port

PAGE = b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 3.0\n"


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, stall: bool) -> None:
    """A tiny HTTP/1.1 server: answers every GET with PAGE (or never answers when ``stall``)."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if stall:
                await asyncio.sleep(3600)
            assert head.startswith(b"GET /metrics HTTP/1.1\r\n"), head
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(PAGE), PAGE))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        return  # the client closed the connection: the fake engine's handler ends
    finally:
        writer.close()


@pytest.mark.parametrize("stall", [False, True])
def test_pooled_get_reads_pages_and_reports_timeouts(stall: bool) -> None:
    async def go() -> None:
        server = await asyncio.start_server(lambda r, w: _serve(r, w, stall=stall), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = EnginePool(connect_timeout_s=1.0, keepalive_timeout_s=4.0, max_connections=10)
        client = PooledScrapeClient(lambda: pool, max_body_bytes=1 << 20)
        try:
            if stall:
                with pytest.raises(httpx.TimeoutException):
                    await client.get(f"http://127.0.0.1:{port}/metrics", timeout=0.2)
                return
            for _ in range(3):  # one kept-alive connection answers all three
                page = await client.get(f"http://127.0.0.1:{port}/metrics", timeout=2.0)
                assert page.status_code == 200 and page.text == PAGE.decode()
            assert pool.open_connections == 1
        finally:
            await pool.aclose()
            server.close()

    asyncio.run(go())


def test_refused_connection_is_an_httpx_connect_error() -> None:
    async def go() -> None:
        pool = EnginePool(connect_timeout_s=1.0, keepalive_timeout_s=4.0, max_connections=10)
        try:
            with pytest.raises(httpx.ConnectError):
                await PooledScrapeClient(lambda: pool, 1 << 20).get(
                    f"http://127.0.0.1:{free_port()}/metrics", timeout=2.0
                )
        finally:
            await pool.aclose()

    asyncio.run(go())
