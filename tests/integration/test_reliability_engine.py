"""Engine faults through the real router process, with faults switched on the real fake engines at run time:
an engine answering 500 (retried on the other replica; when all do: 502 naming the cause), garbage (502 with a
message), hanging (504 after ``first_byte_timeout_s``; silent mid-stream: an SSE ``error`` after ``idle_timeout_s``), dying mid-stream (the client gets an SSE
``error`` event, never a hang or a silently cut stream), and every failure counted in /metrics.

Requests that were accepted by an engine but not started when it was killed are retried elsewhere: that case is
proved by ``tests/integration/test_router_failover.py``."""

from __future__ import annotations

import time

import httpx

from tests.helpers import metric, wait_until
from tests.integration.test_reliability_support import completion, engines, router


def _faults(url: str, **http: object) -> None:
    r = httpx.post(url + "/admin/faults", json=http, timeout=5)
    assert r.status_code == 200, r.text


def test_engine_faults_end_in_clear_errors_and_are_counted() -> None:
    with (
        engines(("e0", []), ("e1", [])) as engs,
        router(
            engs,
            "--policy",
            "round_robin",
            "--first-byte-timeout-s",
            "1.5",
            "--idle-timeout-s",
            "1.5",
            "--max-retries",
            "2",
            "--unhealthy-after",
            "2",
            "--migration-limit",
            "0",  # the stream failures below end the client's stream (test_migration.py: continued elsewhere)
        ) as r,
    ):
        u = r.url
        e0, e1 = engs
        with httpx.Client(timeout=20) as c:
            # -- 500 on one replica: retried on the other, the client never sees it ------------------------------
            _faults(e0.url, error_every=1)
            got = [c.post(u + "/v1/completions", json=completion(f"q{i} " * 20)) for i in range(4)]
            assert [g.status_code for g in got] == [200] * 4, [g.text for g in got]
            assert {g.headers["x-kvroute-replica"] for g in got} == {"e1"}
            assert metric(u, "kvroute_retries_total", reason="engine_500") >= 1
            # -- 500 everywhere: 502 saying what the engines answered ---------------------------------------------
            _faults(e1.url, error_every=1)
            bad = c.post(u + "/v1/completions", json=completion())
            assert bad.status_code == 502, bad.text
            assert "engine answered 500" in bad.json()["error"]["message"]
            assert metric(u, "kvroute_upstream_errors_total", reason="engine_500") >= 1
            for e in engs:
                _faults(e.url, error_every=0)
            # -- garbage: 502 with a message, for plain and streamed requests -------------------------------------
            for e in engs:
                _faults(e.url, garbage_every=1)
            for stream in (False, True):
                bad = c.post(u + "/v1/completions", json=completion(stream=stream))
                assert bad.status_code == 502, bad.text
                assert "not JSON" in bad.json()["error"]["message"]
            assert metric(u, "kvroute_upstream_errors_total", reason="bad_body") >= 2
            for e in engs:
                _faults(e.url, garbage_every=0)
            # -- hang: 504 after first_byte_timeout_s, clear message ---------------------------------------------
            for e in engs:
                _faults(e.url, stall_s=-1)
            t0 = time.monotonic()
            bad = c.post(u + "/v1/completions", json=completion())
            took = time.monotonic() - t0
            assert bad.status_code == 504, bad.text
            assert "first_byte_timeout_s" in bad.json()["error"]["message"]
            assert 1.4 <= took < 6.0, took
            t0 = time.monotonic()
            bad = c.post(u + "/v1/completions", json=completion(stream=True))
            assert bad.status_code == 504 and time.monotonic() - t0 < 6.0
            assert metric(u, "kvroute_upstream_errors_total", reason="first_byte_timeout") >= 2
            for e in engs:
                _faults(e.url, stall_s=0)
            ok = c.post(u + "/v1/completions", json=completion())
            assert ok.status_code == 200, ok.text
            # -- a stream that goes silent after its first token: SSE error after idle_timeout_s -----------------
            for e in engs:
                _faults(e.url, stall_mid_stream_s=-1)
            t0 = time.monotonic()
            resp = c.post(u + "/v1/completions", json=completion(max_tokens=20, stream=True))
            took = time.monotonic() - t0
            assert resp.status_code == 200 and resp.text.count("data: {") >= 1
            assert "event: error" in resp.text and "idle_timeout_s" in resp.text and "[DONE]" not in resp.text
            assert 1.4 <= took < 6.0, took
            assert metric(u, "kvroute_upstream_errors_total", reason="idle_timeout") >= 1
            for e in engs:
                _faults(e.url, stall_mid_stream_s=0)
            # -- killed mid-stream: the stream ends with an SSE error event ---------------------------------------
            for e in engs:  # at most 1 token streamed so far (idle test): an engine dies within 2-4 tokens
                _faults(e.url, die_after_tokens=4)
            t0 = time.monotonic()
            resp = c.post(u + "/v1/completions", json=completion(max_tokens=40, stream=True))
            assert time.monotonic() - t0 < 10.0
            assert resp.status_code == 200  # the stream had started: the error comes in-band
            body = resp.text
            assert body.count("data: {") >= 2  # tokens arrived before the engine died
            assert "event: error" in body and "mid-stream" in body and "[DONE]" not in body
            wait_until(
                lambda: sum(not e.proc.alive() for e in engs) == 1,
                timeout=5,
                what="exactly the engine that streamed died",
            )
            live = [e for e in engs if e.proc.alive()]
            _faults(live[0].url, die_after_tokens=0)
            assert metric(u, "kvroute_upstream_errors_total", reason="stream_broken") >= 1
            # the dead replica is excluded; new requests (plain and streamed) succeed on the other one
            wait_until(
                lambda: c.get(u + "/readyz").json().get("routable_replicas") == 1,
                timeout=10,
                what="dead engine excluded",
            )
            for i in range(3):
                ok = c.post(u + "/v1/completions", json=completion(f"after {i} " * 10, stream=i == 1))
                assert ok.status_code == 200 and ok.headers["x-kvroute-replica"] == live[0].name, ok.text
            # an Idempotency-Key needs Redis: without it the router says so (and serves nothing twice)
            idem = c.post(u + "/v1/completions", json=completion(), headers={"idempotency-key": "k1"})
            assert idem.status_code == 501 and "redis_url" in idem.json()["error"]["message"]
            assert r.proc.alive()
        out = r.proc.output()
    assert "Traceback" not in out, out[-3000:]
