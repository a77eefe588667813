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

Hung workers: each worker's event loop writes a heartbeat (a monotonic timestamp, every
``HEARTBEAT_INTERVAL_S``) to a file of the supervisor's directory. A worker whose loop has not beaten for
``worker_heartbeat_timeout_s`` (hung in a long computation, or stopped with SIGSTOP: its socket would keep taking
connections nobody answers) is killed and started again at once (``kvroute_worker_restarts_total{reason="hung"}``;
a starting worker has ``max(timeout, WORKER_START_GRACE_S)`` for its first beat). A worker that is stopped and
resumed before that (SIGCONT) tells its loop-lag probe, which does not count the stop as lag of its own (it would
shed new requests for ``event_loop_lag_window_s``).

The directory (Unix sockets, heartbeats) is private (0700) under the system temporary directory. The supervisor
holds an exclusive ``flock`` on its ``owner.lock`` for its lifetime (the kernel drops it when the process dies,
SIGKILL included); each supervisor that starts removes the directories whose lock is free (``claim_directory``).

Metrics: ``GET /metrics`` on any worker answers the metrics of every worker, each sample labelled ``worker``
(``"0"`` .. ``"N-1"``), plus the supervisor's own (``kvroute_worker_*``). The worker that is asked only relays
bytes: the merge runs in a thread of the supervisor (``MetricsMerger``), which reads each worker's exposition
from its metrics socket (at most ``worker_metrics_max_bytes`` each: a larger one is cut after its last whole
family, counted) and labels the samples textually, without parsing them; each worker renders its own exposition
in slices, yielding to its loop between them (``Telemetry.render_stream``). Sum over ``worker`` for the pod's
totals. Responses carry ``x-kvroute-worker`` (the worker's number) when ``workers`` > 1.

Units: seconds, bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import re
import select
import shutil
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("kvroute.workers")

#: environment of a worker process: its number, the number of workers, the port, the supervisor's directory
ENV_INDEX = "KVROUTE_WORKER_INDEX"
ENV_COUNT = "KVROUTE_WORKER_COUNT"
ENV_PORT = "KVROUTE_WORKER_PORT"
ENV_DIR = "KVROUTE_WORKER_DIR"
ENV_PARENT = "KVROUTE_WORKER_PARENT"
#: pause before a worker that exited on its own is started again, seconds
WORKER_RESTART_DELAY_S = 1.0
#: extra time after ``shutdown_grace_s`` before workers still running are killed, seconds
KILL_MARGIN_S = 10.0
#: how long the merger waits for one worker's metrics socket (each read), seconds
SIBLING_TIMEOUT_S = 2.0
#: the longest the merger spends reading one worker's exposition, seconds
SIBLING_DEADLINE_S = 10.0
#: merges running at once in the supervisor (more scrapes wait, at most ``SIBLING_DEADLINE_S``)
MAX_MERGES = 2
#: how often a worker's loop writes its heartbeat, seconds
HEARTBEAT_INTERVAL_S = 0.5
#: a starting worker's time for its first heartbeat (imports, tokenizer, first scrapes), at least, seconds
WORKER_START_GRACE_S = 120.0
#: exit code of ``kvroute serve`` for a bad configuration (router.server)
EXIT_BAD_CONFIG = 2
#: prefix of the supervisors' directories under the system temporary directory
DIR_PREFIX = "kvroute-workers-"
_PR_SET_PDEATHSIG = 1
_BEAT = struct.Struct("<d")


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """This process's place among the workers (``index`` in 0..``count``-1; ``directory``: where the workers'
    metrics sockets and heartbeats live)."""

    index: int
    count: int
    port: int
    directory: Path
    parent: int = 0

    @property
    def metrics_socket(self) -> Path:
        """This worker's Unix socket answering its own metrics exposition."""
        return socket_path(self.directory, self.index)

    @property
    def heartbeat_file(self) -> Path:
        """This worker's heartbeat file."""
        return heartbeat_path(self.directory, self.index)


def socket_path(directory: Path, index: int) -> Path:
    """The metrics socket of worker ``index``."""
    return directory / f"worker-{index}.sock"


def heartbeat_path(directory: Path, index: int) -> Path:
    """The heartbeat file of worker ``index`` (8 bytes: a ``time.monotonic()`` of its loop, little-endian)."""
    return directory / f"worker-{index}.beat"


def merge_socket(directory: Path) -> Path:
    """The supervisor's socket answering every worker's metrics, merged."""
    return directory / "metrics.sock"


def current_worker() -> WorkerInfo | None:
    """The ``WorkerInfo`` of this process when the supervisor started it, else None (a single-process router)."""
    idx = os.environ.get(ENV_INDEX)
    if idx is None:
        return None
    return WorkerInfo(
        int(idx),
        int(os.environ[ENV_COUNT]),
        int(os.environ[ENV_PORT]),
        Path(os.environ[ENV_DIR]),
        int(os.environ.get(ENV_PARENT, "0")),
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
# the supervisor's directory
# ---------------------------------------------------------------------------------------------------------


def _owner_gone(directory: Path) -> bool:
    """True when no live supervisor owns ``directory``: its ``owner.lock`` can be locked (its owner died), or it
    has none (an older version's, or one being created: then only when it is a minute old and none of its
    sockets answers)."""
    lock = directory / "owner.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        if time.time() - directory.stat().st_mtime < 60:
            return False
        return not any(_answers(sock) for sock in directory.glob("*.sock"))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
            return True
        except OSError:
            return False


def remove_stale_directories(base: Path) -> int:
    """Remove the directories of dead supervisors (this user's ``kvroute-workers-*`` under ``base``); returns how
    many were removed."""
    removed = 0
    for directory in base.glob(DIR_PREFIX + "*"):
        try:
            if directory.is_symlink() or not directory.is_dir() or directory.stat().st_uid != os.getuid():
                continue
            if _owner_gone(directory):
                shutil.rmtree(directory, ignore_errors=True)
                removed += 1
                log.info("removed %s (its supervisor is gone)", directory)
        except OSError:  # removed meanwhile, or not ours to read
            continue
    return removed


def claim_directory() -> tuple[Path, int]:
    """A new private directory for this supervisor, and the descriptor of the lock it holds on it (closed with
    the process); the directories of dead supervisors are removed first."""
    remove_stale_directories(Path(tempfile.gettempdir()))
    directory = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))
    pending = directory / "owner.lock.new"
    fd = os.open(pending, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    pending.rename(directory / "owner.lock")  # appears already locked: never taken for a dead owner's
    return directory, fd


# ---------------------------------------------------------------------------------------------------------
# the supervisor
# ---------------------------------------------------------------------------------------------------------


#: the signals the supervisor acts on: stop (SIGTERM, SIGINT) and a worker's exit (SIGCHLD)
_SUPERVISOR_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)


class _SignalWakeup:
    """The supervisor's signals as bytes on a socket its main thread waits on (``signal.set_wakeup_fd``).

    Handlers, not a blocked mask and ``sigtimedwait``: the kernel may deliver a process's signal to any of its
    threads that does not block it, and threads started at import time (numpy's OpenBLAS pool) never blocked
    anything, so SIGTERM arriving while the main thread was not inside ``sigtimedwait`` took its default action
    there and killed the supervisor (exit -15, its workers and directory left to the parent-death signal). A
    handler runs whichever thread the kernel picks, and the wake-up byte reaches the main thread's ``wait``."""

    def __init__(self, signals: Sequence[signal.Signals]) -> None:
        self.signals = tuple(signals)
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)
        self._previous: dict[signal.Signals, Any] = {}
        self._previous_fd = -1

    def __enter__(self) -> _SignalWakeup:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, _note_signal)
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._read.close()
        self._write.close()

    def wait(self, timeout_s: float) -> set[int]:
        """The signals received within ``timeout_s`` seconds (empty when none): returns at the first one."""
        ready, _, _ = select.select([self._read], [], [], timeout_s)
        got: set[int] = set()
        while ready:
            try:
                data = self._read.recv(256)
            except BlockingIOError:
                break
            if not data:
                break
            got.update(data)
        return got


def _note_signal(signum: int, frame: object) -> None:
    """The supervisor's handler: nothing to do here, the wake-up byte carries the signal (``_SignalWakeup``)."""


def become_worker(info: WorkerInfo) -> None:
    """First thing in a worker process: unblock every signal (a blocked mask survives ``exec``), ask for SIGTERM
    when the supervisor dies, and exit at once if it already has. (Done here, not in a ``preexec_fn``: the
    supervisor has threads, and running Python between ``fork`` and ``exec`` of a threaded process can
    deadlock.)"""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    with contextlib.suppress(OSError, AttributeError):  # not Linux: no parent-death signal
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if info.parent and os.getppid() != info.parent:
        os._exit(1)


@dataclass(slots=True)
class SupervisorStats:
    """The supervisor's counters (``kvroute_worker_*`` metrics)."""

    restarts: dict[str, int] = field(default_factory=lambda: {"exited": 0, "hung": 0})
    truncated: int = 0


def read_heartbeat(path: Path) -> float | None:
    """A worker's last heartbeat (``time.monotonic()`` seconds), or None when it has written none readable."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) != _BEAT.size:
        return None
    (value,) = _BEAT.unpack(data)
    return float(value)


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
        heartbeat_timeout_s: ``worker_heartbeat_timeout_s`` (0: hung workers are not detected), seconds.
        metrics_max_bytes: ``worker_metrics_max_bytes``, bytes.
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
        heartbeat_timeout_s: float,
        metrics_max_bytes: int,
    ) -> None:
        self.argv = list(argv)
        self.command = command
        self.workers = workers
        self.shutdown_grace_s = shutdown_grace_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._hold = socket.socket(family, socket.SOCK_STREAM)  # bound, never listening: holds the port
        self._hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._hold.bind((host, port))
        self.port = int(self._hold.getsockname()[1])
        self.directory, self._lock_fd = claim_directory()
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * workers
        self._started: dict[int, float] = {}
        self._restart_at: dict[int, float] = {}
        self.stats = SupervisorStats()
        self.merger = MetricsMerger(
            self.directory, workers, metrics_max_bytes, self.stats, self.heartbeat_ages
        )

    def _start(self, index: int) -> None:
        env = dict(os.environ)
        env.update(
            {
                ENV_INDEX: str(index),
                ENV_COUNT: str(self.workers),
                ENV_PORT: str(self.port),
                ENV_DIR: str(self.directory),
                ENV_PARENT: str(os.getpid()),
            }
        )
        heartbeat_path(self.directory, index).unlink(
            missing_ok=True
        )  # a previous worker's beats do not count
        self._started[index] = time.monotonic()
        self.procs[index] = subprocess.Popen(
            [sys.executable, "-m", "router.cli", self.command, *self.argv], env=env
        )
        log.info("worker %d started (pid %d)", index, self.procs[index].pid)  # type: ignore[union-attr]

    def run(self) -> int:
        """Run the workers until SIGTERM / SIGINT; the exit code (0, or 2 when a worker found the
        configuration invalid)."""
        with _SignalWakeup(_SUPERVISOR_SIGNALS) as wakeup:
            try:
                self.merger.start()
                log.info(
                    "supervisor: %d workers listening on port %d (directory %s)",
                    self.workers,
                    self.port,
                    self.directory,
                )
                for i in range(self.workers):
                    self._start(i)
                code = self._watch(wakeup)
                self._stop_all()
                return code
            finally:
                self._kill_all()
                self.merger.stop()
                self._hold.close()
                shutil.rmtree(self.directory, ignore_errors=True)
                os.close(self._lock_fd)

    def _watch(self, wakeup: _SignalWakeup) -> int:
        """Wait for signals: restart workers that exit or hang, return on SIGTERM / SIGINT (0) or a bad
        configuration."""
        while True:
            timeout = 1.0
            if self._restart_at:
                timeout = min(timeout, max(0.0, min(self._restart_at.values()) - time.monotonic()))
            stop = wakeup.wait(timeout) & {signal.SIGTERM, signal.SIGINT}
            if stop:
                log.info("supervisor: signal %d, stopping %d workers", min(stop), self.workers)
                return 0
            if self._reap_exited():
                return EXIT_BAD_CONFIG
            self._replace_hung()
            now = time.monotonic()
            for i, at in list(self._restart_at.items()):
                if at <= now:
                    del self._restart_at[i]
                    self._start(i)

    def _reap_exited(self) -> bool:
        """Schedule the restart of workers that exited; True when one exited for a bad configuration."""
        for i, p in enumerate(self.procs):
            if p is None or p.poll() is None:
                continue
            if p.returncode == EXIT_BAD_CONFIG:
                log.error("worker %d exited with code 2 (bad configuration): stopping", i)
                return True
            log.warning(
                "worker %d (pid %d) exited with code %s: starting it again in %gs",
                i,
                p.pid,
                p.returncode,
                WORKER_RESTART_DELAY_S,
            )
            self.stats.restarts["exited"] += 1
            self.procs[i] = None
            self._restart_at[i] = time.monotonic() + WORKER_RESTART_DELAY_S
        return False

    def _silence(self, index: int, now: float) -> tuple[float, bool]:
        """Seconds since worker ``index``'s last heartbeat (since its start when it has not beaten yet), and
        whether it has beaten since its start."""
        beat = read_heartbeat(heartbeat_path(self.directory, index))
        started = self._started.get(index, now)
        if beat is None or beat < started:
            return now - started, False
        return now - beat, True

    def heartbeat_ages(self) -> dict[int, float]:
        """Seconds since each running worker's last heartbeat (since its start when it has not beaten yet)."""
        now = time.monotonic()
        return {i: self._silence(i, now)[0] for i, p in enumerate(self.procs) if p is not None}

    def _replace_hung(self) -> None:
        """Kill and restart (at once) the workers whose loop has not beaten for ``heartbeat_timeout_s``."""
        if self.heartbeat_timeout_s <= 0:
            return
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            if p is None:
                continue
            age, beaten = self._silence(i, now)
            limit = (
                self.heartbeat_timeout_s if beaten else max(self.heartbeat_timeout_s, WORKER_START_GRACE_S)
            )
            if age <= limit:
                continue
            log.warning(
                "worker %d (pid %d): no heartbeat for %.1fs (worker_heartbeat_timeout_s %gs): killed, starting "
                "it again",
                i,
                p.pid,
                age,
                limit,
            )
            p.kill()  # SIGKILL also ends a stopped process
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            self.stats.restarts["hung"] += 1
            self.procs[i] = None
            self._restart_at[i] = now

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
# the supervisor: every worker's metrics, merged off the serving loops
# ---------------------------------------------------------------------------------------------------------

#: a sample line with labels: everything before the last "} " of the line (the end of its label set)
_LABELLED = re.compile(rb"^([^#\n].*)\} ", re.M)
#: a sample line without labels
_PLAIN = re.compile(rb"^([a-zA-Z_:][a-zA-Z0-9_:]*) ", re.M)


def families(text: bytes) -> Iterator[tuple[bytes, bytes, bytes]]:
    """``(name, head, samples)`` of each metric family of a text exposition (``head``: its ``#`` lines); samples
    before any ``# HELP`` come first, with an empty name and head."""
    starts = [0] if text.startswith(b"# HELP ") else []
    at = text.find(b"\n# HELP ")
    while at >= 0:
        starts.append(at + 1)
        at = text.find(b"\n# HELP ", at + 1)
    if not starts or starts[0] > 0:
        yield b"", b"", text[: starts[0] if starts else len(text)]
    for n, start in enumerate(starts):
        block = text[start : starts[n + 1] if n + 1 < len(starts) else len(text)]
        pos = 0
        while block.startswith(b"#", pos):
            nl = block.find(b"\n", pos)
            pos = len(block) if nl < 0 else nl + 1
        name = block[7:].split(b" ", 1)[0].rstrip(b"\n")
        yield name, block[:pos], block[pos:]


def label_samples(samples: bytes, worker: int) -> bytes:
    r"""Sample lines with the label ``worker`` added last (text substitutions: nothing is parsed).

    A label set ends with ``"} `` (the last value's closing quote); inside a value a quote is escaped (``\"``),
    so when no ``\"} `` occurs, one ``bytes.replace`` labels every labelled line exactly. Otherwise (and for an
    empty label set ``{}``) each line's last ``} `` is taken, one line at a time."""
    mark = b'worker="%d"' % worker
    if b'\\"} ' in samples or b"{} " in samples:
        out = _LABELLED.sub(lambda m: m.group(1) + b"," + mark + b"} ", samples)
        out = out.replace(b"{," + mark, b"{" + mark)  # an empty label set: name{} value
    else:
        labelled = samples.count(b'"} ')
        out = samples.replace(b'"} ', b'",' + mark + b"} ")
        if labelled == samples.count(b"\n"):  # every line has labels (the families with many series)
            return out
    return _PLAIN.sub(lambda m: m.group(1) + b"{" + mark + b"} ", out)


def merge_expositions(texts: Mapping[int, str | bytes]) -> bytes:
    """One Prometheus text exposition of several workers' (worker number -> its text), every sample labelled
    ``worker``; a family's help and type are those of the first worker that has it."""
    heads: dict[bytes, bytes] = {}
    parts: dict[bytes, list[bytes]] = {}
    for worker, text in sorted(texts.items()):
        raw = text.encode() if isinstance(text, str) else text
        for name, head, samples in families(raw):
            heads.setdefault(name, head)
            parts.setdefault(name, []).append(label_samples(samples, worker))
    return b"".join(heads[name] + b"".join(chunks) for name, chunks in parts.items())


def cut_at_family(data: bytes) -> bytes:
    """``data`` without its last, unfinished family (what precedes the last ``# HELP`` line)."""
    start = data.rfind(b"\n# HELP ")
    return data[: start + 1] if start >= 0 else b""


def read_exposition(path: Path, max_bytes: int) -> tuple[bytes | None, bool]:
    """A worker's exposition from its metrics socket (None when it does not answer in time) and whether it was
    cut at ``max_bytes`` (after its last whole family)."""
    deadline = time.monotonic() + SIBLING_DEADLINE_S
    chunks: list[bytes] = []
    size = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(SIBLING_TIMEOUT_S)
        try:
            sock.connect(str(path))
            while size <= max_bytes:
                if time.monotonic() > deadline:
                    return None, False
                chunk = sock.recv(1 << 16)
                if not chunk:
                    return b"".join(chunks), False
                chunks.append(chunk)
                size += len(chunk)
        except OSError:  # no such worker (restarting), or silent (hung, stopped): left out
            return None, False
    return cut_at_family(b"".join(chunks)[:max_bytes]), True


def supervisor_families(stats: SupervisorStats, ages: dict[int, float]) -> bytes:
    """The supervisor's own metrics, as text."""
    lines = [
        "# HELP kvroute_worker_restarts_total workers started again, by reason: exited (on their own), hung "
        "(no heartbeat for worker_heartbeat_timeout_s: killed)\n",
        "# TYPE kvroute_worker_restarts_total counter\n",
        *(f'kvroute_worker_restarts_total{{reason="{r}"}} {n}\n' for r, n in sorted(stats.restarts.items())),
        "# HELP kvroute_worker_metrics_truncated_total worker expositions cut at worker_metrics_max_bytes\n",
        "# TYPE kvroute_worker_metrics_truncated_total counter\n",
        f"kvroute_worker_metrics_truncated_total {stats.truncated}\n",
        "# HELP kvroute_worker_heartbeat_age_seconds seconds since each worker's last heartbeat (s)\n",
        "# TYPE kvroute_worker_heartbeat_age_seconds gauge\n",
        *(f'kvroute_worker_heartbeat_age_seconds{{worker="{i}"}} {a:.3f}\n' for i, a in sorted(ages.items())),
    ]
    return "".join(lines).encode()


class MetricsMerger:
    """In the supervisor, in threads of its own: answers each connection to ``merge_socket`` with every worker's
    exposition merged (``merge_expositions``) and the supervisor's families (see the module docstring).

    Args:
        directory: the supervisor's directory.
        count: the number of workers.
        max_bytes: the most read from one worker (``worker_metrics_max_bytes``), bytes.
        stats: the supervisor's counters (``truncated`` is counted here).
        ages: seconds since each worker's last heartbeat.
    """

    def __init__(
        self,
        directory: Path,
        count: int,
        max_bytes: int,
        stats: SupervisorStats,
        ages: Callable[[], dict[int, float]],
    ) -> None:
        self.directory = directory
        self.count = count
        self.max_bytes = max_bytes
        self.stats = stats
        self.ages = ages
        self._slots = threading.BoundedSemaphore(MAX_MERGES)
        self._pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="kvroute-metrics-read")
        self._server: socketserver.ThreadingUnixStreamServer | None = None

    def merged(self) -> bytes:
        """Every worker's exposition (those that answer), labelled, then the supervisor's families."""
        paths = [socket_path(self.directory, i) for i in range(self.count)]
        answers = list(self._pool.map(lambda p: read_exposition(p, self.max_bytes), paths))
        texts: dict[int, bytes] = {}
        for i, (text, cut) in enumerate(answers):
            if cut:
                self.stats.truncated += 1
                log.warning("worker %d's metrics exceed worker_metrics_max_bytes: cut", i)
            if text is not None:
                texts[i] = text
        return merge_expositions(texts) + supervisor_families(self.stats, self.ages())

    def start(self) -> None:
        """Listen on ``merge_socket`` (a thread per connection)."""
        merger = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                if not merger._slots.acquire(timeout=SIBLING_DEADLINE_S):
                    return  # too many scrapes at once: closed without an answer (the worker answers 503)
                try:
                    body = merger.merged()
                finally:
                    merger._slots.release()
                with contextlib.suppress(OSError):  # the asking worker went away
                    self.request.sendall(body)

        server = socketserver.ThreadingUnixStreamServer(str(merge_socket(self.directory)), Handler)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, name="kvroute-metrics-merge", daemon=True).start()

    def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------------------------------
# in a worker: its own metrics, the pod's metrics relayed, the heartbeat, the worker header
# ---------------------------------------------------------------------------------------------------------


class Heartbeat:
    """Writes ``time.monotonic()`` to the worker's heartbeat file every ``HEARTBEAT_INTERVAL_S``, from its loop
    (a loop that does not run does not beat)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Open the file and beat now, then every interval (on the running loop)."""
        self._fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        self._beat()

    def _beat(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):  # the directory went away (supervisor stopping)
            os.pwrite(self._fd, _BEAT.pack(time.monotonic()), 0)
        self._handle = asyncio.get_running_loop().call_later(HEARTBEAT_INTERVAL_S, self._beat)

    def stop(self) -> None:
        """Stop beating and close the file."""
        if self._handle is not None:
            self._handle.cancel()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


async def _relay_merged(info: WorkerInfo) -> AsyncIterator[bytes]:
    """The pod's metrics from the supervisor's merger, as they arrive (nothing when it does not answer)."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(merge_socket(info.directory))), SIBLING_TIMEOUT_S
        )
    except (OSError, TimeoutError):
        return
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 16), SIBLING_DEADLINE_S + SIBLING_TIMEOUT_S):
            yield chunk
    except (OSError, TimeoutError):
        return
    finally:
        writer.close()


class WorkerApp:
    """The ASGI app of one worker: ``GET /metrics`` relays every worker's metrics merged by the supervisor, each
    response gets ``x-kvroute-worker``, the worker's metrics socket serves its own exposition, its loop beats the
    heartbeat, and SIGCONT (resumed after a stop) is reported to ``on_resume``.

    Args:
        app: the router's ASGI app.
        info: this worker.
        render: this worker's own exposition in slices (``Telemetry.render_stream``).
        on_resume: called (from the signal handler: must only set a flag) when the process is resumed.
    """

    def __init__(
        self,
        app: Any,
        info: WorkerInfo,
        render: Callable[[], AsyncIterator[bytes]],
        on_resume: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self.info = info
        self.render = render
        self.on_resume = on_resume
        self.state = getattr(app, "state", None)
        self._header = (b"x-kvroute-worker", str(info.index).encode())
        self._server: asyncio.AbstractServer | None = None
        self.heartbeat = Heartbeat(info.heartbeat_file)

    async def _serve_own(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(OSError):  # the merger went away
                async for chunk in self.render():
                    writer.write(chunk)
                    await writer.drain()
        finally:
            writer.close()

    async def _start_worker_side(self) -> None:
        path = self.info.metrics_socket
        path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve_own, str(path))
        self.heartbeat.start()
        if self.on_resume is not None:
            on_resume = self.on_resume
            signal.signal(signal.SIGCONT, lambda _sig, _frame: on_resume())

    async def _metrics(self, send: Callable[[Any], Awaitable[None]]) -> None:
        chunks = _relay_merged(self.info)
        first = await anext(chunks, None)
        if first is None:
            body = b'{"error":{"message":"the supervisor did not answer with the workers\' metrics","type":'
            body += b'"server_error","code":"metrics_unavailable","param":null}}'
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"1"), self._header]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        content_type = (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
        await send({"type": "http.response.start", "status": 200, "headers": [content_type, self._header]})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def __call__(
        self, scope: Any, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] == "lifespan" and self._server is None:
            await self._start_worker_side()
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            await self._metrics(send)
            return
        header = self._header

        async def send_tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        # the server's own send, for the proxy's direct stream relay (only the response head is tagged here)
        send_tagged.server_send = send  # type: ignore[attr-defined]
        await self.app(scope, receive, send_tagged)
