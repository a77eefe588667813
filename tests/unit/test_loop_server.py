"""tests.helpers.LoopServer, the loop-thread TCP server under the test engines: it serves, and its shutdown ends
the connections still open (a stand-in engine must never leave a keep-alive peer hanging)."""

from __future__ import annotations

import asyncio
import socket

from tests.helpers import LoopServer, free_port


async def _echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(100):
        writer.write(data)
        await writer.drain()


def test_serves_and_shutdown_ends_open_connections() -> None:
    with LoopServer(_echo_forever, free_port()) as srv:
        conn = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        with conn:
            conn.sendall(b"ping")
            assert conn.recv(100) == b"ping"
            srv.shutdown()
            assert conn.recv(100) == b""  # the server side closed it (no hang: the socket has a 10 s timeout)
        refused = socket.socket()
        with refused:
            refused.settimeout(10)
            assert refused.connect_ex(("127.0.0.1", srv.port)) != 0  # no longer accepting
    assert not srv.thread.is_alive() and srv.loop.is_closed()
