"""Prefill/decode disaggregation against real vLLM engines: the NixlConnector relay through ``kvroute serve``.

Two engines of vLLM's CPU build, ``p0`` (role prefill) and ``d0`` (role decode), each with the NixlConnector (KV
cache in DRAM, UCX over loopback; ``loadtest.real_vllm.nixl_pd_specs``), and a router forced to disaggregate
(``pd_ttft`` with ``decode_prefills: false``: the decode replica never prefills a request itself). This is the
wire contract the stand-in's PD roles imitate, checked against vLLM itself:

* the prefill leg (``kv_transfer_params.do_remote_decode``, ``stream`` off, one token) makes p0 return transfer
  parameters, and the router relays them opaquely: d0 pulls the blocks over NIXL (its
  ``vllm:nixl_xfer_time_seconds`` count grows by one per request) and takes the prompt from the transfer
  (``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``) instead of computing it;
* the answer is right: both engines load the same dummy weights, so greedy text disaggregated P -> D equals p0's
  own answer in place only when d0 decoded from p0's KV;
* streaming chat, a client that leaves mid-stream (both engines drain, the router's in-flight count returns to
  0), and a dead prefill engine (served in place on d0, counted as a fallback, never silent);
* tracing: both engines export their request spans (``--otlp-traces-endpoint``); p0's and d0's ``llm_request``
  land in the caller's trace under kvroute's prefill and decode leg spans.

The engines start once for the module (~80-120 s, 3.4 GB each) and are stopped at its end, also on failure.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.epp_gateway import GatewayStream, stub_for
from loadtest.real_vllm import MODEL, RealFleet, nixl_pd_specs
from tests.helpers import free_port, metric, wait_until
from tests.otlp_receiver import Receiver
from tests.real.support import Router, eager, start_router, traced, words
from tests.real.test_tracing_real import caller_trace, one, wait_trace

#: force every request onto a P -> D plan (a decode replica may not prefill a request in place)
FORCE_PD = ["--pd-policy", "pd_ttft", "--pd-policy-params", json.dumps({"decode_prefills": False})]
#: enough words for ~10 KV blocks of 32 tokens
PROMPT_WORDS = 160


@pytest.fixture(scope="module")
def pd_fleet(
    vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory, otlp: Receiver
) -> Iterator[RealFleet]:
    """p0 (prefill) on the first CPU, d0 (decode) on the last, both with the NixlConnector, both exporting their
    request spans to ``otlp``."""
    cpus = sorted(os.sched_getaffinity(0))
    specs = [traced(s, otlp.endpoint) for s in nixl_pd_specs(cpus[0], cpus[-1], (free_port(), free_port()))]
    fleet = RealFleet(vllm_python, model_dir, eager(specs), tmp_path_factory.mktemp("pd-engine-logs"))
    with fleet:
        fleet.start()
        yield fleet


@pytest.fixture
def pd_router(pd_fleet: RealFleet, model_dir: Path) -> Iterator[Callable[..., Router]]:
    """Factory: ``kvroute serve`` in front of p0 and d0 (forced to disaggregate, plus ``extra`` flags)."""
    started: list[Router] = []

    def make(*extra: str) -> Router:
        r = start_router(pd_fleet.engines, model_dir, *FORCE_PD, *extra)
        started.append(r)
        return r

    yield make
    for r in started:
        r.stop()


def _engine(fleet: RealFleet, name: str) -> str:
    return next(e.url for e in fleet.engines if e.name == name)


def _transfers(d_url: str) -> tuple[float, float]:
    """(NIXL transfers d0 completed, prompt tokens d0 took from a KV transfer)."""
    return (
        metric(d_url, "vllm:nixl_xfer_time_seconds_count"),
        metric(d_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
    )


def _plan(router: Router, body: dict[str, Any]) -> dict[str, Any]:
    route_body = {k: v for k, v in body.items() if k not in ("stream", "max_tokens", "temperature")}
    plan = router.route(route_body)["plan"]
    assert plan is not None
    return dict(plan["chosen"])


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(url + path, json={"model": MODEL, "temperature": 0.0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _sse_text(raw: str) -> str:
    """The generated text of a streamed chat answer (its ``delta.content`` pieces joined)."""
    assert raw.rstrip().endswith("data: [DONE]") and "event: error" not in raw, raw[-500:]
    out = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    return "".join(out)


def test_nixl_relay_non_streaming_completion_matches_in_place(
    pd_fleet: RealFleet, pd_router: Callable[..., Router]
) -> None:
    router = pd_router()
    p_url, d_url = _engine(pd_fleet, "p0"), _engine(pd_fleet, "d0")
    body = {"prompt": words(random.Random(11), PROMPT_WORDS), "max_tokens": 8}
    plan = _plan(router, body)
    assert (
        plan["kind"] == "disaggregated" and plan["prefill"]["name"] == "p0" and plan["decode"]["name"] == "d0"
    )
    assert plan["terms"]["handoff"] > 0
    xfers, external = _transfers(d_url)
    prefills = metric(p_url, "vllm:request_success_total")

    r = _post(router.url, "/v1/completions", body)
    assert r.headers["x-kvroute-replica"] == "d0" and r.headers["x-kvroute-prefill-replica"] == "p0"
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 8
    assert metric(p_url, "vllm:request_success_total") == prefills + 1  # the prefill leg ran on p0
    after = _transfers(d_url)
    assert after[0] == xfers + 1  # d0 pulled p0's blocks over NIXL: the relayed parameters were right
    assert after[1] > external  # ... and took the prompt from the transfer instead of computing it
    assert metric(router.url, "kvroute_pd_plans_total", kind="disaggregated") >= 1
    assert metric(router.url, "kvroute_pd_fallbacks_total") == 0

    alone = _post(p_url, "/v1/completions", body).json()  # p0 in place, the same dummy weights
    assert out["choices"][0]["text"] == alone["choices"][0]["text"]
    # the router learns the link from d0's own NIXL histograms at its next scrape (0.5 s)
    wait_until(
        lambda: metric(router.url, "kvroute_pd_link_samples_total", outcome="engine_accepted") >= 1,
        timeout=10,
        what="an engine-reported transfer sample",
    )


def test_nixl_relay_streaming_chat(pd_fleet: RealFleet, pd_router: Callable[..., Router]) -> None:
    router = pd_router()
    d_url = _engine(pd_fleet, "d0")
    body = {
        "messages": [{"role": "user", "content": words(random.Random(12), PROMPT_WORDS)}],
        "max_tokens": 6,
    }
    xfers, _ = _transfers(d_url)
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        timeout=120,
        json={"model": MODEL, "temperature": 0.0, "stream": True, **body},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-kvroute-prefill-replica"] == "p0" and r.headers["x-kvroute-replica"] == "d0"
        raw = r.read().decode()
    assert _transfers(d_url)[0] == xfers + 1
    alone = _post(_engine(pd_fleet, "p0"), "/v1/chat/completions", body).json()
    assert _sse_text(raw) == alone["choices"][0]["message"]["content"]


def test_nixl_client_leaving_mid_stream_frees_both_engines(
    pd_fleet: RealFleet, pd_router: Callable[..., Router]
) -> None:
    router = pd_router()
    d_url = _engine(pd_fleet, "d0")
    body = {
        "model": MODEL,
        "prompt": words(random.Random(13), PROMPT_WORDS),
        "max_tokens": 2000,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    generated = metric(d_url, "vllm:generation_tokens_total")
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the decode leg is streaming; now leave

    def idle() -> bool:
        engines = [_engine(pd_fleet, n) for n in ("p0", "d0")]
        return (
            all(
                metric(u, "vllm:num_requests_running") == 0 and metric(u, "vllm:num_requests_waiting") == 0
                for u in engines
            )
            and metric(router.url, "kvroute_replica_inflight_requests") == 0
        )

    wait_until(
        idle, timeout=60, interval=0.2, what="both engines idle and nothing in flight after the client left"
    )
    # d0 stopped decoding when the client left (it would otherwise have generated all 2000 tokens)
    assert metric(d_url, "vllm:generation_tokens_total") - generated < 2000


def test_nixl_pd_through_the_endpoint_picker(pd_fleet: RealFleet, model_dir: Path) -> None:
    """``kvroute epp`` on the same pair, behind the gateway stand-in: the picker runs the prefill leg on p0 itself
    and hands the gateway the decode request for d0 with p0's ``kv_transfer_params``; d0 pulls the blocks over
    NIXL instead of computing the prompt, and the greedy text equals p0's own answer in place. ``/route`` on the
    picker's HTTP port names the same pair."""
    gport = free_port()
    router = start_router(
        pd_fleet.engines, model_dir, *FORCE_PD, "--grpc-port", str(gport), "--grpc-insecure", command="epp"
    )
    try:
        p_url, d_url = _engine(pd_fleet, "p0"), _engine(pd_fleet, "d0")
        body = {"prompt": words(random.Random(15), PROMPT_WORDS), "max_tokens": 8}
        plan = _plan(router, body)
        assert plan["kind"] == "disaggregated" and (plan["prefill"]["name"], plan["decode"]["name"]) == (
            "p0",
            "d0",
        )
        xfers, external = _transfers(d_url)
        prefills = metric(p_url, "vllm:request_success_total")
        _, stub = stub_for(gport, tls=False)
        s = GatewayStream(stub, timeout=120)
        try:
            picked = s.request(
                "/v1/completions", json.dumps({"model": MODEL, "temperature": 0.0, **body}).encode()
            )
            assert picked.status is None and picked.endpoint == d_url.removeprefix("http://"), (
                picked.immediate
            )
            headers = {k: v for k, v in picked.set_headers.items() if k != "content-length"}
            out = json.loads(s.relay_response(picked.endpoint, "/v1/completions", picked.body, headers))
        finally:
            s.close()
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 8
        assert metric(p_url, "vllm:request_success_total") == prefills + 1  # the prefill leg ran on p0
        after = _transfers(d_url)
        assert after[0] == xfers + 1 and after[1] > external  # d0 pulled p0's blocks over NIXL
        alone = _post(p_url, "/v1/completions", body).json()
        assert out["choices"][0]["text"] == alone["choices"][0]["text"]
        assert metric(router.url, "kvroute_pd_fallbacks_total") == 0
    finally:
        router.stop()


def test_both_nixl_legs_are_traced_into_the_engines(
    pd_router: Callable[..., Router], otlp: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """p0's and d0's own ``llm_request`` spans land in the caller's trace, each under kvroute's span of its leg."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    router = pd_router("--otlp-traces-endpoint", otlp.endpoint)
    trace_id, parent = caller_trace()
    body = {"model": MODEL, "prompt": words(random.Random(5), PROMPT_WORDS), "max_tokens": 4}
    r = httpx.post(
        router.url + "/v1/completions",
        json=body,
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        timeout=120,
    )
    assert r.status_code == 200 and r.headers["x-kvroute-prefill-replica"] == "p0", r.text
    spans = wait_trace(otlp, trace_id, {"kvroute.request", "kvroute.pd.prefill", "kvroute.pd.decode"}, 2)
    request = one(spans, "kvroute.request")
    assert request.parent_id == parent
    for leg, service in (("kvroute.pd.prefill", "vllm-p0"), ("kvroute.pd.decode", "vllm-d0")):
        span = one(spans, leg)
        assert span.parent_id == request.span_id
        engine = [s for s in spans if s.name == "llm_request" and s.parent_id == span.span_id]
        assert [s.service for s in engine] == [service], (leg, spans)


def test_nixl_dead_prefill_engine_served_in_place_and_counted(
    pd_fleet: RealFleet, pd_router: Callable[..., Router]
) -> None:
    """Last in the module: it kills p0. Health probes and scrapes are slowed so that the request meets the dead
    prefill engine (the router has not noticed yet) rather than a plan that already avoids it."""
    router = pd_router("--probe-interval-s", "120", "--scrape-interval-s", "120")
    d_url = _engine(pd_fleet, "d0")
    body = {"prompt": words(random.Random(14), PROMPT_WORDS), "max_tokens": 4}
    assert _plan(router, body)["kind"] == "disaggregated"
    xfers, _ = _transfers(d_url)
    pd_fleet.kill(next(e for e in pd_fleet.engines if e.name == "p0"))
    r = _post(router.url, "/v1/completions", body)
    assert r.headers["x-kvroute-replica"] == "d0" and "x-kvroute-prefill-replica" not in r.headers
    assert r.json()["choices"][0]["text"]
    assert metric(router.url, "kvroute_pd_fallbacks_total", reason="prefill_failed") == 1
    assert _transfers(d_url)[0] == xfers  # nothing was transferred: d0 prefilled the prompt itself
