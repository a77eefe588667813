"""router.http.server_loop.QuietServer: uvicorn's server whose main loop checks once a second while idle (not ten
times), serves with a date header, and stops at once when ``should_exit`` is set (from another thread, as
uvicorn's signal handler does between two bytecodes of the loop thread)."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from router.http.server_loop import TICK_S, QuietServer
from tests.helpers import free_port


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


class _CountingServer(QuietServer):
    """Counts the main loop's checks (``on_tick`` calls)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.checks = 0

    async def on_tick(self, counter: int) -> bool:
        self.checks += 1
        return await super().on_tick(counter)


@contextmanager
def _serving() -> Iterator[tuple[_CountingServer, threading.Thread, int]]:
    """A QuietServer on a free port in a thread (no signal handlers there); stopped on exit."""
    port = free_port()
    server = _CountingServer(
        uvicorn.Config(_app, host="127.0.0.1", port=port, lifespan="off", log_config=None, loop="uvloop")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        assert thread.is_alive(), "server thread died"
        time.sleep(0.01)
    try:
        yield server, thread, port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _wait_checks(server: _CountingServer, n: int) -> None:
    deadline = time.monotonic() + 30
    while server.checks < n:
        assert time.monotonic() < deadline, f"the main loop made {server.checks} checks, not {n}"
        time.sleep(0.005)


def test_idle_main_loop_checks_once_a_second() -> None:
    with _serving() as (server, _, _):
        _wait_checks(server, 2)  # the first check at start, the next on the grid of whole TICK_S (within one)
        first, t0 = server.checks, time.monotonic()
        _wait_checks(server, first + 2)
        two_checks_s = time.monotonic() - t0
    # uvicorn's own main loop checks every 0.1 s (two in ~0.2 s); the quiet one every TICK_S (two in 2 s)
    assert two_checks_s >= 1.5 * TICK_S, two_checks_s


def test_serves_with_a_date_header() -> None:
    with _serving() as (_, _, port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/")
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read() == b"ok"
            assert resp.getheader("date", "").endswith(" GMT")
        finally:
            conn.close()


def test_should_exit_set_from_another_thread_stops_at_once() -> None:
    with _serving() as (server, thread, _):
        _wait_checks(server, 1)  # the main loop made its first check and waits for the next
        t0 = time.monotonic()
        server.should_exit = True
        thread.join(timeout=TICK_S * 0.8)
        stopped_in = time.monotonic() - t0
        assert not thread.is_alive(), "the main loop waited for its next tick instead of waking"
    # uvicorn's shutdown itself waits 0.1 s for connections to finish their responses
    assert stopped_in < TICK_S * 0.8
