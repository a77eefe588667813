"""The Settings tier table reaches the live router: ``kvroute serve`` in front of a real ``kvroute fake-engine``
process whose CPU tier is announced in a medium only the Settings table knows (``CXL``), as a store-only source.

* ``kv_medium_tiers`` reaches the KV-event subscriber: the CXL pages land in the cpu tier (unknown to the built-in
  table, they would be dropped as a miss);
* ``kv_tier_bandwidth_gbps`` / ``kv_tier_latency_s`` reach the replica profiles: the decision's ``R`` term is the
  cpu tokens' fetch over the configured link, to the microsecond;
* ``kv_tier_ttl_s`` reaches the store-only expiry: the cpu pages are forgotten seconds after their last store.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.helpers import Proc, free_port, start_fake_engine, wait_http_ok, wait_until

MODEL = "m"
BS = 16
CPU_GBPS = 10.0
CPU_LATENCY_S = 0.003
BYTES_PER_TOKEN = 147456.0  # the a100 profile's


@dataclass
class Served:
    url: str
    engine: Proc
    router: Proc


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine, port, ev, rp = start_fake_engine(
        "--model",
        MODEL,
        "--time-scale",
        "0",
        "--gpu-blocks",
        "24",
        "--cpu-blocks",
        "400",
        "--kv-medium",
        "cpu=CXL",
        "--kv-store-only",
    )
    router: Proc | None = None
    try:
        rport = free_port()
        spec = (
            f"name=r0,url=http://127.0.0.1:{port},events=tcp://127.0.0.1:{ev},"
            f"replay=tcp://127.0.0.1:{rp},dialect=vllm,model={MODEL}"
        )
        env = {
            "KVROUTE_KV_MEDIUM_TIERS": json.dumps({"CXL": "cpu"}),
            "KVROUTE_KV_TIER_BANDWIDTH_GBPS": json.dumps({"cpu": CPU_GBPS}),
            "KVROUTE_KV_TIER_LATENCY_S": json.dumps({"cpu": CPU_LATENCY_S}),
            "KVROUTE_KV_TIER_TTL_S": json.dumps({"cpu": 2.0}),
        }
        router = Proc.kvroute(
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(rport),
            "--policy",
            "ttft",
            "--replica",
            spec,
            "--probe-interval-s",
            "0.5",
            "--log-level",
            "warning",
            env=env,
        )
        url = f"http://127.0.0.1:{rport}"
        wait_http_ok(url + "/readyz", timeout=30)
        wait_until(
            lambda: all(
                r["kv_events"] and r["kv_events"]["connected"]
                for r in httpx.get(url + "/replicas").json()["replicas"]
            ),
            timeout=20,
            what="the KV-event feed connected",
        )
        yield Served(url, engine, router)
    finally:
        if router is not None:
            out = router.stop()
            if "Traceback" in out:
                print(out[-4000:])
        engine.stop()


def prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(16 * BS)]


def candidate(s: Served, ids: list[int]) -> dict[str, Any]:
    r = httpx.post(s.url + "/route", json={"model": MODEL, "prompt": ids}, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json()["candidates"][0])


def test_settings_tier_table_reaches_events_profiles_and_expiry(served: Served) -> None:
    for i in range(4):  # 4 prompts of 16 blocks on a 24-block GPU cache: the first ones move to the CXL tier
        r = httpx.post(
            served.url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt(i), "max_tokens": 1},
            timeout=30,
        )
        assert r.status_code == 200, r.text
    first = prompt(0)
    wait_until(
        lambda: candidate(served, first)["matched_tokens"]["cpu"] > 0, timeout=15, what="CXL pages in cpu"
    )
    c = candidate(served, first)
    cpu = c["matched_tokens"]["cpu"]
    assert c["matched_tokens"]["predicted"] == 0  # event-fed, not the router's own prediction
    expected_r = CPU_LATENCY_S + cpu * BYTES_PER_TOKEN / (CPU_GBPS * 1e9)
    assert c["parts"]["R"] == pytest.approx(expected_r, rel=1e-6)
    page = httpx.get(served.url + "/metrics", timeout=5).text
    assert 'kvroute_kv_event_medium_blocks_total{medium="CXL",op="stored",replica="r0",tier="cpu"}' in page
    # store-only: forgotten kv_tier_ttl_s['cpu'] after the last store (the default would keep them 600 s)
    wait_until(
        lambda: candidate(served, first)["matched_tokens"]["cpu"] == 0,
        timeout=15,
        what="the store-only cpu pages to expire",
    )
