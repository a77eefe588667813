"""The router's client-side keep-alive (``client_keepalive_timeout_s``) reaches its HTTP server."""

from __future__ import annotations

import socket
import time

from router.config import Settings
from tests.helpers import Proc, free_port, wait_http_ok


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, "connection closed mid-body"
        body += chunk
    return head


def test_idle_client_connections_close_after_the_configured_keepalive() -> None:
    # the default outlives the idle timeouts of common clients and load balancers (uvicorn's own is 5 s)
    assert Settings().client_keepalive_timeout_s > 60
    port = free_port()
    router = Proc.kvroute(
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--client-keepalive-timeout-s",
        "1",
        "--log-level",
        "warning",
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/healthz", timeout=30)
        with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: kvroute\r\n\r\n")
            head = _read_response(sock)
            assert head.startswith(b"HTTP/1.1 200")
            idle_since = time.monotonic()
            # the server closes the idle connection once the keep-alive runs out: recv returns b"" (EOF)
            assert sock.recv(1) == b""
            idle = time.monotonic() - idle_since
        assert 0.8 <= idle < 10, idle
    finally:
        router.stop()
