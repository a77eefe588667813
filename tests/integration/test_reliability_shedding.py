"""Overload shedding through ``kvroute serve``: the router sheds new work only when its own work overloads it.

* starved from outside: the router runs at the lowest CPU priority beside CPU-hog processes (what two busy engines
  on its node or a pod's CPU limit do to it), with nothing but a steady light client of its own; its event loop lags
  far past ``max_event_loop_lag_s``, yet no request is shed (every one answered 200);
* overloaded by its own traffic (a flood of ``/route`` requests from many connections): shedding still works,
  ``503 event_loop_lag`` with ``Retry-After``, and the router admits work again once the flood ends.

The stall case (the router frozen with SIGSTOP: requests wait and are served) is in ``test_abuse_http.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson

from loadtest.abuse import Flood
from tests.helpers import metric, wait_until
from tests.integration.test_reliability_support import MODEL, completion, engines, router

#: a CPU hog: spins until its deadline (s since the epoch), so it never outlives the test even if not killed
_HOG = "import sys, time\nend = float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"


#: cgroup v1 CPU controller (CFS bandwidth: cpu.cfs_period_us / cpu.cfs_quota_us)
_CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


def _hog(max_s: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _HOG, str(time.time() + max_s)])


@contextlib.contextmanager
def cpu_quota_with_hogs(pid: int, hogs: int, period_s: float, quota_s: float, max_s: float) -> Iterator[str]:
    """Put process ``pid`` and ``hogs`` CPU-hog processes in one CPU cgroup limited to ``quota_s`` of CPU time
    per ``period_s`` (a pod's CPU limit, with busy neighbours in the pod spending it): the hogs spend the quota
    early in every period, then the kernel throttles the whole group, ``pid`` included, for the rest of it.
    Yields how (``cfs_quota``; ``sigstop`` where no CPU cgroup can be made: the same effect, the process stopped
    for the rest of every period). Everything is undone on exit; the hogs never outlive ``max_s`` seconds."""
    procs = [_hog(max_s) for _ in range(hogs)]
    group = _CPU_CGROUP / f"kvroute-test-{os.getpid()}-{pid}"
    try:
        try:
            group.mkdir()
        except OSError:
            with _stop_cycle(pid, period_s, period_s - quota_s):
                yield "sigstop"
            return
        try:
            (group / "cpu.cfs_period_us").write_text(str(int(period_s * 1e6)))
            (group / "cpu.cfs_quota_us").write_text(str(int(quota_s * 1e6)))
            for p in [*procs, pid]:
                (group / "cgroup.procs").write_text(str(getattr(p, "pid", p)))
            yield "cfs_quota"
        finally:
            for p in [*procs, pid]:
                with contextlib.suppress(OSError):
                    (_CPU_CGROUP / "cgroup.procs").write_text(str(getattr(p, "pid", p)))
            group.rmdir()
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


@contextlib.contextmanager
def _stop_cycle(pid: int, period_s: float, stopped_s: float) -> Iterator[None]:
    """SIGSTOP ``pid`` for ``stopped_s`` of every ``period_s`` in a thread while the block runs; SIGCONT at the end."""
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            try:
                done.wait(stopped_s)  # the throttled part of the period
            finally:
                os.kill(pid, signal.SIGCONT)
            done.wait(period_s - stopped_s)

    th = threading.Thread(target=cycle, daemon=True)
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join(timeout=10)
        os.kill(pid, signal.SIGCONT)


class SteadyClient:
    """One completion every ``every_s`` seconds in a thread (a light, steady load); records every status."""

    def __init__(self, url: str, every_s: float) -> None:
        self.url = url
        self.every_s = every_s
        self.statuses: list[int | str] = []
        self.codes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SteadyClient:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                try:
                    r = c.post(self.url + "/v1/completions", json=completion())
                    self.statuses.append(r.status_code)
                    if r.status_code != 200:
                        self.codes.append(r.json().get("error", {}).get("code", "?"))
                except httpx.HTTPError as exc:
                    self.statuses.append(type(exc).__name__)
                self._stop.wait(self.every_s)  # the client's pace


def _late_probes(url: str, over_s: float) -> float:
    """How many lag probes of the router ran later than ``over_s`` (a bucket bound of the histogram), so far."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5).text  # one scrape: the count and the bucket agree
    for fam in text_string_to_metric_families(text):
        if fam.name == "kvroute_event_loop_lag_seconds":
            samples = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
            return (
                samples[("kvroute_event_loop_lag_seconds_count", None)]
                - samples[("kvroute_event_loop_lag_seconds_bucket", str(over_s))]
            )
    raise AssertionError("no kvroute_event_loop_lag_seconds")


def test_router_starved_by_cpu_hogs_sheds_nothing() -> None:
    with (
        engines(("e0", [])) as engs,
        router(
            engs,
            "--max-event-loop-lag-s",
            "0.1",
            "--event-loop-lag-interval-s",
            "0.02",
            "--event-loop-lag-sustain-s",
            "0.5",
        ) as r,
    ):
        wait_until(
            lambda: httpx.post(r.url + "/v1/completions", json=completion(), timeout=30).status_code == 200,
            timeout=15,
            what="a first request served",
        )
        late0 = _late_probes(r.url, 0.1)
        with (
            SteadyClient(r.url, every_s=0.1) as client,
            cpu_quota_with_hogs(r.proc.popen.pid, hogs=2, period_s=0.3, quota_s=0.06, max_s=60) as how,
        ):
            n0 = len(client.statuses)
            wait_until(
                lambda: _late_probes(r.url, 0.1) - late0 >= 20 and len(client.statuses) - n0 >= 30,
                timeout=45,
                interval=0.5,
                what="20 router lag probes later than 0.1 s and 30 requests while starved",
            )
        late = _late_probes(r.url, 0.1) - late0
        lag_max = metric(r.url, "kvroute_event_loop_lag_max_seconds")
        own_max = metric(r.url, "kvroute_event_loop_own_lag_max_seconds")
        bad = [s for s in client.statuses[n0:] if s != 200]
        seen = (
            f"{how}: {late:.0f} probes late by > 0.1 s, lag max {lag_max:.3f} s, own lag max {own_max:.3f} s"
        )
        assert not bad, (bad[:10], client.codes[:10], seen)
        assert metric(r.url, "kvroute_rejected_total", reason="event_loop_lag") == 0, seen
        assert late >= 20 and lag_max > 0.1, seen  # the starvation happened: the loop lagged past the limit


def _route_body(ids: int) -> bytes:
    """A /route body of ``ids`` token ids (under 64 KiB: parsed on the loop, the connection kept on a 503)."""
    return orjson.dumps({"model": MODEL, "token_ids": [(i * 7919) % 50_000 for i in range(ids)]})


def test_router_overloaded_by_its_own_traffic_still_sheds() -> None:
    """300 connections sending /route bodies back to back saturate the router's loop with its own work. The short
    ``event_loop_lag_max_wait_s`` lets the flood reach the loop: with the default 2 s, requests wait at the gate
    for on-time probes and a closed-loop flood like this one is served at capacity, mostly without shedding."""
    with (
        engines(("e0", [])) as engs,
        router(
            engs,
            "--max-event-loop-lag-s",
            "0.1",
            "--event-loop-lag-interval-s",
            "0.02",
            "--event-loop-lag-sustain-s",
            "0.5",
            "--event-loop-lag-max-wait-s",
            "0.2",
            "--retry-after-s",
            "2",
        ) as r,
    ):
        body = _route_body(9000)
        assert len(body) < 64 * 1024
        assert httpx.post(r.url + "/route", content=body, timeout=30).status_code == 200
        flood = Flood(r.url, "/route", body, connections=300, max_s=60).start()
        try:
            wait_until(
                lambda: metric(r.url, "kvroute_rejected_total", reason="event_loop_lag") > 0,
                timeout=45,
                interval=0.5,
                what="requests shed while the router is flooded",
            )
        finally:
            res = flood.stop()
        assert res.statuses.get("503", 0) > 0 and res.codes.get("event_loop_lag", 0) > 0, res
        assert res.retry_after == {"2"}, res
        assert res.statuses.get("200", 0) > 0, res  # shedding kept some work going
        assert set(res.statuses) <= {"200", "503"}, res  # nothing else: no 500, no cut connection
        assert res.codes.keys() == {"event_loop_lag"}, res
        assert metric(r.url, "kvroute_requests_total", status="500") == 0
        # once the flood is over the router admits work again
        wait_until(
            lambda: httpx.post(r.url + "/route", content=body, timeout=30).status_code == 200,
            timeout=15,
            what="admitted again",
        )
