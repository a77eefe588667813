"""An engine killed while requests are queued on it: the requests not yet started are retried on another
replica and succeed (real fake-engine processes, real router process, SIGKILL)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from tests.helpers import Proc, free_port, metric, wait_http_ok, wait_until
from tests.integration.test_router_fleet import MODEL, Engine, build_model_dir, start_engine


def _inflight(url: str) -> dict[str, int]:
    reps = httpx.get(url + "/replicas", timeout=5).json()["replicas"]
    return {r["name"]: r["load"]["inflight_requests"] for r in reps}


async def test_engine_killed_with_queued_requests_they_are_retried_elsewhere(tmp_path: Path) -> None:
    model_dir = build_model_dir(tmp_path / "model")
    # "victim" holds every request 30 s before queueing it (they are accepted but not started)
    victim = start_engine("victim", model_dir, 0, "--fault-stall-s", "30")
    healthy: Engine | None = None
    router: Proc | None = None
    try:
        healthy = start_engine("healthy", model_dir, 1)
        for e in (victim, healthy):
            wait_http_ok(e.url + "/health", timeout=30)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        router = Proc.kvroute(
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--tokenizer-mode",
            "hf",
            "--tokenizer-path",
            str(model_dir),
            "--replica",
            victim.spec(),
            "--replica",
            healthy.spec(),
            "--max-retries",
            "2",
            "--probe-interval-s",
            "0.5",
            "--log-level",
            "warning",
            "--connect-timeout-s",
            "10",
            "--probe-timeout-s",
            "5",
        )
        wait_until(
            lambda: httpx.get(url + "/readyz").json().get("routable_replicas") == 2,
            timeout=30,
            what="2 routable replicas",
        )

        async with httpx.AsyncClient(timeout=30) as client:

            async def one(i: int) -> httpx.Response:
                body = {
                    "model": MODEL,
                    "prompt": f"request number {i} about the cache",
                    "max_tokens": 3,
                    "stream": i % 2 == 1,
                }
                return await client.post(url + "/v1/completions", json=body)

            tasks = [asyncio.create_task(one(i)) for i in range(6)]
            # wait until the victim holds its share of the requests (stalled: no byte answered yet)
            await asyncio.to_thread(
                wait_until, lambda: _inflight(url)["victim"] == 3, 15, 0.02, "3 requests queued on the victim"
            )
            t_kill = time.monotonic()
            victim.proc.kill()
            responses = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            recovered_in = time.monotonic() - t_kill
        assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
        assert all(r.headers["x-kvroute-replica"] == "healthy" for r in responses)
        for r in responses:  # the streamed ones are complete SSE streams
            if r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.rstrip().endswith("data: [DONE]") and "event: error" not in r.text
            else:
                assert r.json()["usage"]["completion_tokens"] == 3
        assert metric(url, "kvroute_retries_total") >= 3
        assert recovered_in < 10
        # the failed connections count against the victim: it leaves the routable set
        wait_until(
            lambda: _inflight(url) == {"victim": 0, "healthy": 0}, timeout=10, what="in-flight released"
        )
        wait_until(
            lambda: httpx.get(url + "/readyz").json().get("routable_replicas") == 1,
            timeout=15,
            what="victim marked unhealthy",
        )
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 1})
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "healthy"
    finally:
        if router is not None:
            router.stop()
        victim.proc.stop()
        if healthy is not None:
            healthy.proc.stop()
