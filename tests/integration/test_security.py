"""Security of the router process: admin token (401 missing / 403 wrong), client API keys, a separate engine key
checked by the engine itself (``fake-engine --api-key``), secrets never in the logs (debug level, access log, a
Redis URL with a password that fails), CORS off by default (real processes on loopback)."""

from __future__ import annotations

import httpx

from tests.helpers import free_port
from tests.integration.test_reliability_support import completion, engines, router

ADMIN = "admin-Secret-7f3a"
CLIENT = "client-Secret-91bc"
ENGINE = "engine-Secret-c4d2"
REDIS_PW = "redis-Secret-55e0"


def test_tokens_keys_and_no_secret_in_logs() -> None:
    dead_redis = f"redis://:{REDIS_PW}@127.0.0.1:{free_port()}/0"  # nothing listens: warnings get logged
    with engines(("e0", ["--api-key", ENGINE])) as engs:
        with router(
            engs,
            "--admin-token",
            ADMIN,
            "--api-key",
            CLIENT,
            "--engine-api-key",
            ENGINE,
            "--redis-url",
            dead_redis,
            "--redis-timeout-s",
            "0.2",
            "--log-level",
            "debug",
            "--access-log",
        ) as r:
            u = r.url
            client = {"authorization": f"Bearer {CLIENT}"}
            admin = {"authorization": f"Bearer {ADMIN}"}
            # client API key
            assert httpx.post(u + "/v1/completions", json=completion()).status_code == 401
            resp = httpx.post(u + "/v1/completions", json=completion(), headers={"authorization": "Bearer x"})
            assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
            assert resp.json()["error"]["code"] == "unauthorized"
            # the engine requires ENGINE: a 200 proves the router sent the engine key (not the client's)
            resp = httpx.post(u + "/v1/completions", json=completion(), headers=client, timeout=30)
            assert resp.status_code == 200, resp.text
            assert (
                httpx.post(engs[0].url + "/v1/completions", json=completion(), headers=client).status_code
                == 401
            )
            stream = httpx.post(
                u + "/v1/completions", json=completion(stream=True), headers=client, timeout=30
            )
            assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
            assert httpx.get(u + "/v1/models", headers=client).status_code == 200
            assert httpx.post(u + "/route", json={"model": "m", "token_ids": [1, 2, 3]}).status_code == 401
            # admin endpoints: 401 without a bearer token, 403 with a wrong one (a client key is not admin)
            for path in ("/replicas", "/index/stats"):
                assert httpx.get(u + path).status_code == 401, path
                wrong = httpx.get(u + path, headers=client)
                assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "forbidden", path
                assert httpx.get(u + path, headers=admin).status_code == 200, path
            # probes and metrics stay open (Kubernetes and Prometheus do not carry tokens)
            assert httpx.get(u + "/healthz").status_code == 200
            assert httpx.get(u + "/readyz").status_code == 200
            metrics = httpx.get(u + "/metrics").text
            # CORS is off by default: no preflight answer, no allow-origin header on responses
            pre = {"origin": "https://evil.example", "access-control-request-method": "POST"}
            assert (
                "access-control-allow-origin" not in httpx.options(u + "/v1/completions", headers=pre).headers
            )
            resp = httpx.post(
                u + "/v1/completions",
                json=completion(),
                timeout=30,
                headers={**client, "origin": "https://evil.example"},
            )
            assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers
        out = r.proc.output()
    assert "kvroute started" in out  # the settings were logged (masked)
    assert "Redis unavailable" in out  # the Redis URL was used and failed: its errors were logged
    for secret in (ADMIN, CLIENT, ENGINE, REDIS_PW):
        assert secret not in out, f"secret {secret!r} leaked into the router log"
        assert secret not in metrics


def test_cors_on_only_for_configured_origins() -> None:
    pre = {"origin": "https://evil.example", "access-control-request-method": "POST"}
    with engines(("e0", [])) as engs, router(engs, "--cors-origin", "https://app.example") as r:
        ok = httpx.options(r.url + "/v1/completions", headers={**pre, "origin": "https://app.example"})
        assert ok.headers.get("access-control-allow-origin") == "https://app.example"
        bad = httpx.options(r.url + "/v1/completions", headers=pre)
        assert bad.headers.get("access-control-allow-origin") != "https://evil.example"
