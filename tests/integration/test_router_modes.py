"""Event mode and predicted mode coexist: a replica with KV events gets confirmed index entries, a replica
without them gets predicted entries from the router's own decisions (real engines, real router)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import Proc, free_port, wait_http_ok, wait_until
from tests.integration.test_router_fleet import MODEL, build_model_dir, start_engine, text


def test_confirmed_and_predicted_entries_coexist(tmp_path: Path) -> None:
    model_dir = build_model_dir(tmp_path / "model")
    with_events = start_engine("ev", model_dir, 0)
    without = start_engine("noev", model_dir, 1)
    router: Proc | None = None
    try:
        for e in (with_events, without):
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
            with_events.spec(),
            "--replica",
            f"name=noev,url={without.url},dialect=vllm,model={MODEL}",
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
        body = {"model": MODEL, "prompt": text(random.Random(7), 200), "max_tokens": 2}
        served = set()
        for _ in range(2):  # round robin: once on each replica
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            served.add(r.headers["x-kvroute-replica"])
        assert served == {"ev", "noev"}

        def candidates() -> dict[str, dict[str, Any]]:
            d = httpx.post(url + "/route", json=body, timeout=10).json()
            return {c["name"]: c["matched_tokens"] for c in d["candidates"]}

        wait_until(lambda: candidates()["ev"]["gpu"] >= 160, timeout=10, what="confirmed entries of ev")
        c = candidates()
        assert c["ev"]["predicted"] == 0  # event-fed: no predictions for it
        assert c["noev"]["predicted"] >= 160 and c["noev"]["total"] == c["noev"]["predicted"]
        reps = {r["name"]: r for r in httpx.get(url + "/replicas").json()["replicas"]}
        assert reps["ev"]["kv_events"]["healthy"] is True and reps["noev"]["kv_events"] is None
        stats = httpx.get(url + "/index/stats").json()
        assert stats["predicted_blocks"]["noev"] > 0 and stats["predicted_blocks"].get("ev", 0) == 0
    finally:
        if router is not None:
            router.stop()
        with_events.proc.stop()
        without.proc.stop()
