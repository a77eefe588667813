"""The router service with Kubernetes discovery: `kvroute serve --kubernetes-enabled` against the fake API server,
real fake engines, real HTTP. Pods appear, serve traffic, fail health probes, and leave."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fakes.k8s_api import FakeKubeAPI
from tests.helpers import Proc, free_port, wait_http_ok, wait_until

SEL = {"kvroute.io/engine": "vllm", "app": "engine"}


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as server:
        yield server


def _engine(port: int, events: int) -> Proc:
    return Proc.kvroute(
        "fake-engine",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        "m",
        "--dialect",
        "vllm",
        "--kv-events-format",
        "vllm",
        "--kv-events-port",
        str(events),
        "--time-scale",
        "0.05",
        "--gpu-blocks",
        "512",
        "--block-size",
        "16",
        "--seed",
        "1",
    )


def _replicas(url: str) -> dict[str, dict[str, Any]]:
    body = httpx.get(url + "/replicas", timeout=2).json()
    return {r["name"]: r for r in body["replicas"]}


def test_router_follows_pods(api: FakeKubeAPI) -> None:
    ports = [free_port() for _ in range(2)]
    evs = [free_port() for _ in range(2)]
    rport = free_port()
    engines = [_engine(p, e) for p, e in zip(ports, evs, strict=True)]
    router = None
    try:
        for p in ports:
            wait_http_ok(f"http://127.0.0.1:{p}/health")
        for i, (p, e) in enumerate(zip(ports, evs, strict=True)):
            api.add_pod(
                f"vllm-{i}",
                labels=SEL,
                ip="127.0.0.1",
                annotations={
                    "kvroute.io/port": str(p),
                    "kvroute.io/kv-events-port": str(e),
                    "kvroute.io/model": "m",
                },
            )
        router = Proc.kvroute(
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(rport),
            "--policy",
            "ttft",
            "--tokenizer-mode",
            "bytes",
            "--kubernetes-enabled",
            "--kubernetes-api-host",
            api.url,
            "--kubernetes-namespace",
            "default",
            "--kubernetes-label-selector",
            "app=engine",
            "--kubernetes-resync-interval-s",
            "1",
            "--probe-interval-s",
            "0.3",
        )
        url = f"http://127.0.0.1:{rport}"
        wait_http_ok(url + "/readyz", timeout=30)
        reps = wait_until(lambda: len(_replicas(url)) == 2 and _replicas(url), 5.0, what="2 replicas")
        assert isinstance(reps, dict)  # the condition's value: the replicas
        assert {n: r["index"] for n, r in reps.items()} == {"vllm-0": 0, "vllm-1": 1}
        r = httpx.post(
            url + "/v1/completions", json={"model": "m", "prompt": "hello " * 40, "max_tokens": 4}, timeout=30
        )
        assert r.status_code == 200, r.text
        # /replicas shows the health bookkeeping of discovered replicas too (probes every 0.3 s)
        health = wait_until(
            lambda: (h := _replicas(url)["vllm-0"]["health"]) and h["consecutive_successes"] >= 1 and h,
            5.0,
            what="vllm-0 health",
        )
        assert isinstance(health, dict)  # the condition's value: the health record
        assert health == {
            "consecutive_failures": 0,
            "consecutive_successes": health["consecutive_successes"],
            "last_error": None,
        }

        # an engine dies: health probes exclude it, requests keep succeeding on the other one
        engines[1].kill()
        wait_until(lambda: _replicas(url)["vllm-1"]["state"] == "unhealthy", 5.0, what="vllm-1 unhealthy")
        down = _replicas(url)["vllm-1"]["health"]
        assert down["consecutive_failures"] >= 3 and down["consecutive_successes"] == 0, (
            down
        )  # unhealthy_after
        assert down["last_error"], down
        for i in range(3):
            r = httpx.post(
                url + "/v1/completions",
                json={"model": "m", "prompt": f"q{i} " * 30, "max_tokens": 2},
                timeout=30,
            )
            assert r.status_code == 200, r.text

        # the pod is deleted while the watch is cut: the re-list removes it
        api.reject_watches(True)
        api.cut_watches()
        api.delete_pod("vllm-1")
        wait_until(lambda: "vllm-1" not in _replicas(url), 5.0, what="vllm-1 removed")
        api.reject_watches(False)
        api.set_ready("vllm-0", False)
        wait_until(lambda: _replicas(url)["vllm-0"]["state"] == "draining", 3.0, what="vllm-0 draining")
        r = httpx.post(
            url + "/v1/completions", json={"model": "m", "prompt": "x " * 20, "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 503
        api.set_ready("vllm-0", True)
        wait_until(lambda: _replicas(url)["vllm-0"]["state"] == "ready", 3.0, what="vllm-0 ready")
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert "kvroute_kubernetes_lists_total" in metrics
    finally:
        out = router.stop() if router is not None else ""
        for eng in engines:
            eng.stop()
    assert "Traceback" not in out, out[-3000:]
