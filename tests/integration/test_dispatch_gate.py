"""The cache-first dispatch gate through the real service, in front of real fake-engine processes.

1. Order: while a long cold prefill runs on the replica, a cold request and then a warm one (its prefix cached
   on the replica) wait in the router; when the long one's first token comes back, the warm one is sent first
   and gets its first token first.
2. Fail-over: requests waiting for a replica that stops answering (SIGSTOP: its health probes time out) are
   routed to another replica and complete.
3. Non-streamed requests are never held (their first token is not visible to the router).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.helpers import Proc, free_port, metric, wait_http_ok, wait_until
from tests.integration.test_router_fleet import MODEL, Engine, build_model_dir, text

LIMIT = 16  # tokens: any cold prompt is over it, so the next request waits until the first token


@dataclass
class Gated:
    url: str
    engines: list[Engine]
    router: Proc | None


def start_engine(name: str, model_dir: Path, seed: int) -> Engine:
    port, events, replay = free_port(), free_port(), free_port()
    # time scale 1: an A100's prefill timing (about 0.1 s per 1k tokens), long enough to queue behind
    proc = Proc.kvroute(
        "fake-engine",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        MODEL,
        "--dialect",
        "vllm",
        "--kv-events-format",
        "vllm",
        "--kv-events-port",
        str(events),
        "--kv-replay-port",
        str(replay),
        "--time-scale",
        "1",
        "--profile",
        "a100",
        "--block-size",
        "16",
        "--model-path",
        str(model_dir),
        "--seed",
        str(seed),
    )
    return Engine(name, port, events, replay, proc)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model"))


def start(model_dir: Path, n: int, *extra: str) -> Gated:
    engines = [start_engine(f"r{i}", model_dir, i) for i in range(n)]
    router: Proc | None = None
    try:
        for e in engines:
            wait_http_ok(e.url + "/health", timeout=30)
        port = free_port()
        args = [
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--tokenizer-mode",
            "hf",
            "--tokenizer-path",
            str(model_dir),
            "--scrape-interval-s",
            "0.5",
            "--probe-interval-s",
            "0.3",
            "--probe-timeout-s",
            "0.5",
            "--unhealthy-after",
            "1",
            "--log-level",
            "warning",
            "--dispatch-limit-tokens",
            str(LIMIT),
            *extra,
        ]
        for e in engines:
            args += ["--replica", e.spec()]
        router = Proc.kvroute(*args)
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/readyz", timeout=30)
        wait_until(
            lambda: httpx.get(url + "/readyz").json().get("routable_replicas") == n,
            timeout=20,
            what=f"{n} routable replicas",
        )
        wait_until(
            lambda: all(
                r["kv_events"] and r["kv_events"]["connected"]
                for r in httpx.get(url + "/replicas").json()["replicas"]
            ),
            timeout=20,
            what="KV event feeds connected",
        )
        return Gated(url, engines, router)
    except BaseException:
        stop(Gated("", engines, router))
        raise


def stop(g: Gated) -> None:
    """Stop the router and the engines (a frozen engine is woken first so it can exit)."""
    for e in g.engines:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(e.proc.popen.pid, signal.SIGCONT)
    out = g.router.stop() if g.router is not None else ""
    for e in g.engines:
        e.proc.stop()
    if "Traceback" in out:
        print(out[-4000:])


@dataclass
class Call:
    """A completion request sent from its own thread; records when its first chunk arrived."""

    url: str
    prompt: str
    stream: bool = True
    first_s: float | None = None
    status: int | None = None
    replica: str | None = None
    body: str = ""
    error: str | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": 4, "stream": self.stream}
        try:
            with (
                httpx.Client(timeout=60) as c,
                c.stream("POST", self.url + "/v1/completions", json=body) as r,
            ):
                self.status = r.status_code
                self.replica = r.headers.get("x-kvroute-replica")
                for chunk in r.iter_bytes():
                    if chunk and self.first_s is None:
                        self.first_s = time.monotonic()
                    self.body += chunk.decode(errors="replace")
        except Exception as exc:  # recorded, asserted on by the test
            self.error = repr(exc)

    def join(self, timeout: float = 60) -> Call:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"request still running after {timeout}s"
        return self


def waiting(url: str) -> float:
    return metric(url, "kvroute_dispatch_waiting_requests")


@pytest.fixture
def one(model_dir: Path) -> Iterator[Gated]:
    g = start(model_dir, 1)
    try:
        yield g
    finally:
        stop(g)


def test_the_warm_request_is_sent_first(one: Gated) -> None:
    rnd = random.Random(7)
    lead, warm_part = text(rnd, 200), text(rnd, 500)
    warm = Call(one.url, lead + " " + warm_part).join()
    assert warm.status == 200, warm.body
    probe = {"model": MODEL, "prompt": lead + " " + warm_part + " tail"}
    wait_until(
        lambda: (
            httpx.post(one.url + "/route", json=probe).json()["candidates"][0]["matched_tokens"]["gpu"] >= 500
        ),
        timeout=10,
        what="the warm prefix confirmed by KV events",
    )

    big = Call(one.url, text(rnd, 9000))  # a long cold prefill (about 1 s)
    wait_until(
        lambda: metric(one.url, "kvroute_dispatch_sent_prefill_tokens") > LIMIT,
        timeout=10,
        what="the long request sent",
    )
    cold = Call(one.url, lead + " " + text(rnd, 600))
    wait_until(lambda: waiting(one.url) == 1, timeout=5, what="the cold request waiting")
    hot = Call(one.url, lead + " " + warm_part + " " + text(rnd, 10))
    wait_until(lambda: waiting(one.url) == 2, timeout=5, what="the warm request waiting")
    assert big.first_s is None, "the long prefill ended before both requests queued: the test proves nothing"

    for c in (big, cold, hot):
        c.join()
        assert c.status == 200 and c.error is None, (c.status, c.error, c.body[:300])
    assert hot.first_s is not None and cold.first_s is not None and big.first_s is not None
    assert big.first_s < hot.first_s < cold.first_s
    assert metric(one.url, "kvroute_dispatch_reordered_requests") == 1
    assert metric(one.url, "kvroute_dispatch_queued_requests") == 2
    assert waiting(one.url) == 0
    assert metric(one.url, "kvroute_dispatch_sent_prefill_tokens") == 0  # every sent request was counted back


def test_non_streamed_requests_are_not_held(one: Gated) -> None:
    rnd = random.Random(8)
    big = Call(one.url, text(rnd, 9000))
    wait_until(
        lambda: metric(one.url, "kvroute_dispatch_sent_prefill_tokens") > LIMIT,
        timeout=10,
        what="the long request sent",
    )
    plain = Call(one.url, text(rnd, 300), stream=False).join()
    assert plain.status == 200, plain.body
    big.join()
    assert big.status == 200
    assert metric(one.url, "kvroute_dispatch_queued_requests") == 0


def test_requests_waiting_for_a_frozen_replica_fail_over(model_dir: Path) -> None:
    # consistent hashing on the shared lead sends every request to the same replica
    g = start(model_dir, 2, "--policy", "consistent_hash", "--policy-param", "load_factor=100")
    try:
        rnd = random.Random(9)
        lead = text(rnd, 300)
        home = httpx.post(g.url + "/route", json={"model": MODEL, "prompt": lead + " x"}).json()["chosen"][
            "name"
        ]
        engine = next(e for e in g.engines if e.name == home)
        big = Call(g.url, lead + " " + text(rnd, 9000))
        wait_until(
            lambda: metric(g.url, "kvroute_dispatch_sent_prefill_tokens") > LIMIT,
            timeout=10,
            what="the long request sent",
        )
        os.killpg(engine.proc.popen.pid, signal.SIGSTOP)  # it stops answering, probes included
        queued = [Call(g.url, lead + " " + text(rnd, 100)) for _ in range(2)]
        wait_until(
            lambda: metric(g.url, "kvroute_dispatch_failed_over_requests") == 2,
            timeout=20,
            what="both waiting requests failed over",
        )
        for c in queued:
            c.join()
            assert c.status == 200 and c.error is None, (c.status, c.error, c.body[:300])
            assert c.replica is not None and c.replica != home
        assert waiting(g.url) == 0
        os.killpg(engine.proc.popen.pid, signal.SIGCONT)
        big.join()
        assert big.status is not None or big.error is not None  # it ended one way or the other
    finally:
        stop(g)
