"""``kvroute serve --workers N``: N worker processes on one port (router/workers.py).

- the workers agree: after a multi-turn workload sent through the pod's port, each worker is asked ``POST /route``
  for every session's next turn; they choose the same replica and see the same cached prefix (each keeps its own
  index from the engines' KV events, like router replicas: tests/integration/test_multi_router.py);
- ``/metrics`` on any worker answers every worker's metrics, labelled ``worker``;
- SIGTERM to the supervisor stops every worker, whichever of its threads the kernel gives the signal; a killed supervisor leaves no worker behind (and its directory is
  removed by the next supervisor); a worker that dies is started again, one that hangs (SIGSTOP) too, and one
  stopped briefly then resumed does not shed requests for its stop;
- a ``/metrics`` scrape with thousands of tenants holds no serving loop for long (the merge runs in the
  supervisor).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.helpers import Proc, metric, wait_until
from tests.integration.test_multi_router import NAMES, Fleet, _idle, _view, fleet, workload

WORKERS = 2


@contextmanager
def pod(
    f: Fleet | None, *extra: str, workers: int = WORKERS, env: dict[str, str] | None = None
) -> Iterator[tuple[Proc, str]]:
    """``kvroute serve --workers N`` on a port it picks (port 0), in front of ``f``'s engines with KV events (or
    of no engine); yields the supervisor and the base URL once every worker answers."""
    args = [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--workers",
        str(workers),
        "--policy",
        "ttft",
        "--tokenizer-mode",
        "bytes",
        "--probe-interval-s",
        "0.5",
        "--scrape-interval-s",
        "0.2",
        "--probe-timeout-s",
        "5",
        "--unhealthy-after",
        "10",
        *extra,
    ]
    for name, (p, ev) in ((n, f.engines[n]) for n in NAMES) if f is not None else ():
        args += [
            "--replica",
            f"name={name},url=http://127.0.0.1:{p},dialect=vllm,model=m,events=tcp://127.0.0.1:{ev}",
        ]
    with Proc.kvroute(*args, env=env) as proc:
        found = wait_until(
            lambda: re.search(r"listening on port (\d+)", proc.output()), 30, what="supervisor port"
        )
        assert isinstance(found, re.Match)
        url = f"http://127.0.0.1:{found.group(1)}"
        wait_until(
            lambda: len(per_worker(url, "GET", "/healthz", None, deadline_s=2.0)) == workers,
            60,
            interval=0.2,
            what="every worker up",
        )
        yield proc, url


def per_worker(
    url: str, method: str, path: str, body: Any, workers: int = WORKERS, deadline_s: float = 20.0
) -> dict[str, httpx.Response]:
    """One answer of each worker (``x-kvroute-worker``) to the same request: new connections until every worker
    answered (the kernel spreads connections over the workers' sockets) or ``deadline_s`` passed."""
    out: dict[str, httpx.Response] = {}

    deadline = time.monotonic() + deadline_s
    while len(out) < workers and time.monotonic() < deadline:
        with httpx.Client(timeout=10) as c:  # a new connection each time
            r = c.request(method, url + path, json=body)
        out.setdefault(r.headers.get("x-kvroute-worker", "?"), r)
    return out


def test_workers_agree_on_decisions_and_share_metrics() -> None:
    with fleet() as f, pod(f) as (_, url):
        prompts = workload(seed=21, sessions=12, turns=3)
        agree = same_views = probes = 0
        with ThreadPoolExecutor(len(prompts)) as threads:
            for k in range(3):
                if k > 0:
                    for turns in prompts:
                        ans = per_worker(
                            url, "POST", "/route", {"model": "m", "prompt": turns[k], "max_tokens": 2}
                        )
                        assert len(ans) == WORKERS and all(r.status_code == 200 for r in ans.values()), ans
                        picks = {r.json()["chosen"]["name"] for r in ans.values()}
                        views = {_view(r.json()) for r in ans.values()}
                        agree += len(picks) == 1
                        same_views += len(views) == 1
                        probes += 1

                def send(s: int, k: int = k) -> int:
                    with httpx.Client(timeout=30) as c:
                        return c.post(
                            url + "/v1/completions",
                            json={"model": "m", "prompt": prompts[s][k], "max_tokens": 2},
                        ).status_code

                assert set(threads.map(send, range(len(prompts)))) == {200}

                def same_index() -> bool:  # every worker has applied the same KV events
                    stats = per_worker(url, "GET", "/index/stats", None)
                    blocks = {json.dumps(r.json().get("blocks"), sort_keys=True) for r in stats.values()}
                    return len(stats) == WORKERS and len(blocks) == 1

                wait_until(same_index, 30, interval=0.1, what="the workers' indices in sync")

                def idle_everywhere() -> bool:  # every worker's load view shows the turn finished
                    ans = per_worker(
                        url, "POST", "/route", {"model": "m", "prompt": prompts[0][0], "max_tokens": 2}
                    )
                    return len(ans) == WORKERS and all(_idle(r.json()) for r in ans.values())

                wait_until(idle_everywhere, 30, interval=0.1, what="an idle fleet in every worker's view")
        assert probes == 24
        assert same_views / probes >= 0.95, (same_views, probes)
        assert agree / probes >= 0.95, (agree, probes)
        # the pod's metrics: every worker's, labelled, from whichever worker answers
        text = httpx.get(url + "/metrics", timeout=10).text
        served = re.findall(
            r'kvroute_requests_total\{route="/v1/completions",status="200",worker="(\d)"\} (\S+)', text
        )
        assert {w for w, _ in served} == {"0", "1"}, served
        assert sum(float(v) for _, v in served) == len(prompts) * 3
        # streams are relayed the direct way in workers too (their send only tags the response head)
        for s in range(4):
            with httpx.Client(timeout=30) as c:
                r = c.post(
                    url + "/v1/completions",
                    json={"model": "m", "prompt": prompts[s][0], "max_tokens": 24, "stream": True},
                )
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text[-200:]
        text = httpx.get(url + "/metrics", timeout=10).text
        direct = re.findall(r'kvroute_relayed_pieces_total\{path="direct",worker="\d"\} (\S+)', text)
        assert sum(float(v) for v in direct) > 0, text[-2000:]


def _workers_of(proc: Proc) -> list[psutil.Process]:
    return [c for c in psutil.Process(proc.popen.pid).children() if "router.cli" in " ".join(c.cmdline())]


def test_sigterm_stops_every_worker_and_a_dead_worker_is_replaced() -> None:
    with pod(None) as (proc, url):
        first = _workers_of(proc)
        assert len(first) == WORKERS
        first[0].kill()  # a worker dies: started again, the pod keeps serving
        wait_until(
            lambda: (
                len(_workers_of(proc)) == WORKERS and first[0].pid not in {p.pid for p in _workers_of(proc)}
            ),
            30,
            interval=0.1,
            what="the dead worker replaced",
        )
        wait_until(
            lambda: len(per_worker(url, "GET", "/healthz", None, deadline_s=2.0)) == WORKERS,
            60,
            interval=0.2,
            what="every worker answering again",
        )
        workers = _workers_of(proc)
        os.kill(proc.popen.pid, signal.SIGTERM)  # the supervisor only, not its process group
        assert proc.popen.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, alive


def test_a_killed_supervisor_leaves_no_worker() -> None:
    with pod(None) as (proc, _):
        workers = _workers_of(proc)
        assert len(workers) == WORKERS
        os.kill(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(timeout=10)
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, alive


# ---------------------------------------------------------------------------------------------------------
# hung, stopped and resumed workers; the supervisor's directory; /metrics with many tenants
# ---------------------------------------------------------------------------------------------------------


class _Pinned:
    """One keep-alive connection to each worker (new connections until every worker holds one)."""

    def __init__(self, url: str, workers: int = WORKERS) -> None:
        self.clients: dict[str, httpx.Client] = {}
        deadline = time.monotonic() + 30
        while len(self.clients) < workers and time.monotonic() < deadline:
            c = httpx.Client(base_url=url, timeout=60)
            w = c.get("/healthz").headers["x-kvroute-worker"]
            if w in self.clients:
                c.close()
            else:
                self.clients[w] = c
        assert len(self.clients) == workers, self.clients

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def _pid_of_worker(proc: Proc, worker: str) -> psutil.Process:
    """The process of worker number ``worker`` (its environment names it)."""
    for p in _workers_of(proc):
        if p.environ().get("KVROUTE_WORKER_INDEX") == worker:
            return p
    raise AssertionError(f"no worker {worker}")


def _heartbeat_age(via: httpx.Client, worker: str) -> float:
    """Seconds since ``worker``'s last heartbeat, asked through ``via`` (a connection to another worker: a scrape
    that lands on a stopped worker would wait for it)."""
    found = re.search(
        rf'kvroute_worker_heartbeat_age_seconds\{{worker="{worker}"\}} (\S+)', via.get("/metrics").text
    )
    return float(found.group(1)) if found else 0.0


def _route(c: httpx.Client) -> httpx.Response:
    return c.post("/route", json={"model": "m", "prompt": "hello " * 40, "max_tokens": 2})


def test_a_worker_stopped_then_resumed_does_not_shed_for_its_stop() -> None:
    with fleet() as f, pod(f) as (proc, url):
        pinned = _Pinned(url)
        try:
            target = _pid_of_worker(proc, "0")
            assert _route(pinned.clients["0"]).status_code == 200
            target.suspend()  # SIGSTOP
            try:
                via = pinned.clients["1"]
                wait_until(lambda: _heartbeat_age(via, "0") >= 1.5, 20, interval=0.1, what="a 1.5 s stop")
                with ThreadPoolExecutor(1) as pool:  # a request waits on the stopped worker's connection
                    waiting = pool.submit(_route, pinned.clients["0"])
                    target.resume()  # SIGCONT
                    first = waiting.result(timeout=30)
            finally:
                target.resume()
            after = [
                _route(pinned.clients["0"]) for _ in range(10)
            ]  # within the lag window (1 s) of the stop
            codes = [first.status_code] + [r.status_code for r in after]
            assert codes == [200] * 11, [(r.status_code, r.text[:200]) for r in (first, *after)]
            assert (
                target.is_running()
                and 'kvroute_worker_restarts_total{reason="hung"} 0' in via.get("/metrics").text
            )
        finally:
            pinned.close()


def test_a_hung_worker_is_replaced() -> None:
    with fleet() as f, pod(f, "--worker-heartbeat-timeout-s", "2") as (proc, url):
        pinned = _Pinned(url)
        target = _pid_of_worker(proc, "1")
        pinned.close()
        t0 = time.monotonic()
        target.suspend()  # hangs for good: its socket takes connections nobody answers
        try:
            wait_until(lambda: not target.is_running(), 30, interval=0.1, what="the hung worker killed")
            replaced_s = time.monotonic() - t0
            wait_until(
                lambda: len(per_worker(url, "GET", "/healthz", None, deadline_s=2.0)) == WORKERS,
                60,
                interval=0.2,
                what="both workers answering again",
            )
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):
                target.resume()
        assert replaced_s < 2 + 2 + 1, replaced_s  # timeout + the supervisor's 1 s check + margin
        assert metric(url, "kvroute_worker_restarts_total", reason="hung") == 1
        assert metric(url, "kvroute_worker_restarts_total", reason="exited") == 0
        print(f"hung worker replaced {replaced_s:.2f} s after SIGSTOP")


def test_a_killed_supervisor_leaves_no_directory_behind(tmp_path: Path) -> None:
    env = {"TMPDIR": str(tmp_path)}

    def dirs() -> set[str]:
        return {p.name for p in tmp_path.glob("kvroute-workers-*")}

    with pod(None, env=env) as (proc, _):
        workers = _workers_of(proc)
        first = dirs()
        assert len(first) == 1
        os.kill(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(timeout=10)
        psutil.wait_procs(workers, timeout=30)
        assert dirs() == first  # nothing could remove it: the next supervisor does
    with pod(None, env=env) as (proc, _):
        second = dirs()
        assert len(second) == 1 and not second & first, (first, second)
        os.kill(proc.popen.pid, signal.SIGTERM)
        assert proc.popen.wait(timeout=60) == 0
    assert dirs() == set()


def _tgkill(pid: int, tid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to one thread ``tid`` of process ``pid`` (the kernel's ``tgkill``; ``os.kill`` lets the
    kernel choose the thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, tid, int(sig)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def test_sigterm_taken_by_any_thread_of_the_supervisor_stops_it_cleanly() -> None:
    """A process's SIGTERM may land on any of its threads that does not block it, and the supervisor has threads
    it never started (numpy's OpenBLAS pool, at import): SIGTERM sent to each of its other threads in turn still
    stops it the graceful way (exit 0, workers stopped, its directory removed), never by the signal's default
    action (exit -15), and never stays pending on a thread nobody reads."""
    with pod(None) as (proc, _):
        pid = proc.popen.pid
        workers = _workers_of(proc)
        others = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
        assert others, "the supervisor has its metrics thread at least"
        directory = re.search(r"directory (\S+?)\)", proc.output())
        assert directory is not None, proc.output()[-2000:]
        for tid in others:
            with contextlib.suppress(ProcessLookupError):  # it already stopped: the thread is gone
                _tgkill(pid, tid, signal.SIGTERM)
        assert proc.popen.wait(timeout=60) == 0, proc.output()[-2000:]
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive
        assert not Path(directory.group(1)).exists()


def _probe_healthz(url: str, worker: str, stop: threading.Event, out: list[float]) -> None:
    """/healthz latencies (s) of one worker, back to back on one keep-alive connection, until ``stop``."""
    pinned = _Pinned(url)
    try:
        c = pinned.clients[worker]
        while not stop.is_set():
            t0 = time.perf_counter()
            assert c.get("/healthz").status_code == 200
            out.append(time.perf_counter() - t0)
    finally:
        pinned.close()


def _scrape(url: str) -> tuple[int, float]:
    """One /metrics scrape by curl (outside this process): (bytes, seconds)."""
    t0 = time.perf_counter()
    done = subprocess.run(
        ["curl", "-sS", "--max-time", "60", "-o", "-", url + "/metrics"], capture_output=True, check=True
    )
    return len(done.stdout), time.perf_counter() - t0


def _fill_tenants(url: str, tenants: int) -> None:
    """One request per tenant ``tenant-0`` .. through the pod, from 16 connections (both workers get some)."""

    def send(i: int) -> None:
        with httpx.Client(timeout=30) as c:
            for t in range(i, tenants, 16):
                r = c.post(
                    url + "/v1/completions",
                    json={"model": "m", "prompt": "hi there", "max_tokens": 1},
                    headers={"x-kvroute-tenant": f"tenant-{t}"},
                )
                assert r.status_code == 200, r.text

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(send, range(16)))


def _cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def test_a_metrics_scrape_holds_no_serving_loop_with_thousands_of_tenants() -> None:
    """5,000 tenants (each worker keeps tenant_metrics_max_labels = 1,000 of them) under ``--workers 2``: each
    worker's CPU over 5 scrapes of /metrics, background work included (an upper bound of what the scrapes cost
    its serving loop: rendering its own exposition in slices, and for one of them relaying the merged text), stays
    < 50 ms per scrape; and /healthz on each worker keeps answering while /metrics is scraped (the merge runs in
    the supervisor)."""
    tenants = int(os.environ.get("KVROUTE_TEST_TENANTS", "5000"))
    with fleet() as f, pod(f) as (proc, url):
        _fill_tenants(url, tenants)
        size, _ = _scrape(url)
        text = httpx.get(url + "/metrics").text
        sets = re.findall(r'kvroute_tenant_label_sets\{worker="(\d)"\} (\S+)', text)
        # the kernel spreads the 16 connections over the workers unevenly; each keeps at most 1,000 series, so at
        # least one worker is full whatever the spread
        assert max(float(v) for _, v in sets) >= min(tenants, 1000), sets
        procs = {w: _pid_of_worker(proc, w) for w in ("0", "1")}
        cpu0 = {w: _cpu_s(p) for w, p in procs.items()}
        scrapes = [_scrape(url)[1] for _ in range(5)]
        cost_ms = {w: round((_cpu_s(p) - cpu0[w]) / len(scrapes) * 1000, 1) for w, p in procs.items()}
        stop = threading.Event()
        lat: dict[str, list[float]] = {w: [] for w in procs}
        probes = [threading.Thread(target=_probe_healthz, args=(url, w, stop, lat[w])) for w in lat]
        for t in probes:
            t.start()
        try:
            wait_until(lambda: all(len(v) > 20 for v in lat.values()), 30, what="probes running")
            n0 = {w: len(v) for w, v in lat.items()}
            scrapes += [_scrape(url)[1] for _ in range(5)]
        finally:
            stop.set()
            for t in probes:
                t.join(timeout=30)
        during = {w: sorted(v[n0[w] :]) for w, v in lat.items()}
        print(
            f"{tenants} tenants: exposition {size / 1e6:.1f} MB; scrapes {[round(s, 3) for s in scrapes]} s; "
            f"worker CPU per scrape (background included) {cost_ms} ms; /healthz during scrapes: worst "
            f"{ {w: round(v[-1] * 1000, 1) for w, v in during.items()} } ms, median "
            f"{ {w: round(v[len(v) // 2] * 1000, 2) for w, v in during.items()} } ms"
        )
        assert all(c < 50 for c in cost_ms.values()), cost_ms
        assert all(len(v) >= 5 and v[-1] < 0.25 for v in during.values()), during  # old: >= 1 s per scrape
