"""Prefill/decode disaggregation end to end: ``kvroute serve`` in front of PD stand-in engines (issue 19).

The stand-in engines speak the PD protocols (fakes/fake_pd.py): a decode engine that gets no or wrong hand-off
parameters recomputes and counts it, a vLLM prefill leg that is streamed or asks for more than one token is
counted, DP ranks are counted per rank, aborts are counted. So every test here fails when the router gets the
protocol wrong. Every request is compared with the plan ``POST /route`` predicted for it just before.

Plans are forced to disaggregate (``pd_ttft`` with ``decode_prefills=false``: decode replicas never prefill a
whole prompt themselves) so every request exercises both legs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import pytest

from fakes.fleet import EngineOptions, Fleet, pd_roles
from tests.helpers import metric, wait_until

PROMPT = [1000 + (i * 7) % 5000 for i in range(600)]  # token ids: no tokenizer involved


def _fleet(
    dialect: str,
    protocol: str | None,
    *,
    time_scale: float = 0.01,
    dp: int = 1,
    prefill: int = 1,
    decode: int = 1,
) -> Fleet:
    opts = EngineOptions(
        dialect=dialect,
        kv_events_format="sglang" if dialect == "sglang" else "vllm",
        time_scale=time_scale,
        pd_protocol=protocol,
        data_parallel_size=dp,
    )
    fleet = Fleet(prefill + decode, opts, roles=pd_roles(prefill, decode))
    try:
        fleet.start_engines()
        fleet.start_kvroute(
            "ttft",
            extra_args=[
                "--pd-policy",
                "pd_ttft",
                "--pd-policy-params",
                "decode_prefills=false",
                "--max-retries",
                "1",
                "--pd-protocol",
                protocol or "auto",
            ],
        )
    except BaseException:
        fleet.stop()
        raise
    return fleet


@pytest.fixture(scope="module")
def vllm_fleet() -> Iterator[Fleet]:
    fleet = _fleet("vllm", None, dp=2)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def sglang_fleet() -> Iterator[Fleet]:
    fleet = _fleet("sglang", None, time_scale=1.0)
    try:
        yield fleet
    finally:
        fleet.stop()


def _engine_samples_at_least(router: str, n: int) -> bool:
    """The router learned ``n`` engine-reported handoff samples."""
    return metric(router, "kvroute_pd_link_samples_total", outcome="engine_accepted") >= n


def _url(fleet: Fleet) -> str:
    assert fleet.router is not None
    return fleet.router.url


def _body(
    chat: bool, stream: bool, prompt: list[int] | None = None, max_tokens: int = 4
) -> tuple[str, dict[str, Any]]:
    ids = prompt or PROMPT
    if chat:
        text = " ".join(f"w{t}" for t in ids[:300])
        return "/v1/chat/completions", {
            "model": "kvroute-fake",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    return "/v1/completions", {
        "model": "kvroute-fake",
        "prompt": ids,
        "max_tokens": max_tokens,
        "stream": stream,
    }


def _quiet(fleet: Fleet) -> None:
    """Wait until the router sees every replica idle (nothing in flight, queued or running in its last scrape).

    A plan from ``/route`` predicts the served plan only for the same router state; right after an answer the
    router may still hold a scrape taken while the previous request ran (or a stream's decode hold), which the
    next scrape, a few ms later, clears."""

    def idle() -> bool:
        reps = httpx.get(_url(fleet) + "/replicas", timeout=5).json()["replicas"]
        return all(
            r["load"]["inflight_requests"] == 0
            and not r["load"]["queued_requests"]
            and not r["load"]["running_requests"]
            for r in reps
        )

    wait_until(idle, timeout=10, what="the router to see every replica idle")


def _route(fleet: Fleet, path: str, body: dict[str, Any]) -> dict[str, Any]:
    _quiet(fleet)
    route_body = {k: v for k, v in body.items() if k not in ("stream", "max_tokens")}
    r = httpx.post(_url(fleet) + "/route", json=route_body, timeout=10)
    assert r.status_code == 200, r.text
    plan = r.json()["plan"]
    assert plan is not None
    return dict(plan["chosen"])


def _serve(fleet: Fleet, path: str, body: dict[str, Any]) -> tuple[httpx.Response, str]:
    r = httpx.post(_url(fleet) + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r, r.text


def _engine(fleet: Fleet, name: str) -> str:
    return next(e.url for e in fleet.engines if e.name == name)


def _check_served_as_planned(fleet: Fleet, plan: dict[str, Any], r: httpx.Response, stream: bool) -> None:
    assert plan["kind"] == "disaggregated"
    assert r.headers["x-kvroute-replica"] == plan["decode"]["name"]
    assert r.headers["x-kvroute-prefill-replica"] == plan["prefill"]["name"]
    assert set(plan["terms"]) >= {"Q_p", "R_p", "C_p", "handoff", "decode_first"}
    if stream:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.text.rstrip().endswith("data: [DONE]") and "event: error" not in r.text
    else:
        out = r.json()
        assert out["choices"] and "kv_transfer_params" not in out


def _wire_clean(fleet: Fleet) -> None:
    """No decode engine recomputed or lacked its parameters; no prefill leg broke the relay rules."""
    for e in fleet.engines:
        assert metric(e.url, "fake_pd_recomputed_total") == 0, e.name
        assert metric(e.url, "fake_pd_missing_params_total") == 0, e.name
        assert metric(e.url, "fake_pd_bad_prefill_total") == 0, e.name


@pytest.mark.parametrize(("chat", "stream"), [(False, False), (False, True), (True, False), (True, True)])
def test_vllm_relay_served_as_planned(vllm_fleet: Fleet, chat: bool, stream: bool) -> None:
    path, body = _body(chat, stream)
    plan = _route(vllm_fleet, path, body)
    p_url, d_url = _engine(vllm_fleet, plan["prefill"]["name"]), _engine(vllm_fleet, plan["decode"]["name"])
    before = (
        metric(p_url, "fake_pd_requests_total", leg="prefill"),
        metric(d_url, "fake_pd_handoffs_total"),
        metric(d_url, "fake_dp_rank_requests_total", rank=str(plan["dp_rank"])),
    )
    r, _ = _serve(vllm_fleet, path, body)
    _check_served_as_planned(vllm_fleet, plan, r, stream)
    assert metric(p_url, "fake_pd_requests_total", leg="prefill") == before[0] + 1
    assert (
        metric(d_url, "fake_pd_handoffs_total") == before[1] + 1
    )  # the KV arrived: relayed params were right
    assert plan["dp_rank"] in (
        0,
        1,
    )  # the decode engine has 2 DP ranks: the plan pins one, the header carries it
    assert metric(d_url, "fake_dp_rank_requests_total", rank=str(plan["dp_rank"])) == before[2] + 1
    _wire_clean(vllm_fleet)
    router = _url(vllm_fleet)
    assert metric(router, "kvroute_pd_legs_total", replica=plan["decode"]["name"], leg="decode") >= 1
    assert metric(router, "kvroute_pd_plans_total", kind="disaggregated") >= 1


def test_sglang_bootstrap_served_as_planned(sglang_fleet: Fleet) -> None:
    for chat, stream in [(False, False), (True, True), (False, True)]:
        path, body = _body(chat, stream)
        plan = _route(sglang_fleet, path, body)
        d_url = _engine(sglang_fleet, plan["decode"]["name"])
        p_url = _engine(sglang_fleet, plan["prefill"]["name"])
        before = (
            metric(d_url, "fake_pd_handoffs_total"),
            metric(p_url, "fake_pd_requests_total", leg="prefill"),
        )
        r, _ = _serve(sglang_fleet, path, body)
        _check_served_as_planned(sglang_fleet, plan, r, stream)
        assert (
            metric(d_url, "fake_pd_handoffs_total") == before[0] + 1
        )  # joined the right room on the right port
        assert metric(p_url, "fake_pd_requests_total", leg="prefill") == before[1] + 1
    _wire_clean(sglang_fleet)


def test_sglang_cancelled_client_cancels_both_legs(sglang_fleet: Fleet) -> None:
    """A client that leaves while the prefill runs: the prefill leg is aborted on P and the decode leg, waiting
    in its bootstrap room on D, is aborted too."""
    long_prompt = [7 + (i * 13) % 9000 for i in range(40_000)]  # ~4 s of prefill on the a100 profile
    path, body = _body(False, True, long_prompt)
    plan = _route(sglang_fleet, path, body)
    p_url, d_url = (
        _engine(sglang_fleet, plan["prefill"]["name"]),
        _engine(sglang_fleet, plan["decode"]["name"]),
    )
    p0, d0 = metric(p_url, "fake_requests_aborted_total"), metric(d_url, "fake_requests_aborted_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(_url(sglang_fleet) + path, json=body, timeout=httpx.Timeout(10.0, read=0.8))
    wait_until(lambda: metric(p_url, "fake_requests_aborted_total") > p0, 10.0, what="prefill leg aborted")
    wait_until(lambda: metric(d_url, "fake_requests_aborted_total") > d0, 10.0, what="decode leg aborted")
    assert metric(_url(sglang_fleet), "kvroute_upstream_errors_total", reason="client_disconnected") >= 1


def test_vllm_killed_prefill_falls_back_in_place_counted() -> None:
    fleet = _fleet("vllm", None)
    try:
        path, body = _body(False, False)
        plan = _route(fleet, path, body)
        prefill = next(e for e in fleet.engines if e.name == plan["prefill"]["name"])
        d_url = _engine(fleet, plan["decode"]["name"])
        prefill.proc.stop()  # killed: the next prefill leg cannot connect
        r, _ = _serve(fleet, path, body)
        assert (
            r.headers["x-kvroute-replica"] == plan["decode"]["name"]
        )  # served in place on the plan's decode
        assert "x-kvroute-prefill-replica" not in r.headers and r.json()["choices"]
        assert metric(_url(fleet), "kvroute_pd_fallbacks_total", reason="prefill_failed") == 1
        assert metric(d_url, "fake_pd_recomputed_total", reason="missing_params") == 1  # it prefilled itself
    finally:
        fleet.stop()


def test_mooncake_transfer_id_served_as_planned() -> None:
    fleet = _fleet("vllm", "mooncake")
    try:
        for stream in (False, True):
            path, body = _body(True, stream)
            plan = _route(fleet, path, body)
            d_url = _engine(fleet, plan["decode"]["name"])
            before = metric(d_url, "fake_pd_handoffs_total")
            r, _ = _serve(fleet, path, body)
            _check_served_as_planned(fleet, plan, r, stream)
            assert metric(d_url, "fake_pd_handoffs_total") == before + 1
        _wire_clean(fleet)
    finally:
        fleet.stop()


def test_both_legs_charged_before_dispatch_spread_prefills(tmp_path: Any) -> None:
    """Concurrent requests on 2 prefill + 1 decode engines: both prefill engines get work (a router that counts
    the load only after the decode leg returns sends every request to prefill #0: sglang #27547)."""
    fleet = _fleet("vllm", None, time_scale=0.5, prefill=2)
    try:
        results: list[int] = []

        def one(i: int) -> None:
            path, body = _body(False, False, [50_000 + i * 3000 + t for t in range(3000)], max_tokens=2)
            results.append(httpx.post(_url(fleet) + path, json=body, timeout=60).status_code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [200] * 6
        legs = [
            metric(e.url, "fake_pd_requests_total", leg="prefill")
            for e in fleet.engines
            if e.role == "prefill"
        ]
        assert sum(legs) == 6 and min(legs) >= 1, legs
        _wire_clean(fleet)
    finally:
        fleet.stop()


def test_route_json_lists_every_plan_with_terms(vllm_fleet: Fleet) -> None:
    path, body = _body(False, False)
    r = httpx.post(
        _url(vllm_fleet) + "/route", json={k: v for k, v in body.items() if k != "stream"}, timeout=10
    )
    plan = r.json()["plan"]
    assert plan["policy"] == "pd_ttft" and plan["plans"][0] == plan["chosen"]
    assert all(p["predicted_ttft_s"] is not None and p["terms"] for p in plan["plans"])
    json.dumps(plan)


def test_vllm_failed_decode_leg_is_retried_on_the_other_decode_replica() -> None:
    """A decode leg that fails before its first byte (500) is retried as a disaggregated plan on the next plan's
    decode replica (both legs re-run), counted as a retry, not a fallback."""
    fleet = _fleet("vllm", None, decode=2)
    try:
        path, body = _body(False, True)
        plan = _route(fleet, path, body)
        failing = _engine(fleet, plan["decode"]["name"])
        other = next(e for e in fleet.engines if e.role == "decode" and e.url != failing)
        assert httpx.post(failing + "/admin/faults", json={"error_every": 1}, timeout=5).status_code == 200
        r, _ = _serve(fleet, path, body)
        assert r.headers["x-kvroute-replica"] == other.name
        assert r.headers["x-kvroute-prefill-replica"] == plan["prefill"]["name"]
        assert r.text.rstrip().endswith("data: [DONE]")
        assert metric(other.url, "fake_pd_handoffs_total") == 1  # the KV arrived on the other decode replica
        assert metric(_url(fleet), "kvroute_retries_total", reason="pd_decode_failed") == 1
        assert metric(_url(fleet), "kvroute_pd_fallbacks_total") == 0
        _wire_clean(fleet)
    finally:
        fleet.stop()


def test_vllm_killed_decode_engine_served_disaggregated_on_the_other() -> None:
    """One of two decode engines killed: every request still succeeds disaggregated through the other decode
    replica (its handoff counter counts each one)."""
    fleet = _fleet("vllm", None, decode=2)
    try:
        path, body = _body(False, False)
        plan = _route(fleet, path, body)
        dead = next(e for e in fleet.engines if e.name == plan["decode"]["name"])
        other = next(e for e in fleet.engines if e.role == "decode" and e is not dead)
        dead.proc.stop()
        for k in range(3):
            r, _ = _serve(fleet, *_body(False, False, [5 + k + (i * 11) % 9000 for i in range(600)]))
            assert r.headers["x-kvroute-replica"] == other.name and r.headers.get("x-kvroute-prefill-replica")
        assert metric(other.url, "fake_pd_handoffs_total") == 3
        assert metric(_url(fleet), "kvroute_pd_fallbacks_total") == 0
    finally:
        fleet.stop()


def _legs_by_request(fleet: Fleet) -> dict[str, dict[str, str]]:
    """Per X-Request-Id, the engine that served each leg (``GET /debug/pd_legs`` of every engine)."""
    out: dict[str, dict[str, str]] = {}
    for e in fleet.engines:
        r = httpx.get(e.url + "/debug/pd_legs", timeout=5)
        assert r.status_code == 200, r.text
        for rec in r.json():
            out.setdefault(str(rec["request_id"]), {})[rec["leg"]] = e.name
    return out


def test_vllm_each_request_legs_served_as_planned() -> None:
    """Per request: the engines that served its prefill and decode legs (by X-Request-Id) are the replicas the
    router named in its response and the plan ``/route`` predicted; the matching share is 1.0."""
    fleet = _fleet("vllm", None, prefill=2, decode=2)
    try:
        expected: dict[str, tuple[str, str]] = {}
        for k in range(8):
            path, body = _body(k % 2 == 0, k % 3 == 0, [9 + k * 5 + (i * 7) % 9000 for i in range(600)])
            plan = _route(fleet, path, body)
            rid = f"fidelity-{k}"
            r = httpx.post(_url(fleet) + path, json=body, headers={"x-request-id": rid}, timeout=30)
            assert r.status_code == 200, r.text
            named = (r.headers["x-kvroute-prefill-replica"], r.headers["x-kvroute-replica"])
            assert named == (plan["prefill"]["name"], plan["decode"]["name"])
            expected[rid] = named
        served = _legs_by_request(fleet)
        matched = sum(1 for rid, (p, d) in expected.items() if served.get(rid) == {"prefill": p, "decode": d})
        assert matched / len(expected) == 1.0, (expected, served)
    finally:
        fleet.stop()


def test_vllm_killed_prefill_retried_on_the_other_prefill_replica() -> None:
    """With two prefill replicas, a prefill leg that cannot connect is retried on the next plan's prefill replica
    (same decode replica), still disaggregated; counted as a retry, not a fallback."""
    fleet = _fleet("vllm", None, prefill=2)
    try:
        path, body = _body(False, False)
        plan = _route(fleet, path, body)
        dead = next(e for e in fleet.engines if e.name == plan["prefill"]["name"])
        other = next(e for e in fleet.engines if e.role == "prefill" and e is not dead)
        dead.proc.stop()
        r, _ = _serve(fleet, path, body)
        assert r.headers["x-kvroute-replica"] == plan["decode"]["name"]
        assert r.headers["x-kvroute-prefill-replica"] == other.name
        assert metric(other.url, "fake_pd_requests_total", leg="prefill") == 1
        assert metric(_engine(fleet, plan["decode"]["name"]), "fake_pd_handoffs_total") == 1
        assert metric(_url(fleet), "kvroute_retries_total", reason="pd_prefill_failed") == 1
        assert metric(_url(fleet), "kvroute_pd_fallbacks_total") == 0
    finally:
        fleet.stop()


def test_vllm_relay_learns_the_link_bandwidth() -> None:
    """The engines' P->D link is 5 GB/s, the router is told 12 GB/s (the learned value may go down to 12 / 4):
    after a few sequential-relay handoffs the learned bandwidth (``kvroute_pd_link_bandwidth_bytes_per_second``)
    is near 5 GB/s and the plans' handoff term grows accordingly (issue 19: the link is learned online from
    observed handoff time). The engines export no transfer metrics here: the relay's own timing is the source."""
    opts = EngineOptions(
        dialect="vllm",
        kv_events_format="vllm",
        time_scale=1.0,
        pd_link_gbps=5.0,
        extra_args=["--no-pd-transfer-metrics"],
    )
    fleet = Fleet(2, opts, roles=pd_roles(1, 1))
    try:
        fleet.start_engines()
        fleet.start_kvroute(
            "ttft",
            extra_args=[
                "--pd-policy",
                "pd_ttft",
                "--pd-policy-params",
                "decode_prefills=false",
                "--pd-link-bandwidth-gbps",
                "12",
                "--pd-link-learn-min-samples",
                "3",
                "--pd-link-learn-alpha",
                "0.5",
            ],
        )
        router = _url(fleet)
        assert metric(router, "kvroute_pd_link_bandwidth_bytes_per_second") == 12e9
        probe = [11 + (i * 17) % 9000 for i in range(8000)]
        h0 = _route(fleet, *_body(False, False, probe, max_tokens=1))["terms"]["handoff"]
        for k in range(
            10
        ):  # distinct 8000-token prompts: the whole prompt's KV (1.18 GB, 236 ms) moves each time
            path, body = _body(False, False, [3 + k + (i * 31) % 9000 for i in range(8000)], max_tokens=1)
            r, _ = _serve(fleet, path, body)
            assert r.headers.get("x-kvroute-prefill-replica"), "served disaggregated"
        learned = metric(router, "kvroute_pd_link_bandwidth_bytes_per_second")
        # from 12 GB/s to within 1.5x of the true 5 GB/s (measured ~4.5 GB/s: the decode engine's own first step
        # is in the measured handoff); the clamp's floor, 3 GB/s, is outside this range
        assert 5e9 / 1.5 <= learned <= 5e9 * 1.5, learned
        assert metric(router, "kvroute_pd_link_samples_total", outcome="accepted") >= 3
        h1 = _route(fleet, *_body(False, False, probe, max_tokens=1))["terms"]["handoff"]
        assert h1 > 1.8 * h0, (h0, h1)  # the next decisions use the learned link
        _wire_clean(fleet)
    finally:
        fleet.stop()


def test_link_learned_from_the_engines_transfer_metrics() -> None:
    """The decode engine exports the NixlConnector's transfer histograms (as vLLM 0.32 does): the router learns
    the link from them at its scrapes, exactly (the engine's own transfer time, no decode step in it), and stops
    feeding the relay's biased timing. Engines at 5 GB/s, the router told 12 GB/s."""
    opts = EngineOptions(dialect="vllm", kv_events_format="vllm", time_scale=1.0, pd_link_gbps=5.0)
    fleet = Fleet(2, opts, roles=pd_roles(1, 1))
    try:
        fleet.start_engines()
        fleet.start_kvroute(
            "ttft",
            extra_args=[
                "--pd-policy",
                "pd_ttft",
                "--pd-policy-params",
                "decode_prefills=false",
                "--pd-link-bandwidth-gbps",
                "12",
                "--pd-link-learn-min-samples",
                "2",
                "--pd-link-learn-alpha",
                "0.5",
                "--scrape-interval-s",
                "0.2",
            ],
        )
        router = _url(fleet)
        for k in range(6):
            path, body = _body(False, False, [5 + k + (i * 29) % 9000 for i in range(6000)], max_tokens=1)
            r, _ = _serve(fleet, path, body)
            assert r.headers.get("x-kvroute-prefill-replica"), "served disaggregated"
            if k >= 1:  # each later handoff lands in a scrape interval of its own
                wait_until(
                    partial(_engine_samples_at_least, router, k),
                    10.0,
                    what=f"{k} engine-reported samples",
                )
        learned = metric(router, "kvroute_pd_link_bandwidth_bytes_per_second")
        assert abs(learned - 5e9) <= 0.01 * 5e9, learned  # the engine's own numbers: exact, not ~4.5 GB/s
        assert metric(router, "kvroute_pd_link_samples_total", outcome="superseded") >= 1
        assert metric(router, "kvroute_pd_link_samples_total", outcome="engine_rejected") == 0
    finally:
        fleet.stop()


def test_sglang_decode_servers_never_serve_in_place() -> None:
    """SGLang decode-mode servers only serve decode legs (the stand-in answers 400 without a bootstrap room, as a
    decode server cannot prefill alone): with ``pd_ttft``'s defaults (decode replicas may prefill), a short prompt
    that a vLLM decode replica would serve in place is still disaggregated, and when the only prefill engine is
    gone the client gets a clear 503 instead of a request the decode server cannot serve."""
    opts = EngineOptions(dialect="sglang", kv_events_format="sglang", time_scale=0.01)
    fleet = Fleet(2, opts, roles=pd_roles(1, 1))
    try:
        fleet.start_engines()
        fleet.start_kvroute("ttft", extra_args=["--pd-policy", "pd_ttft", "--max-retries", "1"])
        path, body = _body(False, False, PROMPT[:40])  # 40 tokens: in place on a vLLM decode replica
        plan = _route(fleet, path, body)
        assert plan["kind"] == "disaggregated"
        r, _ = _serve(fleet, path, body)
        assert r.headers["x-kvroute-prefill-replica"] == plan["prefill"]["name"]
        d_url = _engine(fleet, plan["decode"]["name"])
        next(e for e in fleet.engines if e.role == "prefill").proc.stop()
        r = httpx.post(_url(fleet) + path, json=body, timeout=30)
        # 503 either way: the prefill leg failed and nothing serves in place, or (had a probe noticed first) no
        # feasible plan is left
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_routable_replica", r.text
        assert metric(d_url, "fake_pd_missing_params_total") == 0  # never sent a request it cannot serve
        assert metric(_url(fleet), "kvroute_pd_fallbacks_total") == 0
    finally:
        fleet.stop()


def test_a_decode_leg_waits_on_its_replica_until_its_first_byte() -> None:
    """While a disaggregated request's prefill leg runs, its decode replica lists the waiting decode leg (the
    policy's ``decode_legs``, ``GET /replicas`` ``pd``); once the decode leg answered, it no longer does. The
    prefill replica's link is busy meanwhile."""
    fleet = _fleet("vllm", None, time_scale=1.0)
    try:
        prompt = [60_000 + t for t in range(24_000)]  # ~0.5 s of prefill on the stand-in's A100 timing
        path, body = _body(False, True, prompt, max_tokens=2)
        got: list[int] = []
        sender = threading.Thread(
            target=lambda: got.append(httpx.post(_url(fleet) + path, json=body, timeout=60).status_code)
        )

        def pd_states() -> dict[str, dict[str, Any]]:
            reps = httpx.get(_url(fleet) + "/replicas", timeout=10).json()["replicas"]
            return {r["role"]: r["pd"] for r in reps}

        sender.start()
        try:
            waiting = wait_until(
                lambda: (s := pd_states())["decode"]["decode_legs"] == 1 and s, timeout=30, interval=0.01
            )
            assert isinstance(waiting, dict) and waiting["decode"]["decode_leg_tokens"] == len(prompt)
            assert waiting["prefill"]["decode_legs"] == 0 and waiting["prefill"]["link_busy_s"] >= 0.0
        finally:
            sender.join(60)
        assert got == [200]
        after = pd_states()
        assert after["decode"]["decode_legs"] == 0 and after["decode"]["decode_leg_tokens"] == 0
        _wire_clean(fleet)
    finally:
        fleet.stop()
