"""HTTP surface of the router: clear 4xx/5xx JSON errors, auth, body limit, backpressure, models, probes,
OpenAPI. The router runs in-process on a real socket; engines are tiny real HTTP servers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx

from tests.helpers import free_port, wait_until
from tests.unit.test_router_proxy import BODY, EngineState, ServerThread, ready, router_for, tiny_engine


def test_validation_errors_are_clear() -> None:
    st = EngineState()
    with ServerThread(tiny_engine(st)) as eng, router_for([eng.url]) as router:
        ready(router, 1)
        u = router.url
        r = httpx.post(u + "/v1/completions", content=b'{"model": "m", "prompt": ')
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = httpx.post(u + "/v1/chat/completions", json={"model": "m"})
        assert r.status_code == 422
        assert r.json()["error"]["param"] == "messages" and "Field required" in r.json()["error"]["message"]
        r = httpx.post(u + "/v1/chat/completions", json={"model": "m", "messages": [{"content": "x"}]})
        assert r.status_code == 422 and r.json()["error"]["param"] == "messages.0.role"
        r = httpx.post(u + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "model"
        r = httpx.post(u + "/v1/completions", json=[1, 2])
        assert r.status_code == 422
        r = httpx.post(u + "/route", json={"model": "m"})
        assert r.status_code == 422 and "exactly one of 'prompt', 'messages' or 'token_ids'" in r.text
        r = httpx.post(u + "/route", json={"model": "m", "token_ids": [1, -5]})
        assert r.status_code == 422 and r.json()["error"]["param"] == "token_ids.1"  # the bad element
        r = httpx.post(u + "/v1/completions", json={**BODY, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "known: m" in r.json()["error"]["message"]
        # form-encoded clients still work: the body is JSON whatever the content type says
        r = httpx.post(
            u + "/v1/completions",
            content=b'{"model": "m", "prompt": "hi"}',
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 200
        assert st.posts == 1  # none of the bad requests reached the engine


def test_body_limit_413() -> None:
    st = EngineState()
    with ServerThread(tiny_engine(st)) as eng, router_for([eng.url], "--max-request-bytes", "2048") as router:
        ready(router, 1)
        big = {"model": "m", "prompt": "x" * 5000}
        r = httpx.post(router.url + "/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        def chunks() -> Iterator[bytes]:  # no content-length: chunked transfer encoding
            for _ in range(10):
                yield b" " * 500

        r = httpx.post(router.url + "/v1/completions", content=chunks())
        assert r.status_code == 413
        assert st.posts == 0


def test_api_keys_and_admin_token() -> None:
    st = EngineState()
    with (
        ServerThread(tiny_engine(st)) as eng,
        router_for([eng.url], "--api-key", "k1,k2", "--admin-token", "adm") as router,
    ):
        wait_until(lambda: httpx.get(router.url + "/readyz").status_code == 200, timeout=10, what="ready")
        u = router.url
        assert httpx.post(u + "/v1/completions", json=BODY).status_code == 401
        r = httpx.post(u + "/v1/completions", json=BODY, headers={"authorization": "Bearer nope"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert (
            httpx.post(u + "/v1/completions", json=BODY, headers={"authorization": "Bearer k2"}).status_code
            == 200
        )
        assert httpx.get(u + "/v1/models").status_code == 401
        assert (
            httpx.get(u + "/replicas", headers={"authorization": "Bearer k1"}).status_code == 403
        )  # not admin
        assert httpx.get(u + "/replicas").status_code == 401
        assert httpx.get(u + "/replicas", headers={"authorization": "Bearer adm"}).status_code == 200
        assert httpx.get(u + "/index/stats").status_code == 401
        assert httpx.get(u + "/healthz").status_code == 200  # probes stay open
        # secrets never appear in the metrics / errors
        assert "adm" not in httpx.get(u + "/metrics").text.replace("kvroute", "")


def test_router_inflight_limit_429_and_replica_down_503() -> None:
    st = EngineState(mode="hang")
    with (
        ServerThread(tiny_engine(st)) as eng,
        router_for([eng.url], "--max-inflight-total", "1", "--retry-after-s", "3") as router,
    ):
        ready(router, 1)

        def first() -> None:
            try:
                httpx.post(router.url + "/v1/completions", json=BODY, timeout=1.5)
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=first, daemon=True)
        t.start()
        wait_until(lambda: st.posts == 1, timeout=5, what="first request at the engine")
        r = httpx.post(router.url + "/v1/completions", json=BODY)
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "overloaded"
        t.join(timeout=5)
    dead = f"http://127.0.0.1:{free_port()}"
    with router_for([dead]) as router:
        wait_until(lambda: httpx.get(router.url + "/healthz").status_code == 200, timeout=10, what="up")
        r = httpx.get(router.url + "/readyz")
        assert r.status_code == 503 and "no routable replica" in r.json()["reason"]
        r = httpx.post(router.url + "/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_routable_replica"
        assert "joining" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"


def test_models_replicas_openapi() -> None:
    st = EngineState()
    with ServerThread(tiny_engine(st)) as eng, router_for([eng.url]) as router:
        ready(router, 1)
        models = httpx.get(router.url + "/v1/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["m"]
        reps = httpx.get(router.url + "/replicas").json()["replicas"]
        assert reps[0]["name"] == "e0" and reps[0]["state"] == "ready" and reps[0]["kv_events"] is None
        assert reps[0]["load"]["inflight_requests"] == 0
        spec = httpx.get(router.url + "/openapi.json").json()
        for path in (
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/route",
            "/replicas",
            "/index/stats",
            "/metrics",
            "/healthz",
            "/readyz",
        ):
            assert path in spec["paths"], path
        schemas = spec["components"]["schemas"]
        body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == "#/components/schemas/ChatRequest"
        assert "messages" in schemas["ChatRequest"]["required"]
        assert "DecisionOut" in schemas and "ErrorResponse" in schemas
        route_ok = spec["paths"]["/route"]["post"]["responses"]["200"]["content"]["application/json"]
        assert route_ok["schema"]["$ref"] == "#/components/schemas/DecisionOut"
        # the routes that stream when asked document both answers (a streamed one is text/event-stream)
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate"):
            ok = spec["paths"][path]["post"]["responses"]["200"]["content"]
            assert set(ok) == {"application/json", "text/event-stream"}, path
        assert set(spec["paths"]["/v1/embeddings"]["post"]["responses"]["200"]["content"]) == {
            "application/json"
        }


def test_streams_count_against_the_router_limit_until_they_end() -> None:
    from tests.unit.test_router_proxy import metric

    st = EngineState(mode="slow_stream")
    with ServerThread(tiny_engine(st)) as eng, router_for([eng.url], "--max-inflight-total", "1") as router:
        ready(router, 1)
        with httpx.stream(
            "POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10
        ) as r:
            chunks = r.iter_raw()  # keep the iterator: dropping it closes the response
            assert next(chunks).startswith(b"data: ")
            assert metric(router, "kvroute_inflight_requests") == 1
            r2 = httpx.post(router.url + "/v1/completions", json=BODY)
            assert r2.status_code == 429
        # the client left: the stream's slot, the replica's in-flight count and the upstream are released
        wait_until(
            lambda: metric(router, "kvroute_inflight_requests") == 0, timeout=5, what="router slot free"
        )
        wait_until(
            lambda: metric(router, "kvroute_replica_inflight_requests") == 0,
            timeout=5,
            what="replica slot free",
        )
        wait_until(lambda: st.cancelled == 1, timeout=5, what="upstream cancelled")
        st.mode = "ok"
        assert httpx.post(router.url + "/v1/completions", json=BODY).status_code == 200


def test_replicas_show_health_of_static_replicas() -> None:
    """``GET /replicas`` reads health from the one membership front door: static replicas (probed by their own
    checker) show consecutive successes, or failures with the last error."""
    st = EngineState()
    refused = f"http://127.0.0.1:{free_port()}"
    with (
        ServerThread(tiny_engine(st)) as eng,
        router_for([eng.url, refused], "--unhealthy-after", "2") as router,
    ):
        ready(router, 1)

        def health() -> dict[str, dict[str, Any]]:
            reps = httpx.get(router.url + "/replicas").json()["replicas"]
            return {r["name"]: r["health"] for r in reps}

        wait_until(lambda: health()["e1"].get("consecutive_failures", 0) >= 2, timeout=10, what="e1 failures")
        now = health()
        assert now["e0"]["consecutive_failures"] == 0 and now["e0"]["last_error"] is None
        assert isinstance(now["e0"]["consecutive_successes"], int) and now["e0"]["consecutive_successes"] >= 1
        assert now["e1"]["consecutive_successes"] == 0 and now["e1"]["last_error"]


def test_reuse_of_a_decision() -> None:
    from policies.base import Candidate, PrefixHit, reuse_of

    cands = [
        Candidate(index=0, name="a", hit=PrefixHit(gpu=64, cpu=32)),
        Candidate(index=1, name="b"),
        Candidate(index=2, name="c", hit=PrefixHit(gpu=16)),
    ]
    best, traded, none = reuse_of(0, cands), reuse_of(2, cands), reuse_of(1, cands[1:2])
    assert (best.available_tokens, best.achieved_tokens, best.missed_tokens) == (96, 96, 0)
    assert (traded.available_tokens, traded.achieved_tokens, traded.missed_tokens) == (96, 16, 80)
    assert (none.available_tokens, none.achieved_tokens) == (0, 0)


def test_reuse_available_vs_achieved_in_metrics_and_route() -> None:
    """Round robin sends a repeated prompt away from the replica that holds it: the metrics count a workload miss
    (first request: nothing cached anywhere) and a traded decision (second: the other replica held it all)."""
    from tests.unit.test_router_proxy import metric

    st0, st1 = EngineState(), EngineState()
    prompt = {"model": "m", "prompt": "the same long system prompt " * 20, "max_tokens": 1}
    with (
        ServerThread(tiny_engine(st0)) as e0,
        ServerThread(tiny_engine(st1)) as e1,
        router_for([e0.url, e1.url]) as router,
    ):
        ready(router, 2)
        for _ in range(2):
            assert httpx.post(router.url + "/v1/completions", json=prompt, timeout=10).status_code == 200
        assert metric(router, "kvroute_reuse_decisions_total", {"outcome": "none"}) == 1
        assert metric(router, "kvroute_reuse_decisions_total", {"outcome": "traded"}) == 1
        available = metric(router, "kvroute_reuse_available_tokens_total")
        assert available > 0 and metric(router, "kvroute_reuse_achieved_tokens_total") == 0
        assert metric(router, "kvroute_reuse_missed_tokens_sum") == available

        out = httpx.post(router.url + "/route", json=prompt, timeout=10).json()
        cached = {c["name"]: c["cached_tokens"] for c in out["candidates"]}
        assert out["reuse"]["available_tokens"] == max(cached.values()) == available
        assert out["reuse"]["achieved_tokens"] == cached[out["chosen"]["name"]]
        assert out["reuse"]["missed_tokens"] == available - out["reuse"]["achieved_tokens"]
