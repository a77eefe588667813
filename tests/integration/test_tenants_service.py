"""Tenants, priorities and SLOs through ``kvroute serve`` (issue 20): real router processes, fake engines over
loopback, a real redis-server.

* bad tenant / priority / TTFT-target headers -> 400 with a JSON reason naming the header;
* one quota shared by 3 routers through Redis: total admitted within 5 % of the quota;
* priority order under contention, fair shares under a flood (one in-flight slot, the router's queue);
* SLO rejection (429 ``slo_unattainable`` before queueing) and predicted-vs-observed TTFT per class;
* Redis down then up during admission: per-router share (neither open nor closed), ``/readyz`` and metrics say so,
  shared again after recovery;
* a request that has started streaming is never preempted;
* peers' priority headers (objective names, SMG / Dynamo classes) are mapped, unknown values served at the
  default class and counted, never refused;
* a tenant header is honoured only for keys allowed to act for tenants (403 otherwise);
* priority entitlement: a tenant's highest class, and its share of the top class (a flood of ``critical`` no
  longer starves a ``standard`` tenant);
* tenant metric series are capped and expire when idle.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import httpx

from tests.helpers import metric, wait_until
from tests.integration.test_reliability_support import MODEL, Eng, Router, engines, router, start_router
from tests.redis_server import RedisServer

#: each quota request: 40 prompt ids + 20 output tokens = 60 tokens charged
IDS = list(range(1000, 1040))
COST = 60


def ids_body(max_tokens: int = 20, stream: bool = False) -> dict[str, Any]:
    """A completions body of 40 prompt token ids: charges ``40 + max_tokens`` tokens to a quota."""
    return {"model": MODEL, "prompt": IDS, "max_tokens": max_tokens, "stream": stream}


def post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 30
) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=timeout)


def _queued(url: str) -> float:
    return metric(url, "kvroute_queued_requests")


def _queued_is(url: str, n: int) -> bool:
    return _queued(url) == n


def _readyz_budget_mode_is(url: str, mode: str) -> bool:
    return bool(httpx.get(url + "/readyz").json()["tenants"]["budget_mode"] == mode)


@contextmanager
def _routers(engs: list[Eng], n: int, *args: str) -> Iterator[list[Router]]:
    with ExitStack() as stack:
        rs = []
        for _ in range(n):
            r = start_router(engs, *args)
            stack.callback(r.proc.stop)
            rs.append(r)
        yield rs


def _in_background(fn: Callable[[], httpx.Response], out: dict[str, Any], key: str) -> threading.Thread:
    def go() -> None:
        try:
            out[key] = fn()
        except Exception as exc:  # noqa: BLE001 - recorded for the assertions
            out[key] = exc
        out.setdefault("_order", []).append(key)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _hold_the_slot(r: Router, eng: Eng, out: dict[str, Any]) -> threading.Thread:
    """A streaming request holds the router's only slot: the engine goes silent for 4 s after its first token
    (non-streaming requests are not affected); returns once its first token arrived. Every request stalls 0.1 s
    at the engine, so the completions of the queued requests (served one at a time) are >= 0.1 s apart."""
    faults = {"stall_mid_stream_s": 4, "stall_s": 0.1}
    assert httpx.post(eng.url + "/admin/faults", json=faults, timeout=5).status_code == 200
    first = threading.Event()

    def hold() -> httpx.Response:
        with httpx.stream("POST", r.url + "/v1/completions", json=ids_body(stream=True), timeout=30) as resp:
            for _ in resp.iter_lines():
                first.set()
        return resp

    thread = _in_background(hold, out, "hold")
    assert first.wait(10), "the holding stream did not start"
    return thread


# ---------------------------------------------------------------------------------------------------------


def test_bad_identity_headers_get_400_with_a_json_reason() -> None:
    with engines(("e0", [])) as engs, router(engs, "--tenant-api-keys", "acme=sk-acme") as r:
        cases = [
            ({"x-kvroute-tenant": "no spaces allowed"}, "x-kvroute-tenant"),
            ({"x-kvroute-priority": "whenever"}, "x-kvroute-priority"),
            ({"x-llm-d-slo-ttft-ms": "-1"}, "x-llm-d-slo-ttft-ms"),
            ({"authorization": "Bearer sk-acme", "x-kvroute-tenant": "globex"}, "x-kvroute-tenant"),
        ]
        for headers, param in cases:
            resp = post(r.url, ids_body(), headers)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == param and err["code"] == "invalid_identity" and param in err["message"]
            route = httpx.post(r.url + "/route", json={"model": MODEL, "token_ids": IDS}, headers=headers)
            assert route.status_code == 400 and route.json()["error"]["param"] == param
        body = ids_body() | {"priority_class": 7.5}
        resp = post(r.url, body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority_class"
        ok = post(r.url, ids_body(), {"x-kvroute-tenant": "acme-2", "x-kvroute-priority": "critical"})
        assert ok.status_code == 200, ok.text
        assert metric(r.url, "kvroute_tenant_requests_total", tenant="acme-2", **{"class": "critical"}) == 1


def test_quota_shared_by_three_routers_within_5_percent() -> None:
    rate, burst = 5.0, 6000.0  # 100 requests of 60 tokens, plus 5 tokens/s
    quota = json.dumps({"t": {"tokens_per_s": rate, "burst_tokens": burst}})
    with (
        RedisServer() as redis,
        engines(("e0", []), ("e1", [])) as engs,
        _routers(
            engs,
            3,
            "--redis-url",
            redis.url,
            "--tenants",
            quota,
            "--tenant-expected-routers",
            "3",
            "--redis-retry-max-s",
            "0.5",
        ) as rs,
    ):
        for r in rs:
            wait_until(
                partial(_readyz_budget_mode_is, r.url, "shared"),
                timeout=10,
                what="shared budget",
            )
        t0 = time.monotonic()
        with ThreadPoolExecutor(12) as pool:
            resps = list(
                pool.map(lambda i: post(rs[i % 3].url, ids_body(), {"x-kvroute-tenant": "t"}), range(240))
            )
        elapsed = time.monotonic() - t0
        admitted = sum(x.status_code == 200 for x in resps)
        refused = [x for x in resps if x.status_code != 200]
        expected = (burst + rate * elapsed) / COST
        assert abs(admitted - expected) <= 0.05 * expected, (admitted, expected)
        assert all(x.status_code == 429 for x in refused)
        x = refused[0]
        assert x.json()["error"]["reason"] == "quota" and x.headers["x-kvroute-rejected-reason"] == "quota"
        assert int(x.headers["retry-after"]) >= 1
        per_router = [metric(r.url, "kvroute_tenant_requests_total", tenant="t") for r in rs]
        assert sum(per_router) == admitted and min(per_router) > 0  # every router took part
        assert sum(
            metric(r.url, "kvroute_tenant_rejected_total", tenant="t", reason="quota") for r in rs
        ) == len(refused)


def test_priority_order_and_fair_shares_under_contention() -> None:
    with (
        engines(("e0", [])) as engs,
        router(
            engs, "--max-inflight-total", "1", "--max-queued-requests", "64", "--max-queue-wait-s", "60"
        ) as r,
    ):
        out: dict[str, Any] = {}
        threads = [_hold_the_slot(r, engs[0], out)]
        arrivals = [
            ("shed0", "a", "sheddable"),
            ("shed1", "a", "sheddable"),
            ("std0", "a", "standard"),
            ("crit0", "b", "critical"),
            ("std1", "b", "standard"),
        ]
        for n, (key, tenant, klass) in enumerate(arrivals, start=1):
            headers = {"x-kvroute-tenant": tenant, "x-kvroute-priority": klass}
            threads.append(_in_background(partial(post, r.url, ids_body(), headers), out, key))
            wait_until(partial(_queued_is, r.url, n), timeout=5, what=f"{n} queued")
        for t in threads:
            t.join(timeout=30)
        order = [k for k in out["_order"] if k != "hold"]
        assert all(out[k].status_code == 200 for k in order)
        # priority first; within a class, the two tenants alternate instead of arriving order
        assert order == ["crit0", "std0", "std1", "shed0", "shed1"] or order == [
            "crit0",
            "std1",
            "std0",
            "shed0",
            "shed1",
        ], order

        # -- a flood: tenant f queues 16 requests, then tenant q sends 3 ---------------------------------------
        out = {}
        threads = [_hold_the_slot(r, engs[0], out)]
        for i in range(16):
            threads.append(
                _in_background(lambda: post(r.url, ids_body(), {"x-kvroute-tenant": "f"}), out, f"f{i}")
            )
        wait_until(lambda: _queued(r.url) == 16, timeout=10, what="flood queued")
        for i in range(3):
            threads.append(
                _in_background(lambda: post(r.url, ids_body(), {"x-kvroute-tenant": "q"}), out, f"q{i}")
            )
        wait_until(lambda: _queued(r.url) >= 18, timeout=10, what="quiet tenant queued")
        for t in threads:
            t.join(timeout=60)
        order = [k for k in out["_order"] if k != "hold"]
        positions = [order.index(f"q{i}") for i in range(3)]
        assert max(positions) <= 7, order  # FIFO would serve them at 16..18: fair share serves them early


def test_slo_rejection_and_predicted_vs_observed_per_class() -> None:
    with engines(("e0", [])) as engs, router(engs, "--slo-reject-factor", "2") as r:
        impossible = {"x-kvroute-ttft-target-ms": "0.0001", "x-kvroute-tenant": "s"}
        t0 = time.monotonic()
        resp = post(r.url, ids_body(), impossible)
        assert time.monotonic() - t0 < 2.0
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["reason"] == "slo_unattainable"
        assert (
            resp.headers["x-kvroute-rejected-reason"] == "slo_unattainable" and "retry-after" in resp.headers
        )
        assert metric(r.url, "kvroute_tenant_rejected_total", tenant="s", reason="slo_unattainable") == 1
        easy = {"x-llm-d-slo-ttft-ms": "60000", "x-kvroute-tenant": "s", "x-kvroute-priority": "critical"}
        for _ in range(3):
            ok = post(r.url, ids_body(stream=True), easy)
            assert ok.status_code == 200 and "[DONE]" in ok.text
        cls = {"class": "critical"}
        assert metric(r.url, "kvroute_class_predicted_ttft_seconds_count", **cls) == 3
        assert metric(r.url, "kvroute_class_observed_ttft_seconds_count", **cls) == 3
        assert metric(r.url, "kvroute_tenant_ttft_seconds_count", tenant="s") == 3
        assert metric(r.url, "kvroute_tenant_tokens_total", tenant="s") == 3 * COST


def test_redis_down_and_up_during_admission() -> None:
    burst = 2400.0  # 40 requests shared; 20 per router while Redis is down (expected routers 2)
    quota = json.dumps({"t": {"tokens_per_s": 0.01, "burst_tokens": burst}})
    hdr = {"x-kvroute-tenant": "t"}
    with (
        RedisServer() as redis,
        engines(("e0", [])) as engs,
        _routers(
            engs,
            2,
            "--redis-url",
            redis.url,
            "--tenants",
            quota,
            "--tenant-expected-routers",
            "2",
            "--redis-retry-max-s",
            "0.3",
        ) as rs,
    ):

        def mode(r: Router) -> str:
            return str(httpx.get(r.url + "/readyz", timeout=2).json()["tenants"]["budget_mode"])

        def mode_is(r: Router, want: str) -> bool:
            return mode(r) == want

        for r in rs:
            wait_until(partial(mode_is, r, "shared"), timeout=10, what="shared")
        first = [post(rs[i % 2].url, ids_body(), hdr).status_code for i in range(50)]
        assert first.count(200) == 40  # shared: one quota for both routers
        redis.stop()
        for r in rs:
            wait_until(partial(mode_is, r, "local_fallback"), timeout=10, what="fallback")
        ready = httpx.get(rs[0].url + "/readyz").json()
        assert "1/2" in ready["tenants"]["detail"] and ready["status"] == "ready"
        down = [post(rs[0].url, ids_body(), hdr).status_code for _ in range(30)]
        assert down.count(200) == 20 and down.count(429) == 10  # its share: never open, never closed
        assert metric(rs[0].url, "kvroute_tenant_budget_mode", mode="local_fallback") == 1
        # the 10 refused never got to a take: the bucket was seen empty before their prompts were tokenized
        assert metric(rs[0].url, "kvroute_tenant_budget_takes_total", mode="local_fallback") == 20
        redis.start()
        for r in rs:
            wait_until(partial(mode_is, r, "shared"), timeout=15, what="shared again")
        again = [post(rs[i % 2].url, ids_body(), hdr).status_code for i in range(50)]
        assert again.count(200) == 40  # a fresh shared bucket (the restarted Redis is empty)
        assert metric(rs[1].url, "kvroute_tenant_budget_mode", mode="shared") == 1


def test_streaming_request_is_never_preempted() -> None:
    with (
        engines(("e0", [])) as engs,
        router(
            engs, "--max-inflight-total", "1", "--max-queued-requests", "1", "--max-queue-wait-s", "30"
        ) as r,
    ):
        # the stream goes silent for 6 s after its first token: it holds the only slot while the queue fills
        assert (
            httpx.post(engs[0].url + "/admin/faults", json={"stall_mid_stream_s": 6}, timeout=5).status_code
            == 200
        )
        shed = {"x-kvroute-priority": "sheddable", "x-kvroute-tenant": "a"}
        crit = {"x-kvroute-priority": "critical", "x-kvroute-tenant": "b"}
        got: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.stream(
                "POST",
                r.url + "/v1/completions",
                json=ids_body(max_tokens=60, stream=True),
                headers=shed,
                timeout=60,
            ) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        got.append(line[6:])
                        started.set()

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        assert started.wait(20), "the stream did not start"
        out: dict[str, Any] = {}
        waiter = _in_background(lambda: post(r.url, ids_body(), shed), out, "queued_shed")
        wait_until(lambda: _queued(r.url) == 1, timeout=5, what="one queued")
        critical = _in_background(lambda: post(r.url, ids_body(), crit), out, "critical")
        waiter.join(timeout=10)
        pushed = out["queued_shed"]
        assert pushed.status_code == 503 and pushed.json()["error"]["reason"] == "preempted", pushed.text
        assert pushed.headers["x-kvroute-rejected-reason"] == "preempted" and "retry-after" in pushed.headers
        assert "critical" not in out and streamer.is_alive()  # the stream holds its slot; critical waits
        streamer.join(timeout=60)
        assert got[-1] == "[DONE]"
        tokens = [json.loads(x)["choices"][0]["text"] for x in got[:-1] if json.loads(x).get("choices")]
        assert len(tokens) >= 60 - 1, len(tokens)  # the whole answer arrived
        critical.join(timeout=30)
        assert out["critical"].status_code == 200
        assert metric(r.url, "kvroute_tenant_rejected_total", tenant="a", reason="preempted") == 1


def test_isolated_tenants_never_share_a_cached_prefix() -> None:
    tenants = json.dumps({"a": {"isolate_cache": True}, "b": {"isolate_cache": True}})
    with (
        engines(("e0", []), ("e1", [])) as engs,
        router(engs, "--tenants", tenants, "--predict-mode", "always") as r,
    ):
        prompt = list(range(2000, 2640))  # 40 blocks of 16

        def cached(tenant: str | None) -> int:
            headers = {"x-kvroute-tenant": tenant} if tenant else {}
            d = httpx.post(
                r.url + "/route", json={"model": MODEL, "token_ids": prompt}, headers=headers
            ).json()
            most: int = max(c["cached_tokens"] for c in d["candidates"])
            return most

        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        assert post(r.url, body, {"x-kvroute-tenant": "a"}).status_code == 200
        assert cached("a") >= 600  # tenant a's own prompt is (predicted) cached
        assert cached("b") == 0 and cached(None) == 0  # same tokens, other namespaces: no shared match
        assert post(r.url, body).status_code == 200  # the shared namespace
        assert cached(None) >= 600 and cached("b") == 0


def test_peer_priority_headers_are_mapped_and_unknown_values_get_the_default_class() -> None:
    objectives = json.dumps({"food-review": "critical"})
    with engines(("e0", [])) as engs, router(engs, "--priority-objectives", objectives) as r:
        cases = [
            ({"x-gateway-inference-objective": "food-review"}, "critical"),  # an InferenceObjective name
            ({"x-llm-d-inference-objective": "translation"}, "standard"),  # unknown objective: the default
            ({"x-smg-priority": "whenever"}, "standard"),  # unknown SMG value: the default, as SMG does
            ({"x-smg-priority": "bulk"}, "sheddable"),
            ({"x-dynamo-meta-policy-class": "latency"}, "critical"),  # Dynamo's class names, built in
            ({"x-dynamo-meta-policy-class": "agents"}, "standard"),
        ]
        for i, (headers, klass) in enumerate(cases):
            tenant = f"p{i}"
            resp = post(r.url, ids_body(), headers | {"x-kvroute-tenant": tenant})
            assert resp.status_code == 200, (headers, resp.text)
            assert metric(r.url, "kvroute_tenant_requests_total", tenant=tenant, **{"class": klass}) == 1
            route = httpx.post(
                r.url + "/route", json={"model": MODEL, "token_ids": IDS}, headers=headers, timeout=10
            )
            assert route.status_code == 200, route.text
        unknown = {"header": "x-llm-d-inference-objective"}
        assert metric(r.url, "kvroute_priority_unknown_total", **unknown) == 2  # completion + /route
        assert metric(r.url, "kvroute_priority_unknown_total", header="x-smg-priority") == 2
        strict = post(r.url, ids_body(), {"x-kvroute-priority": "food-review-2"})  # our own header: strict
        assert strict.status_code == 400 and strict.json()["error"]["param"] == "x-kvroute-priority"


def test_a_tenant_header_needs_a_key_allowed_to_act_for_tenants() -> None:
    args: tuple[str, ...] = (
        "--api-key",
        "sk-plain",
        "--admin-token",
        "sk-admin",
        "--tenant-header-keys",
        "sk-edge",
    )
    args += ("--tenant-api-keys", "acme=sk-acme")
    with engines(("e0", [])) as engs, router(engs, *args) as r:
        for key in ("sk-plain", "sk-admin"):  # a key without a tenant, the admin token: not for acme
            for header in ("x-kvroute-tenant", "x-gateway-inference-fairness-id"):
                resp = post(r.url, ids_body(), {"authorization": f"Bearer {key}", header: "acme"})
                assert resp.status_code == 403, resp.text
                err = resp.json()["error"]
                assert (err["code"], err["param"]) == ("tenant_not_allowed", header), err
        assert metric(r.url, "kvroute_tenant_requests_total", tenant="acme") == 0  # nothing charged to acme
        edge = post(r.url, ids_body(), {"authorization": "Bearer sk-edge", "x-kvroute-tenant": "acme"})
        assert edge.status_code == 200, edge.text  # the edge gateway's key acts for any tenant
        own = post(r.url, ids_body(), {"authorization": "Bearer sk-acme"})
        assert own.status_code == 200
        assert metric(r.url, "kvroute_tenant_requests_total", tenant="acme") == 2
        plain = post(r.url, ids_body(), {"authorization": "Bearer sk-plain"})  # no header: the default tenant
        assert plain.status_code == 200
        assert metric(r.url, "kvroute_tenant_requests_total", tenant="default") == 1
        assert metric(r.url, "kvroute_tenant_rejected_total", reason="tenant_not_allowed") == 4


def _flood(url: str, seconds: float, flooders: int) -> dict[str, dict[str, int]]:
    """Tenant ``a`` sends ``critical`` requests from ``flooders`` threads, tenant ``b`` ``standard`` ones from one,
    each back to back for ``seconds``; the answers' status codes counted per tenant."""
    counts: dict[str, dict[str, int]] = {"a": {}, "b": {}}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def loop(tenant: str, klass: str) -> None:
        headers = {"x-kvroute-tenant": tenant, "x-kvroute-priority": klass}
        with httpx.Client(timeout=30) as c:
            while time.monotonic() < deadline:
                resp = c.post(url + "/v1/completions", json=ids_body(max_tokens=2), headers=headers)
                outcome = str(resp.status_code)
                if resp.status_code != 200:
                    outcome += ":" + str(resp.json()["error"].get("reason"))
                with lock:
                    counts[tenant][outcome] = counts[tenant].get(outcome, 0) + 1

    threads = [threading.Thread(target=loop, args=("a", "critical")) for _ in range(flooders)]
    threads.append(threading.Thread(target=loop, args=("b", "standard")))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 60)
    return counts


def test_a_tenant_flooding_the_top_class_no_longer_starves_a_standard_tenant() -> None:
    # 2 slots, every engine request takes >= 0.1 s: ~20 answers/s for everyone; tenant a keeps 12 critical
    # requests in the router's queue at all times, tenant b one standard request
    args = ("--max-inflight-total", "2", "--max-queued-requests", "64", "--max-queue-wait-s", "2")
    with engines(("e0", [])) as engs, router(engs, *args) as r:
        assert httpx.post(engs[0].url + "/admin/faults", json={"stall_s": 0.1}, timeout=5).status_code == 200
        counts = _flood(r.url, 6.0, flooders=12)
        print("successes and failures per tenant:", counts)
        ok_a, ok_b = counts["a"].get("200", 0), counts["b"].get("200", 0)
        # b is served about every other free slot (fair share within the standard class), never times out
        assert ok_b >= max(5, (ok_a + ok_b) // 10) and set(counts["b"]) == {"200"}, counts
        assert ok_a > ok_b  # a still gets its critical share and more
        demoted = metric(r.url, "kvroute_tenant_demoted_total", tenant="a", reason="top_share")
        assert demoted > 0 and metric(r.url, "kvroute_tenant_demoted_total", tenant="b") == 0


def test_a_tenants_max_class_caps_its_priority() -> None:
    tenants = json.dumps({"vip": {"max_class": "critical"}})
    with (
        engines(("e0", [])) as engs,
        router(engs, "--tenants", tenants, "--tenant-max-priority-class", "standard") as r,
    ):
        for tenant in ("vip", "anyone"):
            resp = post(r.url, ids_body(), {"x-kvroute-tenant": tenant, "x-kvroute-priority": "critical"})
            assert resp.status_code == 200
        assert metric(r.url, "kvroute_tenant_requests_total", tenant="vip", **{"class": "critical"}) == 1
        assert metric(r.url, "kvroute_tenant_requests_total", tenant="anyone", **{"class": "standard"}) == 1
        assert metric(r.url, "kvroute_tenant_demoted_total", tenant="anyone", reason="max_class") == 1


def test_tenant_metric_series_are_capped_and_expire_when_idle() -> None:
    args = ("--tenant-metrics-max-labels", "3", "--tenant-metrics-idle-s", "1")
    with engines(("e0", [])) as engs, router(engs, *args) as r:

        def labelled() -> set[str]:
            text = httpx.get(r.url + "/metrics", timeout=5).text
            return set(re.findall(r'kvroute_tenant_requests_total\{tenant="([^"]+)"', text))

        for i in range(6):
            assert post(r.url, ids_body(), {"x-kvroute-tenant": f"t{i}"}).status_code == 200
        assert labelled() == {"t0", "t1", "t2", "other"}  # t3..t5 share one label
        assert metric(r.url, "kvroute_tenant_requests_total", tenant="other") == 3
        wait_until(lambda: not labelled(), timeout=10, interval=0.2, what="idle tenants' series dropped")
        assert metric(r.url, "kvroute_tenant_label_sets_expired_total") == 4
        assert post(r.url, ids_body(), {"x-kvroute-tenant": "t5"}).status_code == 200
        assert labelled() == {"t5"}  # a place freed: t5 has its own series now
