"""Idempotency-Key through the router process with a real redis-server: stored answer replayed (the engine is not
called again), 409 while the first is in flight, 422 for a reused key with another body, completed streams
replayed whole and abandoned ones not run twice,
failed requests release their key, Redis down -> 503 for keyed requests only (routing continues), and back after
a Redis restart. Without Redis configured: 501 (see test_reliability_engine)."""

from __future__ import annotations

import threading
import time

import httpx

from tests.helpers import metric, wait_until
from tests.integration.test_reliability_support import completion, engines, router
from tests.redis_server import RedisServer


def _routed(url: str) -> float:
    return metric(url, "kvroute_routed_total")


def test_idempotency_keys_with_redis() -> None:
    server = RedisServer().start()
    try:
        with (
            engines(("e0", [])) as engs,
            router(
                engs, "--redis-url", server.url, "--redis-retry-max-s", "0.5", "--retry-after-s", "1"
            ) as r,
        ):
            u, eng = r.url, engs[0]
            wait_until(
                lambda: metric(u, "kvroute_redis_available") == 1.0, timeout=10, what="redis connected"
            )
            with httpx.Client(timeout=30) as c:
                key = {"idempotency-key": "order-1"}
                body = completion("pay the invoice " * 6)
                first = c.post(u + "/v1/completions", json=body, headers=key)
                assert first.status_code == 200, first.text
                n = _routed(u)
                again = c.post(u + "/v1/completions", json=body, headers=key)
                assert again.status_code == 200 and again.content == first.content
                assert again.headers["idempotent-replayed"] == "true"
                assert again.headers["x-kvroute-replica"] == "e0"
                assert _routed(u) == n  # answered from the store: nothing was routed or sent to the engine
                # the same key with another body is a client bug
                other = c.post(u + "/v1/completions", json=completion("something else"), headers=key)
                assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
                bad = c.post(u + "/v1/completions", json=body, headers={"idempotency-key": "x" * 300})
                assert bad.status_code == 400

                # -- in flight: 409 with Retry-After, then the stored answer -----------------------------------
                assert c.post(eng.url + "/admin/faults", json={"stall_s": 2}).status_code == 200
                slow: list[httpx.Response] = []
                key2 = {"idempotency-key": "order-2"}
                t = threading.Thread(
                    target=lambda: slow.append(
                        httpx.post(u + "/v1/completions", json=body, headers=key2, timeout=30)
                    ),
                    daemon=True,
                )
                t.start()
                wait_until(
                    lambda: metric(u, "kvroute_inflight_requests") == 1, timeout=5, what="first in flight"
                )
                dup = c.post(u + "/v1/completions", json=body, headers=key2)
                assert dup.status_code == 409 and dup.headers["retry-after"] == "1", dup.text
                assert dup.json()["error"]["code"] == "idempotency_in_flight"
                t.join(timeout=20)
                assert slow and slow[0].status_code == 200
                after = c.post(u + "/v1/completions", json=body, headers=key2)
                assert after.status_code == 200 and after.content == slow[0].content
                assert c.post(eng.url + "/admin/faults", json={"stall_s": 0}).status_code == 200

                # -- a completed stream is stored and replayed whole; an abandoned one is not run twice ---------
                skey = {"idempotency-key": "stream-1"}
                s1 = c.post(u + "/v1/completions", json=completion(stream=True), headers=skey)
                assert s1.status_code == 200 and s1.text.rstrip().endswith("data: [DONE]")
                n = _routed(u)
                s2 = wait_until(
                    lambda: (
                        (
                            x := c.post(u + "/v1/completions", json=completion(stream=True), headers=skey)
                        ).status_code
                        == 200
                        and x
                    ),
                    timeout=5,
                    what="stream stored",
                )
                assert isinstance(s2, httpx.Response)  # the condition's value: the replayed response
                assert s2.headers["idempotent-replayed"] == "true"
                assert s2.headers["content-type"].startswith("text/event-stream")
                assert s2.content == s1.content  # the same events, byte for byte
                assert _routed(u) == n
                # the client leaves mid-stream: the generation ran (partly), so the key stays taken, not stored
                assert c.post(eng.url + "/admin/faults", json={"stall_mid_stream_s": 30}).status_code == 200
                lkey = {"idempotency-key": "stream-2"}
                with c.stream(
                    "POST", u + "/v1/completions", json=completion("left early", stream=True), headers=lkey
                ) as partial:
                    assert partial.status_code == 200
                    next(partial.iter_raw())  # the first token arrived; now hang up
                assert c.post(eng.url + "/admin/faults", json={"stall_mid_stream_s": 0}).status_code == 200

                # until the abandoned stream's cleanup (a task) reaches Redis the key is still in flight (409
                # idempotency_in_flight): wait for the final error code, not just the status
                def _abandoned() -> httpx.Response | None:
                    x = c.post(
                        u + "/v1/completions", json=completion("left early", stream=True), headers=lkey
                    )
                    assert x.status_code == 409, x.text  # never run again, never replayed
                    code = x.json()["error"]["code"]
                    assert code in ("idempotency_in_flight", "idempotency_stream_not_stored"), x.text
                    return x if code == "idempotency_stream_not_stored" else None

                wait_until(_abandoned, timeout=10, what="abandoned stream key marked done (not stored)")

                # -- a failed first attempt releases the key: the client's retry runs -------------------------
                fkey = {"idempotency-key": "order-3"}
                assert c.post(eng.url + "/admin/faults", json={"error_every": 1}).status_code == 200
                failed = c.post(u + "/v1/completions", json=body, headers=fkey)
                assert failed.status_code == 502
                assert c.post(eng.url + "/admin/faults", json={"error_every": 0}).status_code == 200
                retry = wait_until(
                    lambda: (
                        (x := c.post(u + "/v1/completions", json=body, headers=fkey)).status_code == 200 and x
                    ),
                    timeout=5,
                    what="key released after failure",
                )
                assert isinstance(retry, httpx.Response)  # the condition's value: the retried response
                assert "idempotent-replayed" not in retry.headers

                # -- Redis down: keyed requests get a clear 503, the others are routed as usual --------------
                server.stop()
                wait_until(
                    lambda: (
                        c.post(
                            u + "/v1/completions", json=body, headers={"idempotency-key": "down-1"}
                        ).status_code
                        == 503
                    ),
                    timeout=10,
                    what="503 while Redis is down",
                )
                down = c.post(u + "/v1/completions", json=body, headers={"idempotency-key": "down-2"})
                assert down.status_code == 503 and down.json()["error"]["code"] == "idempotency_unavailable"
                assert "Redis" in down.json()["error"]["message"] and down.headers["retry-after"] == "1"
                plain = c.post(u + "/v1/completions", json=body)
                assert plain.status_code == 200, plain.text
                # -- Redis back (empty): the router reconnects by itself and keys work again ----------------
                t0 = time.monotonic()
                server.start()
                wait_until(
                    lambda: metric(u, "kvroute_redis_available") == 1.0, timeout=15, what="reconnected"
                )
                assert time.monotonic() - t0 < 15
                back = c.post(u + "/v1/completions", json=body, headers={"idempotency-key": "down-2"})
                assert back.status_code == 200 and "idempotent-replayed" not in back.headers
                assert (
                    c.post(
                        u + "/v1/completions", json=body, headers={"idempotency-key": "down-2"}
                    ).headers.get("idempotent-replayed")
                    == "true"
                )
            out = r.proc.output()
        assert "Traceback" not in out, out[-3000:]
    finally:
        server.stop()
