"""Backpressure of the router process: per-replica and global in-flight limits (429 + Retry-After), a bounded
router queue (a request waits at most max_queue_wait_s: then 503 + Retry-After), and SIGTERM (stop accepting,
finish the in-flight stream within shutdown_grace_s, exit). Real engines stalled with their fault knobs."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
import pytest

from tests.helpers import metric, wait_until
from tests.integration.test_reliability_support import completion, engines, router


def _background(url: str, body: dict[str, Any], out: list[httpx.Response | Exception]) -> threading.Thread:
    def go() -> None:
        try:
            out.append(httpx.post(url + "/v1/completions", json=body, timeout=30))
        except Exception as exc:  # noqa: BLE001 - recorded for the assertions
            out.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _inflight(url: str) -> dict[str, int]:
    return {
        r["name"]: r["load"]["inflight_requests"]
        for r in httpx.get(url + "/replicas", timeout=5).json()["replicas"]
    }


def test_inflight_limits_and_bounded_queue() -> None:
    with engines(("e0", ["--fault-stall-s", "4"]), ("e1", ["--fault-stall-s", "4"])) as engs:
        # -- per replica: both replicas at 1 in flight -> 429 with Retry-After ----------------------------------
        with router(engs, "--max-inflight-per-replica", "1", "--retry-after-s", "2") as r:
            held: list[httpx.Response | Exception] = []
            threads = [_background(r.url, completion(f"hold {i} " * 10), held) for i in range(2)]
            wait_until(
                lambda: _inflight(r.url) == {"e0": 1, "e1": 1}, timeout=3.5, what="one request per replica"
            )
            t0 = time.monotonic()
            over = httpx.post(r.url + "/v1/completions", json=completion(), timeout=10)
            assert time.monotonic() - t0 < 1.0  # rejected at once, not queued behind the stall
            assert over.status_code == 429 and over.headers["retry-after"] == "2"
            assert (
                over.json()["error"]["code"] == "overloaded"
                and "in flight" in over.json()["error"]["message"]
            )
            for t in threads:
                t.join(timeout=15)
            assert [getattr(h, "status_code", h) for h in held] == [200, 200]
        # -- global: 1 in flight, 1 may queue for <= 2 s --------------------------------------------------------
        for e in engs:
            assert httpx.post(e.url + "/admin/faults", json={"stall_s": 3}, timeout=5).status_code == 200
        with router(
            engs,
            "--max-inflight-total",
            "1",
            "--max-queued-requests",
            "1",
            "--max-queue-wait-s",
            "2",
            "--retry-after-s",
            "1",
        ) as r:
            first: list[httpx.Response | Exception] = []
            t1 = _background(
                r.url, completion("first " * 10), first
            )  # holds the only slot ~3 s (engine stall)
            wait_until(lambda: sum(_inflight(r.url).values()) == 1, timeout=5, what="first request in flight")
            t_start = time.monotonic()
            queued: list[httpx.Response | Exception] = []
            t2 = _background(r.url, completion("second " * 10), queued)  # waits in the queue, times out
            wait_until(lambda: metric(r.url, "kvroute_queued_requests") == 1, timeout=5, what="one queued")
            full = httpx.post(r.url + "/v1/completions", json=completion(), timeout=10)  # queue full -> 429
            assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text
            t2.join(timeout=10)
            waited = time.monotonic() - t_start
            assert len(queued) == 1 and isinstance(queued[0], httpx.Response), queued
            assert queued[0].status_code == 503 and queued[0].headers["retry-after"] == "1", queued[0].text
            assert queued[0].json()["error"]["code"] == "queue_timeout"
            assert "max_queue_wait_s" in queued[0].json()["error"]["message"]
            assert 1.8 <= waited < 3.5, waited  # bounded by max_queue_wait_s
            # a request that queues while the slot is about to free is admitted (waits < 2 s) and served
            late = httpx.post(r.url + "/v1/completions", json=completion("late " * 10), timeout=30)
            assert late.status_code == 200, late.text
            t1.join(timeout=10)
            assert getattr(first[0], "status_code", first) == 200
            assert metric(r.url, "kvroute_queue_waited_requests") >= 2
            assert metric(r.url, "kvroute_rejected_total", reason="queue_timeout") == 1
            assert metric(r.url, "kvroute_rejected_total", reason="router_inflight_limit") == 1
            assert metric(r.url, "kvroute_queued_requests") == 0


def test_sigterm_stops_accepting_and_finishes_the_stream() -> None:
    with engines(("e0", []), time_scale=1.0) as engs:  # real-time decode: the stream lasts seconds
        r_cm = router(engs, "--shutdown-grace-s", "20")
        r = r_cm.__enter__()
        try:
            chunks: list[tuple[float, bytes]] = []
            done = threading.Event()

            def stream() -> None:
                body = completion("drain me " * 10, max_tokens=150, stream=True)
                with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=60) as resp:
                    for chunk in resp.iter_raw():
                        chunks.append((time.monotonic(), chunk))
                done.set()

            th = threading.Thread(target=stream, daemon=True)
            th.start()
            wait_until(lambda: len(chunks) >= 2, timeout=10, what="stream started")
            t_term = time.monotonic()
            r.proc.popen.send_signal(signal.SIGTERM)

            # stops accepting: new connections are refused quickly
            def refused() -> bool:
                try:
                    httpx.get(r.url + "/healthz", timeout=0.5)
                    return False
                except httpx.ConnectError:
                    return True

            wait_until(refused, timeout=5, what="listening socket closed")
            th.join(timeout=30)
            assert done.is_set()
            body = b"".join(c for _, c in chunks)
            assert body.rstrip().endswith(b"data: [DONE]") and b"event: error" not in body
            if not any(t > t_term for t, _ in chunks):
                pytest.fail("the stream finished before SIGTERM: the test proves nothing (engine too fast)")
            r.proc.popen.wait(timeout=10)  # and then the router exits by itself, well within the grace period
            assert time.monotonic() - t_term < 20
        finally:
            r_cm.__exit__(None, None, None)
