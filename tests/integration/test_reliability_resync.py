"""Control-plane faults under steady traffic through the real router process: the Kubernetes pod watch is cut
(and refused for a while) while a pod joins, and redis-server is killed and restarted. Not one request fails;
the pod that joined during the cut is found by the re-list and serves traffic; the router reconnects to Redis
and keeps its replica indices (real fake engines, the repository's fake Kubernetes API, a real redis-server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.fakes.k8s_api import FakeKubeAPI
from tests.helpers import Proc, free_port, metric, wait_http_ok, wait_until
from tests.integration.test_reliability_support import MODEL, completion, engines
from tests.redis_server import RedisServer

LABELS = {"kvroute.io/engine": "vllm", "app": "rel"}


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as server:
        yield server


def _replicas(url: str) -> dict[str, dict[str, object]]:
    return {r["name"]: r for r in httpx.get(url + "/replicas", timeout=2).json()["replicas"]}


def test_watch_cut_and_redis_restart_under_traffic(api: FakeKubeAPI) -> None:
    redis = RedisServer().start()
    router: Proc | None = None
    try:
        with engines(("e0", []), ("e1", []), ("e2", [])) as engs:
            for e in engs[:2]:
                api.add_pod(
                    e.name,
                    labels=LABELS,
                    ip="127.0.0.1",
                    annotations={
                        "kvroute.io/port": str(e.port),
                        "kvroute.io/model": MODEL,
                        "kvroute.io/kv-events-port": "off",
                    },
                )
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
                "bytes",
                "--kubernetes-enabled",
                "--kubernetes-api-host",
                api.url,
                "--kubernetes-label-selector",
                "app=rel",
                "--kubernetes-resync-interval-s",
                "30",
                "--probe-interval-s",
                "0.3",
                "--redis-url",
                redis.url,
                "--redis-retry-max-s",
                "0.5",
                "--log-level",
                "warning",
            )
            wait_http_ok(url + "/readyz", timeout=30)
            wait_until(lambda: len(_replicas(url)) == 2, 10, what="2 pods discovered")
            indices = {n: r["index"] for n, r in _replicas(url).items()}

            statuses: list[int] = []
            stop = threading.Event()

            def traffic() -> None:
                with httpx.Client(timeout=30) as c:
                    i = 0
                    while not stop.is_set():
                        try:
                            statuses.append(
                                c.post(
                                    url + "/v1/completions", json=completion(f"turn {i} " * 12)
                                ).status_code
                            )
                        except httpx.HTTPError:
                            statuses.append(-1)
                        i += 1
                        time.sleep(0.05)

            th = threading.Thread(target=traffic, daemon=True)
            th.start()
            try:
                # -- the watch is cut and refused; a pod joins meanwhile ---------------------------------------
                watches = metric(url, "kvroute_kubernetes_watches_total")
                api.reject_watches(True)
                api.cut_watches()
                e2 = engs[2]
                api.add_pod(
                    e2.name,
                    labels=LABELS,
                    ip="127.0.0.1",
                    annotations={
                        "kvroute.io/port": str(e2.port),
                        "kvroute.io/model": MODEL,
                        "kvroute.io/kv-events-port": "off",
                    },
                )
                time.sleep(1.0)  # traffic keeps flowing on the known replicas while discovery is blind
                api.reject_watches(False)
                wait_until(
                    lambda: "e2" in _replicas(url) and _replicas(url)["e2"]["state"] == "ready",
                    15,
                    what="pod added during the cut found by the re-list",
                )
                assert metric(url, "kvroute_kubernetes_watches_total") > watches
                wait_until(
                    lambda: metric(url, "kvroute_routed_total", replica="e2") > 0,
                    15,
                    what="traffic reaches the new replica",
                )
                # -- redis-server dies and comes back empty -----------------------------------------------------
                redis.stop()
                wait_until(lambda: metric(url, "kvroute_redis_available") == 0.0, 10, what="outage noticed")
                n_down = len(statuses)
                time.sleep(1.0)
                assert len(statuses) > n_down  # routing goes on without Redis
                redis.start()
                wait_until(lambda: metric(url, "kvroute_redis_available") == 1.0, 15, what="reconnected")
                assert metric(url, "kvroute_redis_reconnects_total") >= 1
                n_up = len(statuses)
                wait_until(lambda: len(statuses) > n_up + 5, 10, what="traffic after the restart")
            finally:
                stop.set()
                th.join(timeout=30)
            assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
            after = {n: r["index"] for n, r in _replicas(url).items()}
            assert {n: after[n] for n in indices} == indices  # indices survived the Redis restart
            out = router.stop()
            assert "Traceback" not in out, out[-3000:]
    finally:
        if router is not None:
            router.stop()
        redis.stop()
