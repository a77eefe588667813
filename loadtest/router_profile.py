"""Where a router process spends its CPU: py-spy sampling of a running router and a breakdown by category.

    sampler = PySpy.start(pid, out_path, rate_hz=200)   # py-spy record --format raw --subprocesses
    ...                                                  # run the workload
    sampler.stop()                                       # SIGINT: py-spy writes the collapsed stacks
    table = breakdown(out_path)                          # category -> share of the on-CPU samples

py-spy samples only threads that are running (``--idle`` is off), so a sample is CPU time, and native frames of
extensions (the HF tokenizers' Rust code, orjson) count for the Python frame that called them. One exception:
samples whose innermost Python frame is the event loop's ``run`` (``WAITS``: uvloop's C code, the socket
syscalls, and its ``epoll_pwait``) are mostly waits that py-spy takes for running, and so are those whose innermost
frame is a thread waiting for work (the tokenizer pool's ``_worker`` in ``work_queue.get``: 45 of the 48 samples
that fell to "event loop, GC, other" in the run below). Measured on the e2e slice
(2026-12-06): the samples of a kvroute run came to 2.48 s at 200 Hz against 1.75 s of CPU measured in ``/proc``,
and the excess was about the loop-only samples (0.79 s); ``py-spy --native`` put 296 of 338 such samples in
``epoll_pwait``. So ``per_request_ms`` leaves that category out and shares the measured CPU among the others
(``wait_share`` reports its share of the samples); uvloop's own few percent of CPU are then spread over the
rest (``perf`` put the router's CPU at 62 % in the interpreter, 16 % kernel, 9 % libc and 4 % uvloop). Each sample
goes to the first category (in ``CATEGORIES`` order) whose pattern matches any frame of its stack, innermost
frame first, so a category names where the time is spent, not who asked for it: the JSON parsing inside the
KV-event intake counts as intake, the hashing of the prompt's blocks as hashing.

Units: samples, shares in [0, 1], milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

#: the category of samples that are mostly waits py-spy counts as running (module doc): no Python frame below the
#: event loop's ``run`` (``epoll_pwait``), or a thread blocked where it waits for work (``_IDLE_LEAF``)
WAITS = "waits (the loop's epoll, idle worker threads; not in the ms)"
#: an innermost frame that is a thread waiting: the thread pool's worker between work items (``work_queue.get``
#: is its innermost Python frame), ``threading`` waits
_IDLE_LEAF = re.compile(
    r"^(_worker \(concurrent/futures/thread\.py|(Condition|Event)\.wait \(threading\.py|"
    r"Thread\._wait_for_tstate_lock \(threading\.py)"
)
#: (category, pattern on a frame "function (file:line)"); the first category matching the innermost frame of a
#: sample wins, then the next frame outwards, and so on
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pat))
    for name, pat in (
        ("tokenization", r"router/tokens/(tokenizer|token_cache|frontier)\.py|tokenizers/"),
        ("token ids forwarding", r"router/tokens/token_ids\.py"),
        ("hashing (block keys)", r"index/hashing\.py|block_keys|chain_hash"),
        ("KV-event intake (ZMQ, decode, apply)", r"membership/kv_|zmq/|msgspec|msgpack"),
        ("index (match, insert, evict)", r"index/"),
        ("routing policy", r"policies/|router/core/(routing|dispatch)\.py"),
        (
            "load scraping, health",
            r"membership/engine_metrics\.py|membership/health\.py|membership/tasks\.py",
        ),
        (
            "SSE relay + validator",
            r"router/engine/(relay|sse)\.py|_Relay|SSEValidator|_ProxyStream|_DirectWrite|_usage_from_sse",
        ),
        ("idempotency guard", r"router/serve/idempotency\.py"),
        (
            "request JSON parse / serialise",
            r"orjson|json/|simdjson|pydantic|router/serve/intake\.py|ask_for_usage|_payload",
        ),
        ("engine client (HTTP to engines)", r"router/engine/client\.py|httptools"),
        ("proxy (attempts, feedback)", r"router/engine/|router/serve/dispatch\.py|router/pd/"),
        ("logging", r"logging/|router/telemetry\.py.*(format|emit)"),
        ("telemetry (metrics)", r"prometheus_client|router/telemetry\.py"),
        (WAITS, r"asyncio/runners\.py"),
        ("HTTP server (uvicorn, starlette)", r"uvicorn/|starlette/|router/http/protocol\.py|h11/"),
        ("router app (admission, guard, rest)", r"router/"),
        ("event loop, GC, other", r"."),
    )
)


@dataclass(slots=True)
class PySpy:
    """One running ``py-spy record`` process; ``stop`` makes it write its output."""

    proc: subprocess.Popen[bytes]
    out_path: Path

    @classmethod
    def start(cls, pid: int, out_path: Path, rate_hz: int = 200) -> PySpy:
        """Start sampling process ``pid`` (and its child processes) ``rate_hz`` times a second into ``out_path``
        (collapsed stacks, one ``frames count`` line per distinct stack)."""
        exe = pyspy_path()
        if exe is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy into the venv)")
        args = [
            exe,
            "record",
            "--pid",
            str(pid),
            "--format",
            "raw",
            "--rate",
            str(rate_hz),
            "--subprocesses",
            "--nonblocking",
            "--output",
            str(out_path),
        ]
        proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        return cls(proc, out_path)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT py-spy (it writes its output and exits); SIGKILL it when it does not within ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def pyspy_path() -> str | None:
    """The py-spy executable next to this interpreter, or on PATH; None when missing."""
    local = Path(sys.executable).parent / "py-spy"
    if local.exists() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("py-spy")


def categorize(stack: str) -> str:
    """The category of one collapsed stack (``outer;...;inner``)."""
    frames = stack.split(";")
    if _IDLE_LEAF.search(frames[-1]):
        return WAITS
    for frame in reversed(frames):
        for name, pat in CATEGORIES[:-1]:
            if pat.search(frame):
                return name
    return CATEGORIES[-1][0]


#: a frame of a thread started by Python's ``threading`` (the tokenizer pool): not an event loop
_THREAD_FRAME = re.compile(r"Thread\._bootstrap|concurrent/futures/thread\.py")


def on_event_loop(stack: str) -> bool:
    """True when a collapsed stack is a sample of an event-loop (main) thread, not of a worker thread."""
    return _THREAD_FRAME.search(stack) is None


def breakdown(raw_path: Path, loop_only: bool = False) -> dict[str, float]:
    """Category -> share of the samples in a py-spy raw (collapsed) file, largest first (``loop_only``: of the
    event-loop threads' samples only)."""
    counts: Counter[str] = Counter()
    for line in raw_path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit() or (loop_only and not on_event_loop(stack)):
            continue
        counts[categorize(stack)] += int(n)
    total = sum(counts.values())
    if not total:
        return {}
    return {k: round(v / total, 4) for k, v in counts.most_common()}


def top_functions(raw_path: Path, n: int = 25) -> list[tuple[str, float]]:
    """The ``n`` innermost frames with the most samples, with their shares (the hottest leaf functions)."""
    counts: Counter[str] = Counter()
    for line in raw_path.read_text().splitlines():
        stack, _, k = line.rpartition(" ")
        if stack and k.isdigit():
            counts[stack.split(";")[-1]] += int(k)
    total = sum(counts.values()) or 1
    return [(f, round(c / total, 4)) for f, c in counts.most_common(n)]


def per_request_ms(shares: dict[str, float], cpu_s_per_1k: float) -> dict[str, float]:
    """Each category's CPU milliseconds per request, given the whole process's CPU seconds per 1,000 requests
    (1 s / 1k = 1 ms per request), shared among the categories other than ``WAITS`` (module doc)."""
    placed = sum(v for k, v in shares.items() if k != WAITS)
    if placed <= 0:
        return {}
    return {k: round(v / placed * cpu_s_per_1k, 2) for k, v in shares.items() if k != WAITS}


def wait_share(shares: dict[str, float]) -> float:
    """The share of the samples in ``WAITS`` (left out of ``per_request_ms``)."""
    return shares.get(WAITS, 0.0)


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every live thread of process ``pid`` (and of its child processes' threads),
    by thread id, from ``/proc/<pid>/task/<tid>/stat``; threads that end in between are lost (small)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for p in [pid, *_children(pid)]:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    return out


def _children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (``/proc/<pid>/task/*/children``)."""
    kids: list[int] = []
    with contextlib.suppress(OSError):  # the process (or a thread) ended while we read
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
    return kids


def main_thread_split(pid: int, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds between two ``thread_cpu_s`` snapshots: the event-loop threads (each process's main thread:
    thread id = a process id) vs every other thread (tokenizer pool, the tokenizers library's own threads)."""
    mains = {pid, *_children(pid)}
    loop = sum(after[t] - before.get(t, 0.0) for t in after if t in mains)
    other = sum(after[t] - before.get(t, 0.0) for t in after if t not in mains)
    return {"event_loop_threads_s": round(loop, 3), "other_threads_s": round(other, 3)}
