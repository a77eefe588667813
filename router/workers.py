"""Several router worker processes per pod (``Settings.workers``): every core of the pod serves requests.

One Python process runs its event loop on one core at a time (the GIL). With ``workers`` = N > 1,
``kvroute serve`` becomes a small supervisor that starts N copies of itself (the same command line and
environment), each a complete router: its own event loop, prefix index, KV-event subscriptions (each worker
subscribes to every engine's ZMQ publisher, as several router replicas do, so every index is kept exact by the
same event feed), load scrapes and, when ``redis_url`` is set, the shared state of ``membership/shared_state.py``
(predicted entries, sessions, replica indices). What one worker does not see is another worker's in-flight
requests before the next load scrape: the same as between router replicas.

Listening: each worker binds its own socket on the same host and port with ``SO_REUSEPORT``; the kernel spreads
new connections over the workers' sockets by a hash of the client address (a keep-alive connection stays on one
worker). The supervisor binds the port first (without listening) to resolve port 0 and to hold it while workers
restart.

Lifecycle: SIGTERM or SIGINT to the supervisor is passed to every worker (each drains as one router does, for
``shutdown_grace_s``), and the supervisor exits once all have; a worker still running ``shutdown_grace_s`` + 10 s
later is killed. Each worker gets SIGTERM from the kernel when the supervisor dies (``PR_SET_PDEATHSIG``), so a
killed supervisor leaves no orphan. A worker that exits on its own is started again after
``WORKER_RESTART_DELAY_S``, unless it exited with code 2 (bad configuration: every worker would), which stops all.

Metrics: ``GET /metrics`` on any worker answers the metrics of every worker, each sample labelled ``worker``
(``"0"`` .. ``"N-1"``); a worker collects its siblings' expositions over Unix sockets in a private directory of
the supervisor (``sibling_metrics``). Sum over ``worker`` for the pod's totals. Responses carry
``x-kvroute-worker`` (the worker's number) when ``workers`` > 1.

Units: seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

log = logging.getLogger("kvroute.workers")

#: environment of a worker process: its number, the number of workers, the port, the supervisor's directory
ENV_INDEX = "KVROUTE_WORKER_INDEX"
ENV_COUNT = "KVROUTE_WORKER_COUNT"
ENV_PORT = "KVROUTE_WORKER_PORT"
ENV_DIR = "KVROUTE_WORKER_DIR"
#: pause before a worker that exited on its own is started again, seconds
WORKER_RESTART_DELAY_S = 1.0
#: extra time after ``shutdown_grace_s`` before workers still running are killed, seconds
KILL_MARGIN_S = 10.0
#: how long a worker waits for one sibling's metrics, seconds
SIBLING_TIMEOUT_S = 2.0
#: exit code of ``kvroute serve`` for a bad configuration (router.server)
EXIT_BAD_CONFIG = 2
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """This process's place among the workers (``index`` in 0..``count``-1; ``directory``: where the workers'
    metrics sockets live)."""

    index: int
    count: int
    port: int
    directory: Path

    @property
    def metrics_socket(self) -> Path:
        """This worker's Unix socket answering its own metrics exposition."""
        return socket_path(self.directory, self.index)


def socket_path(directory: Path, index: int) -> Path:
    """The metrics socket of worker ``index``."""
    return directory / f"worker-{index}.sock"


def current_worker() -> WorkerInfo | None:
    """The ``WorkerInfo`` of this process when the supervisor started it, else None (a single-process router)."""
    idx = os.environ.get(ENV_INDEX)
    if idx is None:
        return None
    return WorkerInfo(
        int(idx), int(os.environ[ENV_COUNT]), int(os.environ[ENV_PORT]), Path(os.environ[ENV_DIR])
    )


def worker_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` with ``SO_REUSEPORT`` (one per worker)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


# ---------------------------------------------------------------------------------------------------------
# the supervisor
# ---------------------------------------------------------------------------------------------------------


def _die_with_parent(parent: int) -> Callable[[], None]:
    """``preexec_fn`` of a worker: SIGTERM when the supervisor dies; exit at once if it already has."""

    def setup() -> None:
        signal.pthread_sigmask(
            signal.SIG_SETMASK, set()
        )  # the supervisor blocks its signals; workers must not
        with contextlib.suppress(OSError, AttributeError):  # not Linux: no parent-death signal
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return setup


class Supervisor:
    """Starts, restarts and stops the worker processes (see the module docstring).

    Args:
        argv: the options of ``kvroute serve`` / ``kvroute epp`` (each worker runs the command again).
        host, port: where the workers listen (port 0: a free port, chosen once for all).
        workers: how many worker processes.
        shutdown_grace_s: how long workers may drain after SIGTERM before they are killed (plus
            ``KILL_MARGIN_S``), seconds.
        command: the ``kvroute`` subcommand the workers run (``serve``, or ``epp``: each worker also serves the
            endpoint picker, gRPC's listeners sharing its port with ``SO_REUSEPORT`` as well).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        host: str,
        port: int,
        workers: int,
        shutdown_grace_s: float,
        command: str,
    ) -> None:
        self.argv = list(argv)
        self.command = command
        self.workers = workers
        self.shutdown_grace_s = shutdown_grace_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._hold = socket.socket(family, socket.SOCK_STREAM)  # bound, never listening: holds the port
        self._hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._hold.bind((host, port))
        self.port = int(self._hold.getsockname()[1])
        self.directory = Path(tempfile.mkdtemp(prefix="kvroute-workers-"))
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * workers
        self._restart_at: dict[int, float] = {}

    def _start(self, index: int) -> None:
        env = dict(os.environ)
        env.update(
            {
                ENV_INDEX: str(index),
                ENV_COUNT: str(self.workers),
                ENV_PORT: str(self.port),
                ENV_DIR: str(self.directory),
            }
        )
        self.procs[index] = subprocess.Popen(  # noqa: PLW1509 (single-threaded parent: preexec_fn is safe)
            [sys.executable, "-m", "router.cli", self.command, *self.argv],
            env=env,
            preexec_fn=_die_with_parent(os.getpid()),
        )
        log.info("worker %d started (pid %d)", index, self.procs[index].pid)  # type: ignore[union-attr]

    def run(self) -> int:
        """Run the workers until SIGTERM / SIGINT; the exit code (0, or 2 when a worker found the
        configuration invalid)."""
        sigs = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
        try:
            log.info("supervisor: %d workers listening on port %d", self.workers, self.port)
            for i in range(self.workers):
                self._start(i)
            code = self._watch(sigs)
            self._stop_all()
            return code
        finally:
            self._kill_all()
            self._hold.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    def _watch(self, sigs: set[signal.Signals]) -> int:
        """Wait for signals: restart workers that exit, return on SIGTERM / SIGINT (0) or a bad configuration."""
        while True:
            timeout = 1.0
            if self._restart_at:
                timeout = max(0.0, min(self._restart_at.values()) - time.monotonic())
            info = signal.sigtimedwait(sigs, timeout)
            if info is not None and info.si_signo in (signal.SIGTERM, signal.SIGINT):
                log.info("supervisor: signal %d, stopping %d workers", info.si_signo, self.workers)
                return 0
            for i, p in enumerate(self.procs):
                if p is not None and p.poll() is not None:
                    if p.returncode == EXIT_BAD_CONFIG:
                        log.error("worker %d exited with code 2 (bad configuration): stopping", i)
                        return EXIT_BAD_CONFIG
                    log.warning(
                        "worker %d (pid %d) exited with code %s: starting it again in %gs",
                        i,
                        p.pid,
                        p.returncode,
                        WORKER_RESTART_DELAY_S,
                    )
                    self.procs[i] = None
                    self._restart_at[i] = time.monotonic() + WORKER_RESTART_DELAY_S
            now = time.monotonic()
            for i, at in list(self._restart_at.items()):
                if at <= now:
                    del self._restart_at[i]
                    self._start(i)

    def _stop_all(self) -> None:
        """SIGTERM every worker and wait for them (at most ``shutdown_grace_s`` + ``KILL_MARGIN_S``)."""
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_grace_s + KILL_MARGIN_S
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "worker pid %d still running after %gs: killed",
                    p.pid,
                    self.shutdown_grace_s + KILL_MARGIN_S,
                )

    def _kill_all(self) -> None:
        """SIGKILL whatever still runs (never leaves a worker behind)."""
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


# ---------------------------------------------------------------------------------------------------------
# in a worker: metrics of all workers, the worker header
# ---------------------------------------------------------------------------------------------------------


class _Families(Collector):
    """Yields fixed metric families (the merged view)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge_expositions(texts: dict[int, str]) -> bytes:
    """One Prometheus text exposition of several workers' (worker number -> its text), every sample labelled
    ``worker``; a family's help and type are the first worker's."""
    merged: dict[str, Metric] = {}
    for worker, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.samples.append(
                    Sample(s.name, {**s.labels, "worker": str(worker)}, s.value, s.timestamp, s.exemplar)
                )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


async def _read_sibling(path: Path) -> str | None:
    """A sibling's exposition from its metrics socket, or None when it does not answer in time."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), SIBLING_TIMEOUT_S)
    except (OSError, TimeoutError):
        return None
    try:
        data = await asyncio.wait_for(reader.read(), SIBLING_TIMEOUT_S)
        return data.decode()
    except (OSError, TimeoutError):
        return None
    finally:
        writer.close()


async def sibling_metrics(info: WorkerInfo, own: bytes) -> bytes:
    """Every worker's metrics merged (``merge_expositions``); a sibling that does not answer is left out."""
    others = [i for i in range(info.count) if i != info.index]
    texts = await asyncio.gather(*(_read_sibling(socket_path(info.directory, i)) for i in others))
    parts = {info.index: own.decode()}
    parts.update({i: t for i, t in zip(others, texts, strict=True) if t is not None})
    return merge_expositions(parts)


class WorkerApp:
    """The ASGI app of one worker: ``GET /metrics`` answers every worker's metrics, each response gets
    ``x-kvroute-worker``, and the worker's metrics socket serves its own exposition to its siblings.

    Args:
        app: the router's ASGI app.
        info: this worker.
        render: this worker's own exposition (``Telemetry.render``).
    """

    def __init__(self, app: Any, info: WorkerInfo, render: Callable[[], bytes]) -> None:
        self.app = app
        self.info = info
        self.render = render
        self.state = getattr(app, "state", None)
        self._header = (b"x-kvroute-worker", str(info.index).encode())
        self._server: asyncio.AbstractServer | None = None

    async def _serve_own(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(OSError):  # the asking worker went away
                writer.write(self.render())
                await writer.drain()
        finally:
            writer.close()

    async def _start_socket(self) -> None:
        path = self.info.metrics_socket
        path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve_own, str(path))

    async def __call__(
        self, scope: Any, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] == "lifespan" and self._server is None:
            await self._start_socket()
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            body = await sibling_metrics(self.info, self.render())
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                        (b"content-length", str(len(body)).encode()),
                        self._header,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        header = self._header

        async def send_tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        # the server's own send, for the proxy's direct stream relay (only the response head is tagged here)
        send_tagged.server_send = send  # type: ignore[attr-defined]
        await self.app(scope, receive, send_tagged)
