"""``kvroute serve --workers N``: N worker processes on one port (router/workers.py).

- the workers agree: after a multi-turn workload sent through the pod's port, each worker is asked ``POST /route``
  for every session's next turn; they choose the same replica and see the same cached prefix (each keeps its own
  index from the engines' KV events, like router replicas: tests/integration/test_multi_router.py);
- ``/metrics`` on any worker answers every worker's metrics, labelled ``worker``;
- SIGTERM to the supervisor stops every worker; a killed supervisor leaves no worker behind; a worker that dies
  is started again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import psutil

from tests.helpers import Proc, wait_until
from tests.integration.test_multi_router import NAMES, Fleet, _idle, _view, fleet, workload

WORKERS = 2


@contextmanager
def pod(f: Fleet | None, *extra: str, workers: int = WORKERS) -> Iterator[tuple[Proc, str]]:
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
    with Proc.kvroute(*args) as proc:
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
