"""Locust trace replay against any OpenAI-compatible endpoint (open loop, streaming, TTFT per request).

Run locust as its own process (it monkey-patches with gevent; never import it next to redis/kubernetes)::

    .venv/bin/locust -f loadtest/locustfile.py --headless -u 1 -r 1 --host http://127.0.0.1:8080 \\
        --trace ../shared/traces/mooncake_conversation_trace.jsonl --time-scale 0.1 --max-requests 500 \\
        --replay-csv results/replay.csv --csv results/locust

or ``make loadtest HOST=http://127.0.0.1:8080 TRACE=path/to/trace.jsonl``. Without ``--trace`` a
generated workload (``--workload``, see ``sim.traces.WORKLOADS``) is used.

One locust user is the dispatcher: it walks the workload and sends every request at ``arrival_s`` (trace time
multiplied by ``--time-scale``), each on its own greenlet, whatever happened to earlier ones (open loop). Every
request streams; per request two custom locust events are fired:

* ``TTFT <path>``: milliseconds from send to the first streamed chunk,
* ``E2E <path>``: milliseconds from send to the end of the stream (failures are reported here),

so locust's own ``--csv`` stats and the web UI show TTFT next to end-to-end latency. ``--replay-csv PATH``
additionally writes one row per request to PATH and a one-row summary (TTFT / E2E p50 & p99 in seconds,
throughput in requests/s, errors) to ``PATH`` with ``_summary`` before the suffix. Locust quits by itself when the
workload is done (bound it with ``--run-time`` too). Every option is also an environment variable
(``KVROUTE_LOADTEST_<NAME>``).
"""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path
from typing import Any

import gevent
import requests
from gevent.pool import Group
from locust import User, constant, events, task
from locust import stats as locust_stats
from locust.exception import StopUser

from sim.replay import (
    ENDPOINT_PATHS,
    ReplayRequest,
    ReplayResult,
    count_events,
    request_body,
    request_headers,
    summarize,
)
from sim.workload import WorkloadOptions, build_workload

_started = False  # only the first user replays: the workload is sent once whatever -u says


@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]  # locust's hook is untyped
def _add_arguments(parser: Any) -> None:
    """Custom arguments (also settable as KVROUTE_LOADTEST_* environment variables)."""
    g = parser.add_argument_group("kvroute trace replay")
    g.add_argument(
        "--trace",
        default="",
        env_var="KVROUTE_LOADTEST_TRACE",
        help="Mooncake-format JSONL trace (empty: generated workload)",
    )
    g.add_argument(
        "--workload",
        default="agent",
        env_var="KVROUTE_LOADTEST_WORKLOAD",
        help="generated workload name when --trace is empty",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        env_var="KVROUTE_LOADTEST_TIME_SCALE",
        help="wall seconds per trace second (0.1 = 10x faster than the trace)",
    )
    g.add_argument(
        "--trace-start-s",
        type=float,
        default=0.0,
        env_var="KVROUTE_LOADTEST_TRACE_START_S",
        help="skip trace requests before this trace time (s)",
    )
    g.add_argument(
        "--trace-duration-s",
        type=float,
        default=0.0,
        env_var="KVROUTE_LOADTEST_TRACE_DURATION_S",
        help="replay only this many trace seconds (0 = all)",
    )
    g.add_argument(
        "--max-requests",
        type=int,
        default=0,
        env_var="KVROUTE_LOADTEST_MAX_REQUESTS",
        help="replay at most this many requests (0 = all)",
    )
    g.add_argument(
        "--max-output-tokens",
        type=int,
        default=0,
        env_var="KVROUTE_LOADTEST_MAX_OUTPUT_TOKENS",
        help="cap each request's output length, tokens (0 = as in the trace)",
    )
    g.add_argument(
        "--model", default="kvroute-fake", env_var="KVROUTE_LOADTEST_MODEL", help="model id sent in requests"
    )
    g.add_argument(
        "--endpoint",
        default="completions",
        choices=sorted(ENDPOINT_PATHS),
        env_var="KVROUTE_LOADTEST_ENDPOINT",
        help="OpenAI endpoint: completions or chat",
    )
    g.add_argument(
        "--replay-csv",
        default="",
        env_var="KVROUTE_LOADTEST_REPLAY_CSV",
        help="write one row per request here (+ a *_summary.csv next to it)",
    )
    g.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        env_var="KVROUTE_LOADTEST_TIMEOUT_S",
        help="per-request timeout (s)",
    )


class TraceReplayUser(User):
    """The dispatcher: replays the whole workload open loop, then stops the run."""

    wait_time = constant(0)

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=4096)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def _one(self, req: ReplayRequest, t0: float, results: list[ReplayResult]) -> None:
        opts = self.environment.parsed_options
        path = ENDPOINT_PATHS[opts.endpoint]
        url = (self.host or "").rstrip("/") + path
        start = time.perf_counter()
        res = ReplayResult(
            request_id=req.request_id,
            arrival_s=req.arrival_s,
            sent_s=start - t0,
            prompt_tokens=req.prompt_tokens,
        )
        try:
            with self.session.post(
                url,
                json=request_body(req, opts.model, opts.endpoint),
                headers=request_headers(req),
                stream=True,
                timeout=(10.0, opts.request_timeout_s),
            ) as resp:
                res.status = resp.status_code
                if resp.status_code >= 300:
                    res.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                else:
                    done = False
                    for chunk in resp.iter_content(chunk_size=None):
                        n, saw_done = count_events(chunk)
                        if n > 0 and res.ttft_s is None:
                            res.ttft_s = time.perf_counter() - start
                            self.environment.events.request.fire(
                                request_type="TTFT",
                                name=path,
                                response_time=res.ttft_s * 1000.0,
                                response_length=0,
                                exception=None,
                                context={},
                            )
                        res.chunks += n
                        done = done or saw_done
                    if res.ttft_s is None:
                        res.error = "empty stream"
                    elif not done:
                        res.error = "stream ended without [DONE]"
        except requests.RequestException as exc:
            res.error = f"{type(exc).__name__}: {exc}"[:200]
        res.e2e_s = time.perf_counter() - start
        self.environment.events.request.fire(
            request_type="E2E",
            name=path,
            response_time=res.e2e_s * 1000.0,
            response_length=res.chunks,
            exception=RuntimeError(res.error) if res.error else None,
            context={},
        )
        results.append(res)

    @task
    def replay_workload(self) -> None:
        """Replay the workload once (first user only), write the CSVs, then quit locust."""
        global _started
        if _started:
            raise StopUser()
        _started = True
        opts = self.environment.parsed_options
        workload = build_workload(
            WorkloadOptions(
                trace=opts.trace or None,
                workload=opts.workload,
                time_scale=opts.time_scale,
                start_s=opts.trace_start_s,
                duration_s=opts.trace_duration_s or None,
                max_requests=opts.max_requests or None,
                max_output_tokens=opts.max_output_tokens or None,
            )
        )
        print(
            f"kvroute replay: {len(workload)} requests over {workload[-1].arrival_s if workload else 0:.1f} s "
            f"against {self.host}",
            file=sys.stderr,
        )
        results: list[ReplayResult] = []
        group = Group()
        t0 = time.perf_counter()
        for req in workload:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                gevent.sleep(delay)
            group.spawn(self._one, req, t0, results)
        group.join()
        wall = time.perf_counter() - t0
        summary = summarize(results, wall)
        print(
            "kvroute replay summary: " + ", ".join(f"{k}={v}" for k, v in summary.as_dict().items()),
            file=sys.stderr,
        )
        if opts.replay_csv:
            write_csvs(Path(opts.replay_csv), results, summary.as_dict())
        # locust writes its --csv stats only every CSV_STATS_INTERVAL_SEC (no final write at shutdown): quit after
        # two writer rounds so the files hold every request of the replay
        gevent.spawn_later(2 * locust_stats.CSV_STATS_INTERVAL_SEC + 0.1, self.environment.runner.quit)
        raise StopUser()


def write_csvs(path: Path, results: list[ReplayResult], summary: dict[str, Any]) -> None:
    """Write per-request rows (seconds) to ``path`` and the summary row to ``<stem>_summary<suffix>``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = [
        "request_id",
        "arrival_s",
        "sent_s",
        "ttft_s",
        "e2e_s",
        "status",
        "error",
        "chunks",
        "prompt_tokens",
    ]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in results:
            w.writerow([getattr(r, c) if getattr(r, c) is not None else "" for c in cols])
    summary_path = path.with_name(f"{path.stem}_summary{path.suffix or '.csv'}")
    flat = {k: (";".join(v) if isinstance(v, list) else v) for k, v in summary.items()}
    with summary_path.open("w", newline="") as f:
        dw = csv.DictWriter(f, fieldnames=list(flat))
        dw.writeheader()
        dw.writerow(flat)
