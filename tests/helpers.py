"""Helpers for tests that start real processes and sockets: free ports, condition polling, process guards."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from fakes.ports import free_port as free_port  # re-exported: the tests take it from here
from sim.workload import TRACE_NAME, find_trace, trace_dirs

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


class FakeClock:
    """A clock the test advances by hand: ``clock.now += 1.5`` (seconds)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def http_chunks(base_url: str, path: str, body: dict[str, Any], timeout: float = 60.0) -> list[bytes]:
    """POST ``body`` as JSON to ``base_url + path`` over a plain socket and return the response body's HTTP/1.1
    chunks as the server wrote them (a stream's framing: what the router's direct relay is handed one by one;
    HTTP clients join them). AssertionError when the answer is not chunked."""
    host, _, port = base_url.removeprefix("http://").rstrip("/").partition(":")
    data = orjson.dumps(body)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (path.encode(), host.encode(), len(data), data)
        )
        raw = bytearray()
        while chunk := s.recv(65536):
            raw += chunk
    head, _, rest = bytes(raw).partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head[:300]
    chunks: list[bytes] = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return chunks
        chunks.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n", rest[: size + 2]
        rest = rest[size + 2 :]


def wait_until(
    cond: Callable[[], object], timeout: float = 10.0, interval: float = 0.02, what: str = "condition"
) -> object:
    """Poll ``cond`` until it returns a truthy value or ``timeout`` seconds pass (then AssertionError)."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except Exception as exc:  # the condition may fail while a service is starting
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc!r})")


def wait_http_ok(url: str, timeout: float = 20.0) -> None:
    """Wait until GET ``url`` answers 2xx."""
    wait_until(lambda: httpx.get(url, timeout=1.0).status_code < 300, timeout=timeout, what=f"GET {url}")


class Proc:
    """A child process that is always stopped: use as a context manager or call ``stop``."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, name: str = "") -> None:
        self.name = name or args[0]
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = tempfile.TemporaryFile()
        #: what the process printed, kept once it is stopped (its log file is then closed)
        self._final: str | None = None
        self.popen = subprocess.Popen(
            list(args),
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(REPO),
        )

    @classmethod
    def kvroute(cls, *args: str, env: dict[str, str] | None = None) -> Proc:
        """Start ``python -m router.cli <args>`` with this interpreter."""
        return cls([sys.executable, "-m", "router.cli", *args], env=env, name=f"kvroute {args[0]}")

    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> str:
        """Stop the process (its whole session) and return what it printed; its log file is closed (``output``
        still answers)."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)
        if self._final is None:
            self._final = self.output()
            self._log.close()
        return self._final

    def output(self) -> str:
        """Everything the process printed so far (stdout and stderr)."""
        if self._final is not None:
            return self._final
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL the process group (simulates a crash)."""
        self.stop(signal.SIGKILL)

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metric(url: str, name: str, headers: dict[str, str] | None = None, /, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` on ``url``/metrics (0 when none)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5, headers=headers).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


#: ``handle(reader, writer)``: serve one connection (the writer is closed afterwards)
ConnHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class LoopServer:
    """A raw asyncio TCP server on 127.0.0.1:``port`` whose event loop runs in its own thread; every connection is
    served by ``handle`` on that loop and tracked, so that ``shutdown`` ends the open ones too.

    The server, its connections and its tasks are only touched from the loop's thread (``asyncio.Server`` is not
    thread-safe). A context manager: started on enter, everything stopped on exit.
    """

    def __init__(self, handle: ConnHandler, port: int, tls: ssl.SSLContext | None = None) -> None:
        self.handle = handle
        self.port = port
        self.tls = tls
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self.handle(reader, writer)
        finally:
            with contextlib.suppress(Exception):
                writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def _shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def shutdown(self) -> None:
        """Stop accepting and end every open connection (e.g. keep-alive probes); the loop keeps running."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout=30)

    def __enter__(self) -> LoopServer:
        self.thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self.tls), self.loop
        )
        self.server = fut.result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.shutdown()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            if not self.thread.is_alive():
                self.loop.close()


#: ``answer(path)``: the status, content type and body of the answer to ``GET path``
PageAnswer = Callable[[str], tuple[int, str, bytes]]


class PageServer:
    """A real HTTP server on 127.0.0.1 (stdlib ``ThreadingHTTPServer`` in its own thread) answering every GET and
    POST with ``answer(path)`` (the POSTed bodies kept in ``posted``, in order); on ``port`` (a free one when None:
    give the old port to come back after ``close``)."""

    def __init__(self, answer: PageAnswer, port: int | None = None) -> None:
        posted: list[bytes] = []
        self.posted = posted

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                posted.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                self.do_GET()

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                status, ctype, body = answer(self.path)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return

        self.srv = ThreadingHTTPServer(("127.0.0.1", free_port() if port is None else port), Handler)
        self.srv.daemon_threads = True
        self.port = int(self.srv.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        """Stop serving and release the port."""
        self.srv.shutdown()
        self.srv.server_close()


def start_fake_engine(
    *args: str, attempts: int = 3, timeout: float = 30.0, env: dict[str, str] | None = None
) -> tuple[Proc, int, int, int]:
    """Start ``kvroute fake-engine`` on three free ports (HTTP, KV events, replay) plus ``args`` (and ``env`` added to
    its environment) and wait until it answers ``/health``. ``free_port`` cannot reserve a port: when another process takes one first, the engine exits
    ('address already in use') and is started again on new ports (at most ``attempts`` times).

    Returns the process and its HTTP, events and replay ports.
    """
    for attempt in range(attempts):
        port, ev, rp = free_port(), free_port(), free_port()
        proc = Proc.kvroute(
            "fake-engine",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-events-port",
            str(ev),
            "--kv-replay-port",
            str(rp),
            *args,
            env=env,
        )
        url = f"http://127.0.0.1:{port}/health"

        def up_or_exited(proc: Proc = proc, url: str = url) -> bool:
            if not proc.alive():
                return True
            try:
                return httpx.get(url, timeout=1.0).status_code < 300
            except httpx.HTTPError:
                return False

        try:
            wait_until(up_or_exited, timeout=timeout, what=f"GET {url}")
        except BaseException:
            print(proc.stop())
            raise
        if proc.alive():
            return proc, port, ev, rp
        out = proc.stop()
        if "address already in use" not in out or attempt == attempts - 1:
            raise AssertionError(f"fake engine exited at start:\n{out[-3000:]}")
    raise AssertionError("unreachable")


def shared_trace(name: str = TRACE_NAME) -> Path:
    """The shared real trace, read in place (never copied into the repo; where it is looked for:
    ``sim.workload.trace_dirs``).

    The trace is public data the repository may not carry (the README's demo falls back to a generated workload
    without it), so a test that needs it is skipped, naming where it looked, on a checkout without it; CI and
    ``make test`` run beside ``shared/`` (or in a clone of a checkout that is) and run these tests."""
    import pytest

    found = find_trace(name)
    if found is not None:
        return found
    pytest.skip(
        f"the trace {name} is not in {', '.join(str(d) for d in trace_dirs())} (set KVROUTE_TRACE_DIR)"
    )


def byte_flips(max_pos: int, max_size: int) -> Any:
    """A hypothesis strategy of ``(position, byte)`` changes for ``flipped`` (decoder fuzzing)."""
    return st.lists(
        st.tuples(st.integers(min_value=0, max_value=max_pos), st.integers(min_value=0, max_value=255)),
        max_size=max_size,
    )


def flipped(payload: bytes, flips: Sequence[tuple[int, int]]) -> bytes:
    """``payload`` with byte ``pos % len(payload)`` set to ``value`` for each ``(pos, value)`` of ``flips``."""
    data = bytearray(payload)
    for pos, val in flips:
        data[pos % len(data)] = val
    return bytes(data)


def fuzz_settings(examples: int) -> settings:
    """Hypothesis settings of the decoder fuzz tests: ``examples`` cases, no deadline, no example database."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def kv_start_warnings(caplog: Any) -> list[str]:
    """The warnings a KV-event subscriber logs when it starts (and stops again), over an empty index: how a router
    tells that a compiled part of its KV path is not built. ``caplog``: pytest's log capture fixture."""
    from index.prefix_index import PrefixIndex
    from membership.kv_events import KVEventSubscriber

    async def start_stop() -> None:
        sub = KVEventSubscriber(PrefixIndex(block_size=16))
        await sub.start()
        await sub.stop()

    caplog.clear()
    with caplog.at_level("WARNING", logger="kvroute.kv_events"):
        asyncio.run(start_stop())
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


#: the constants of murmur3's fmix64, the 64-bit mixer of the index's compiled tables (index/table_args.h)
_FMIX_C1, _FMIX_C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53
_U64 = (1 << 64) - 1


def mix64(k: int) -> int:
    """The compiled tables' key mixer (``mix64`` in index/table_args.h): where a key's probe starts."""
    k ^= k >> 33
    k = (k * _FMIX_C1) & _U64
    k ^= k >> 33
    k = (k * _FMIX_C2) & _U64
    return k ^ (k >> 33)


def unmix64(h: int) -> int:
    """The key whose ``mix64`` is ``h``: keys placed at chosen slots of a compiled table (were its mixer to change,
    they would be ordinary keys and the tests using them would still hold)."""
    h ^= h >> 33
    h = (h * pow(_FMIX_C2, -1, 1 << 64)) & _U64
    h ^= h >> 33
    h = (h * pow(_FMIX_C1, -1, 1 << 64)) & _U64
    return h ^ (h >> 33)


def table_outcome(target: Any, op: tuple[Any, ...], model: bool) -> tuple[str, Any]:
    """Run ``op`` = ``(name, *args)`` on one of the index's tables, or on ``model`` (a dict-backed reference whose
    methods ``getitem``, ``setitem``, ``delitem``, ``contains`` and ``iter`` stand for the table's ``[]``, ``[] =``,
    ``del``, ``in`` and ``iter``; every other name is a method of both): ``("ok", result)`` (listings as lists) or
    ``("raised", the exception's type)``, for tests that compare a compiled table with its Python form and a model."""
    name, *args = op
    try:
        if model or name not in _TABLE_SYNTAX:
            result = getattr(target, name)(*args)
        else:
            result = _TABLE_SYNTAX[name](target, *args)
        if name in ("keys", "values", "items"):
            result = list(result)
    except Exception as exc:  # compared by type
        return ("raised", type(exc))
    return ("ok", result)


def _set(t: Any, key: Any, value: Any) -> None:
    t[key] = value


def _del(t: Any, key: Any) -> None:
    del t[key]


#: the table syntax a model's methods of these names stand for (``table_outcome``)
_TABLE_SYNTAX: dict[str, Callable[..., Any]] = {
    "getitem": lambda t, key: t[key],
    "setitem": _set,
    "delitem": _del,
    "contains": lambda t, key: key in t,
    "iter": lambda t: list(iter(t)),
}
