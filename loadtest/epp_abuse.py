"""What hostile gateway streams cost the endpoint picker: ``kvroute epp`` (with an API key configured) and N streams
that send request headers and a body in messages of ``--message-bytes`` but never end it; the picker's resident
memory before and at its peak, and how the streams were answered.

    python -m loadtest.epp_abuse --json [--streams 20] [--body-mib 16] [--message-bytes 65536] [--keyed]
                                        [--plaintext] [--epp-arg=--flag ...]

Without ``--keyed`` the streams carry no key (the picker should refuse them at the headers, before holding any
body); with it they are authorized and their bodies are held until the picker's limits cut them
(``max_request_bytes``, ``epp_request_timeout_s``, ``epp_min_body_rate_bytes_per_s``). ``--message-bytes 2``
measures what bodies in tiny messages cost. ``--plaintext`` dials h2c (a picker started with
``--grpc-insecure``, or one that serves only plaintext); ``--epp-arg`` passes a flag to ``kvroute epp``. The only
replica is a closed port: nothing is ever routed. JSON on stdout; the picker is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from fakes.fleet import HOST, ManagedProcess
from fakes.ports import free_port
from loadtest.epp_gateway import header_map, stub_for

KEY = "abuse-test-key"
MIB = 1 << 20


def start_picker(log_dir: Path, extra: list[str]) -> tuple[ManagedProcess, str, int]:
    """``kvroute epp`` with an API key and one dead replica; (process, HTTP URL, gRPC port) once it answers."""
    port, grpc_port = free_port(), free_port()
    args = [
        sys.executable,
        "-m",
        "router.cli",
        "epp",
        "--host",
        HOST,
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--tokenizer-mode",
        "bytes",
        "--api-key",
        KEY,
        "--log-level",
        "warning",
        "--replica",
        f"name=e0,url=http://{HOST}:{free_port()},model=m",
        *extra,
    ]
    proc = ManagedProcess(args, "kvroute-epp", log_dir)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url, grpc_port
        except httpx.HTTPError:
            pass
        if not proc.alive():
            break
        time.sleep(0.1)
    proc.stop()
    raise RuntimeError(f"kvroute epp did not start:\n{proc.tail()}")


def _messages(
    keyed: bool, body_bytes: int, message_bytes: int, hold: threading.Event, sent: threading.Event
) -> Iterator[Any]:
    """Request headers, then the body in pieces, never ended (``sent`` released once all went out, or the stream
    ended first); then the stream stays open until ``hold`` is set."""
    headers = {":path": "/v1/completions", ":method": "POST", ":authority": "gateway"}
    if keyed:
        headers["authorization"] = f"Bearer {KEY}"
    yield pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map(headers)))
    piece = b"x" * message_bytes
    try:
        for _ in range(body_bytes // message_bytes):
            if hold.is_set():
                return
            yield pb.ProcessingRequest(request_body=pb.HttpBody(body=piece))
    finally:
        sent.set()
    hold.wait()


def _answers(call: Any, outcome: Counter[str], sent: threading.Event) -> None:
    """Read a stream's answers: how it was answered (an ImmediateResponse's status, or none). A stream answered
    before its body went out counts as sent (gRPC stops taking its messages)."""
    try:
        for msg in call:
            if msg.WhichOneof("response") == "immediate_response":
                outcome[str(msg.immediate_response.status.code)] += 1
                sent.set()
                return
    except Exception as exc:  # the stream was cancelled at the end, or failed
        outcome[type(exc).__name__] += 1


def _rss_settle(pid: int, timeout_s: float = 120.0, still_s: float = 3.0) -> int:
    """The process's peak RSS once it stopped growing for ``still_s`` seconds (or after ``timeout_s``), bytes."""
    ps = psutil.Process(pid)
    peak = int(ps.memory_info().rss)
    last_growth = time.monotonic()
    deadline = last_growth + timeout_s
    while time.monotonic() < deadline and time.monotonic() - last_growth < still_s:
        time.sleep(0.25)
        rss = int(ps.memory_info().rss)
        if rss > peak + MIB // 4:
            last_growth = time.monotonic()
        peak = max(peak, rss)
    return peak


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the picker, send the streams, measure; returns the result row."""
    log_dir = Path(tempfile.mkdtemp(prefix="kvroute-epp-abuse-"))
    proc, url, grpc_port = start_picker(log_dir, list(args.epp_arg))
    hold = threading.Event()
    outcome: Counter[str] = Counter()
    calls: list[Any] = []
    try:
        rss0 = psutil.Process(proc.pid).memory_info().rss
        body_bytes = int(args.body_mib * MIB)
        sent = [threading.Event() for _ in range(args.streams)]
        t0 = time.monotonic()
        for i in range(args.streams):
            _, stub = stub_for(grpc_port, HOST, tls=not args.plaintext)
            messages = _messages(args.keyed, body_bytes, args.message_bytes, hold, sent[i])
            call = stub.Process(messages, timeout=600)
            threading.Thread(target=_answers, args=(call, outcome, sent[i]), daemon=True).start()
            calls.append(call)
        for done in sent:  # every stream sent its body, or was answered before
            done.wait(timeout=600)
        peak = _rss_settle(proc.pid)
        active = _metric(url, "kvroute_epp_streams_active")
        seconds = time.monotonic() - t0
        hold.set()
        for call in calls:
            call.cancel()
        after = _rss_after_close(proc.pid, url)
        return {
            "streams": args.streams,
            "keyed": args.keyed,
            "body_bytes_per_stream": body_bytes,
            "message_bytes": args.message_bytes,
            "rss_start_mb": round(rss0 / MIB, 1),
            "rss_peak_mb": round(peak / MIB, 1),
            "rss_growth_mb": round((peak - rss0) / MIB, 1),
            "answered": dict(outcome),
            "streams_open_at_peak": active,
            "rss_after_close_mb": round(after / MIB, 1),
            "seconds": round(seconds, 1),
        }
    finally:
        hold.set()
        for call in calls:
            call.cancel()
        proc.stop()


def _rss_after_close(pid: int, url: str, timeout_s: float = 30.0) -> int:
    """The process's RSS once every stream is closed and 2 s have passed, bytes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _metric(url, "kvroute_epp_streams_active") not in (0.0, None):
        time.sleep(0.2)
    time.sleep(2.0)
    return int(psutil.Process(pid).memory_info().rss)


def _metric(url: str, name: str) -> float | None:
    try:
        for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    except httpx.HTTPError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.epp_abuse", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--body-mib", type=float, default=16.0, help="body bytes sent per stream, MiB")
    parser.add_argument("--message-bytes", type=int, default=65536, help="bytes per body message")
    parser.add_argument("--keyed", action="store_true", help="send the API key (authorized streams)")
    parser.add_argument("--plaintext", action="store_true", help="dial h2c instead of TLS")
    parser.add_argument("--epp-arg", action="append", default=[], help="a flag for kvroute epp (repeatable)")
    parser.add_argument("--json", action="store_true", help="JSON on stdout (the default output)")
    args = parser.parse_args(argv)
    if args.streams < 1 or args.message_bytes < 1 or args.body_mib <= 0:
        parser.error("--streams, --message-bytes and --body-mib must be positive")
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
