"""Distributed tracing through the router into the engines, end to end over real processes.

A real OTLP receiver (``tests/otlp_receiver.py``: gRPC ``TraceService`` and OTLP/HTTP, protobuf decoded with the
OpenTelemetry proto package) collects what ``kvroute serve`` / ``kvroute epp`` (started with
``--otlp-traces-endpoint``) and the stand-in engines (``kvroute fake-engine --otlp-traces-endpoint``, which
continue the ``traceparent`` they receive as vLLM does and export an ``llm_request`` span) export. A request that
carries a caller's ``traceparent`` must give one trace: ``kvroute.request`` parented on the caller's span, the
pipeline's steps under it, and each engine's ``llm_request`` parented on kvroute's attempt span (or on the PD leg's
span), through the HTTP door, through the endpoint picker (``loadtest/epp_gateway.py`` plays the gateway and
forwards the headers the picker hands back) and across both PD legs. Sampling ratio 0 exports nothing of requests
whose caller did not sample them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest

from fakes.fleet import EngineOptions, Fleet, pd_roles, scaled_profile_args
from loadtest.epp_gateway import GatewayStream, stub_for
from tests.helpers import Proc, free_port, wait_until
from tests.otlp_receiver import Receiver, Span, grpc_receiver, http_receiver

MODEL = "kvroute-fake"
PROMPT = [1000 + (i * 7) % 5000 for i in range(600)]  # token ids: no tokenizer involved
#: the steps every served request has as children of ``kvroute.request``
STEPS = {"kvroute.intake", "kvroute.tokenize", "kvroute.admission", "kvroute.decide"}
#: spans leave in batches every 100 ms here (OpenTelemetry's OTEL_BSP_SCHEDULE_DELAY; 5 s by default)
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
SERVER, CLIENT = 2, 3  # OTLP span kinds
STATUS_ERROR = 2  # OTLP status code


@dataclass
class Caller:
    """The caller's own span: the trace a request joins."""

    trace_id: str
    span_id: str

    @classmethod
    def new(cls) -> Caller:
        return cls(secrets.token_hex(16), secrets.token_hex(8))

    def traceparent(self, sampled: bool = True) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if sampled else '00'}"


@pytest.fixture(scope="module", autouse=True)
def fast_export() -> Iterator[None]:
    """Every process started here exports its spans within 100 ms (inherited environment)."""
    old = {k: os.environ.get(k) for k in FAST_EXPORT}
    os.environ.update(FAST_EXPORT)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    yield from grpc_receiver()


@pytest.fixture(scope="module")
def http_collector() -> Iterator[Receiver]:
    yield from http_receiver()


def _fleet(receiver: Receiver, roles: list[str] | None) -> Iterator[Fleet]:
    opts = EngineOptions(time_scale=0.02, extra_args=["--otlp-traces-endpoint", receiver.endpoint])
    fleet = Fleet(2, opts, roles=roles)
    try:
        fleet.start_engines()
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def colocated(receiver: Receiver, fast_export: None) -> Iterator[Fleet]:
    yield from _fleet(receiver, None)


@pytest.fixture(scope="module")
def pd_fleet(receiver: Receiver, fast_export: None) -> Iterator[Fleet]:
    yield from _fleet(receiver, pd_roles(1, 1))


@dataclass
class Router:
    proc: Proc
    url: str
    grpc_port: int = 0


def _router(fleet: Fleet, kind: str, *extra: str) -> Iterator[Router]:
    """``kvroute serve`` / ``kvroute epp`` in front of ``fleet``, ready when every replica is."""
    port, gport = free_port(), free_port()
    args = [kind, "--host", "127.0.0.1", "--port", str(port), "--tokenizer-mode", "bytes"]
    args += ["--block-size", str(fleet.engine.block_size), "--log-level", "warning"]
    args += scaled_profile_args(fleet.engine.profile, fleet.engine.time_scale)
    if kind == "epp":
        args += ["--grpc-port", str(gport)]
    if fleet.roles is not None:  # plans forced to disaggregate
        args += ["--pd-policy", "pd_ttft", "--pd-policy-params", "decode_prefills=false"]
    for eh in fleet.engines:
        args += ["--replica", fleet.replica_spec(eh)]
    proc = Proc.kvroute(*args, *extra)
    url = f"http://127.0.0.1:{port}"
    try:

        def all_ready() -> bool:
            try:
                reps = httpx.get(url + "/replicas", timeout=2).json()["replicas"]
            except httpx.HTTPError:
                return False
            return len(reps) == len(fleet.engines) and all(
                r["state"] == "ready" and r["load"]["age_s"] is not None for r in reps
            )

        wait_until(all_ready, timeout=40, what=f"kvroute {kind} with every replica ready")
        yield Router(proc, url, gport)
    finally:
        print(proc.stop()[-3000:])


@pytest.fixture(scope="module")
def traced_serve(colocated: Fleet, receiver: Receiver) -> Iterator[Router]:
    yield from _router(colocated, "serve", "--otlp-traces-endpoint", receiver.endpoint)


@pytest.fixture(scope="module")
def traced_epp(colocated: Fleet, receiver: Receiver) -> Iterator[Router]:
    yield from _router(colocated, "epp", "--otlp-traces-endpoint", receiver.endpoint, "--grpc-insecure")


# -- what the spans must say -------------------------------------------------------------------------------------
def _trace(
    receiver: Receiver, caller: Caller, engine_spans: int, *, extra: AbstractSet[str] = frozenset()
) -> list[Span]:
    """The caller's trace once kvroute's request span, its steps (+ ``extra``) and ``engine_spans`` engine spans
    arrived."""
    want = {"kvroute.request", *STEPS, *extra}

    def complete(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id == caller.trace_id]
        names = {s.name for s in mine}
        return want <= names and sum(s.name == "llm_request" for s in mine) >= engine_spans

    receiver.wait_for(f"the spans of trace {caller.trace_id}", complete)
    return receiver.in_trace(caller.trace_id)


def _one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, found)
    return found[0]


def _check_request(spans: list[Span], caller: Caller) -> Span:
    """kvroute's request span continues the caller's span; every step is its child."""
    request = _one(spans, "kvroute.request")
    assert request.parent_id == caller.span_id and request.kind == SERVER and request.service == "kvroute"
    for name in STEPS:
        assert _one(spans, name).parent_id == request.span_id, name
    return request


def _engine_span_under(spans: list[Span], parent: Span) -> Span:
    under = [s for s in spans if s.name == "llm_request" and s.parent_id == parent.span_id]
    assert len(under) == 1, (parent, [s for s in spans if s.name == "llm_request"])
    return under[0]


def _received(engine_url: str, caller: Caller) -> list[dict[str, str]]:
    """The trace contexts of the caller's trace ``engine_url`` received (``traceparent``, ``tracestate``,
    ``baggage``, ``path``), oldest first."""
    got = httpx.get(engine_url + "/admin/traces", timeout=5).json()["received"]
    return [t for t in got if t["traceparent"].split("-")[1] == caller.trace_id]


def _received_parent(engine_url: str, caller: Caller) -> list[str]:
    """The parent span ids of the caller's trace that ``engine_url`` received in ``traceparent``."""
    return [t["traceparent"].split("-")[2] for t in _received(engine_url, caller)]


def _fleet_received(fleet: Fleet, caller: Caller) -> list[tuple[str, str]]:
    """(path, parent span id) of every engine request of the caller's trace, sorted."""
    return sorted(
        (t["path"], t["traceparent"].split("-")[2]) for e in fleet.engines for t in _received(e.url, caller)
    )


# -- the HTTP door ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_request_with_traceparent_gives_one_trace_into_the_engine(
    traced_serve: Router, colocated: Fleet, receiver: Receiver, stream: bool
) -> None:
    caller = Caller.new()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": stream}
    r = httpx.post(
        traced_serve.url + "/v1/completions",
        json=body,
        headers={"traceparent": caller.traceparent(), "tracestate": "vendor=on"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    served_by = r.headers["x-kvroute-replica"]
    spans = _trace(receiver, caller, 1, extra={"kvroute.attempt"})
    request = _check_request(spans, caller)
    assert (
        request.attributes["gen_ai.request.model"] == MODEL and request.attributes["kvroute.stream"] == stream
    )
    assert request.attributes["http.response.status_code"] == 200
    decide = _one(spans, "kvroute.decide")
    assert decide.attributes["kvroute.replica"] == served_by
    assert decide.attributes["kvroute.predicted.cached_tokens"] == int(
        r.headers["x-kvroute-predicted-cached-tokens"]
    )
    assert {"kvroute.predicted.Q", "kvroute.predicted.C", "kvroute.predicted.ttft_s"} <= set(
        decide.attributes
    )
    attempt = _one(spans, "kvroute.attempt")
    assert attempt.parent_id == request.span_id and attempt.kind == CLIENT
    assert attempt.attributes["kvroute.replica"] == served_by and attempt.attributes["kvroute.ttft_s"] > 0
    engine = _engine_span_under(spans, attempt)  # the engine continued kvroute's attempt span
    assert engine.kind == SERVER and engine.service == "fake-engine"
    url = next(e.url for e in colocated.engines if e.name == served_by)
    assert _received_parent(url, caller) == [attempt.span_id]  # what the engine received on the wire
    got = httpx.get(url + "/admin/traces", timeout=5).json()["received"]
    assert any(t["tracestate"] == "vendor=on" for t in got)  # the caller's tracestate goes on


def test_unsampled_caller_and_ratio_zero_export_nothing_over_http_protobuf(
    colocated: Fleet, http_collector: Receiver
) -> None:
    """Sampling ratio 0 over OTLP/HTTP: requests without a caller's decision and a caller's unsampled
    traceparent export nothing (the engine is told not to sample either); a caller's sampled one still does."""
    router = _router(
        colocated,
        "serve",
        "--otlp-traces-endpoint",
        http_collector.endpoint,
        "--otlp-traces-protocol",
        "http/protobuf",
        "--trace-sample-ratio",
        "0",
    )
    routed = next(router)
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        unsampled = Caller.new()
        for headers in ({}, {}, {"traceparent": unsampled.traceparent(sampled=False)}):
            r = httpx.post(routed.url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
        flags = [
            t["traceparent"].split("-")[3]
            for e in colocated.engines
            for t in httpx.get(e.url + "/admin/traces", timeout=5).json()["received"]
            if t["traceparent"].split("-")[1] == unsampled.trace_id
        ]
        assert flags == ["00"]  # the engine got the trace context, marked not sampled
        sampled = Caller.new()  # the caller decides: exported even at ratio 0 (parent-based)
        r = httpx.post(
            routed.url + "/v1/completions",
            json=body,
            headers={"traceparent": sampled.traceparent()},
            timeout=30,
        )
        assert r.status_code == 200
        _trace(http_collector, sampled, 0, extra={"kvroute.attempt"})  # the exporter works and has flushed
        assert {s.trace_id for s in http_collector.spans()} == {sampled.trace_id}
    finally:
        next(router, None)


# -- the endpoint picker ----------------------------------------------------------------------------------------
def _through_gateway(router: Router, body: dict[str, Any], caller: Caller) -> tuple[Any, bytes]:
    """One request through the gateway stand-in with the caller's traceparent: the picker's answer, and what the
    client receives from the endpoint it picked (sent with the headers the picker set)."""
    _, stub = stub_for(router.grpc_port, tls=False)
    s = GatewayStream(stub, timeout=30.0)
    try:
        picked = s.request(
            "/v1/completions", json.dumps(body).encode(), headers={"traceparent": caller.traceparent()}
        )
        assert picked.status is None, picked.immediate
        headers = {k: v for k, v in picked.set_headers.items() if k.lower() != "content-length"}
        assert picked.endpoint is not None
        out = s.relay_response(picked.endpoint, "/v1/completions", picked.body, headers)
    finally:
        s.close()
    return picked, out


def test_picker_hands_the_gateway_a_traceparent_naming_its_attempt(
    traced_epp: Router, receiver: Receiver
) -> None:
    caller = Caller.new()
    picked, out = _through_gateway(traced_epp, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}, caller)
    assert json.loads(out)["choices"], out
    spans = _trace(receiver, caller, 1, extra={"kvroute.attempt"})
    request = _check_request(spans, caller)
    attempt = _one(spans, "kvroute.attempt")
    assert attempt.parent_id == request.span_id
    assert picked.set_headers["traceparent"].split("-")[1:3] == [caller.trace_id, attempt.span_id]
    _engine_span_under(spans, attempt)
    assert request.attributes["http.response.status_code"] == 200


# -- both PD legs -----------------------------------------------------------------------------------------------
def _check_legs(spans: list[Span], fleet: Fleet) -> None:
    """Each PD leg is a child of the request span, and each engine's span a child of its leg's span."""
    request = _one(spans, "kvroute.request")
    for leg, role in (("kvroute.pd.prefill", "prefill"), ("kvroute.pd.decode", "decode")):
        span = _one(spans, leg)
        assert span.parent_id == request.span_id and span.kind == CLIENT, leg
        engine = next(e for e in fleet.engines if e.role == role)
        assert span.attributes["kvroute.replica"] == engine.name
        _engine_span_under(spans, span)
    assert _one(spans, "kvroute.decide").attributes["kvroute.plan.kind"] == "disaggregated"


@pytest.mark.parametrize("stream", [False, True])
def test_both_pd_legs_continue_the_trace_through_the_http_door(
    pd_fleet: Fleet, receiver: Receiver, stream: bool
) -> None:
    for router in _router(pd_fleet, "serve", "--otlp-traces-endpoint", receiver.endpoint):
        caller = Caller.new()
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": stream}
        r = httpx.post(
            router.url + "/v1/completions",
            json=body,
            headers={"traceparent": caller.traceparent()},
            timeout=30,
        )
        assert r.status_code == 200 and r.headers["x-kvroute-plan"] == "disaggregated", r.text
        spans = _trace(receiver, caller, 2, extra={"kvroute.pd.prefill", "kvroute.pd.decode"})
        _check_request(spans, caller)
        _check_legs(spans, pd_fleet)


def test_both_pd_legs_continue_the_trace_through_the_picker(pd_fleet: Fleet, receiver: Receiver) -> None:
    extra = ("--otlp-traces-endpoint", receiver.endpoint, "--grpc-insecure")
    for router in _router(pd_fleet, "epp", *extra):
        caller = Caller.new()
        picked, out = _through_gateway(router, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}, caller)
        assert json.loads(out)["choices"], out
        spans = _trace(receiver, caller, 2, extra={"kvroute.pd.prefill", "kvroute.pd.decode"})
        _check_request(spans, caller)
        _check_legs(spans, pd_fleet)
        decode = _one(spans, "kvroute.pd.decode")
        assert picked.set_headers["traceparent"].split("-")[2] == decode.span_id  # the gateway's decode leg


# -- the engine /tokenize call, the engines' other endpoints ----------------------------------------------------
def test_the_engine_tokenize_call_carries_the_tokenize_span(colocated: Fleet, receiver: Receiver) -> None:
    """``--tokenizer-mode engine``: the router's own ``/tokenize`` call to a replica is a child of its
    ``kvroute.tokenize`` span, as the generation request is of its attempt span."""
    extra = ("--otlp-traces-endpoint", receiver.endpoint, "--tokenizer-mode", "engine")
    for router in _router(colocated, "serve", *extra):
        caller = Caller.new()
        body = {"model": MODEL, "prompt": "a prompt the engine tokenizes " * 20, "max_tokens": 2}
        r = httpx.post(
            router.url + "/v1/completions",
            json=body,
            headers={"traceparent": caller.traceparent()},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        spans = _trace(receiver, caller, 1, extra={"kvroute.attempt"})
        _check_request(spans, caller)
        tokenize = _one(spans, "kvroute.tokenize")
        assert tokenize.attributes["kvroute.tokenize.mode"] == "engine"
        attempt = _one(spans, "kvroute.attempt")
        assert _fleet_received(colocated, caller) == [
            ("/tokenize", tokenize.span_id),
            ("/v1/completions", attempt.span_id),
        ]


def _engine_endpoint_trace(receiver: Receiver, caller: Caller, route: str, steps: set[str]) -> Span:
    """The checks every traced request to an engine endpoint passes: kvroute's request span continues the
    caller's, on ``route``, answered 200; ``steps`` and one attempt its children. Returns the attempt span."""
    want = {"kvroute.request", "kvroute.attempt", *steps}
    receiver.wait_for(
        f"the spans of trace {caller.trace_id}",
        lambda spans: want <= {s.name for s in spans if s.trace_id == caller.trace_id},
    )
    spans = receiver.in_trace(caller.trace_id)
    request = _one(spans, "kvroute.request")
    assert request.parent_id == caller.span_id and request.kind == SERVER
    assert request.attributes["http.route"] == route
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["gen_ai.request.model"] == MODEL
    for name in want - {"kvroute.request"}:
        assert _one(spans, name).parent_id == request.span_id, name
    attempt = _one(spans, "kvroute.attempt")
    assert attempt.kind == CLIENT and attempt.attributes["http.response.status_code"] == 200
    return attempt


def test_a_responses_request_is_traced_like_a_completion(
    traced_serve: Router, colocated: Fleet, receiver: Receiver
) -> None:
    caller = Caller.new()
    body = {"model": MODEL, "input": "hello there, how are you", "max_output_tokens": 3}
    r = httpx.post(
        traced_serve.url + "/v1/responses",
        json=body,
        headers={"traceparent": caller.traceparent()},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    attempt = _engine_endpoint_trace(receiver, caller, "/v1/responses", STEPS)
    tokenize = _one(receiver.in_trace(caller.trace_id), "kvroute.tokenize")
    assert tokenize.attributes["kvroute.tokenize.tokens"] > 0
    assert _fleet_received(colocated, caller) == [("/v1/responses", attempt.span_id)]


@pytest.fixture(scope="module")
def pooling(receiver: Receiver, fast_export: None) -> Iterator[Fleet]:
    """One embedding engine (vLLM's pooling runner)."""
    opts = EngineOptions(time_scale=0.02, extra_args=["--runner", "pooling", "--convert", "embed"])
    fleet = Fleet(1, opts)
    try:
        fleet.start_engines()
        yield fleet
    finally:
        fleet.stop()


def test_an_embeddings_request_is_traced_like_a_completion(pooling: Fleet, receiver: Receiver) -> None:
    for router in _router(pooling, "serve", "--otlp-traces-endpoint", receiver.endpoint):
        caller = Caller.new()
        r = httpx.post(
            router.url + "/v1/embeddings",
            json={"model": MODEL, "input": "embed me"},
            headers={"traceparent": caller.traceparent()},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        steps = {"kvroute.intake", "kvroute.admission", "kvroute.decide"}  # routed by load: nothing tokenized
        attempt = _engine_endpoint_trace(receiver, caller, "/v1/embeddings", steps)
        assert _fleet_received(pooling, caller) == [("/v1/embeddings", attempt.span_id)]


# -- tracing off: the caller's trace context passes through ------------------------------------------------------
def test_tracing_off_the_http_door_passes_the_callers_trace_context_through(colocated: Fleet) -> None:
    """Without ``--otlp-traces-endpoint`` the router is transparent: every engine request of a request (the
    generation request, the engine ``/tokenize`` call, another endpoint's request) carries the caller's
    ``traceparent``, ``tracestate`` and ``baggage`` unchanged."""
    for router in _router(colocated, "serve", "--tokenizer-mode", "engine"):
        caller = Caller.new()
        sent = {"traceparent": caller.traceparent(), "tracestate": "vendor=passed", "baggage": "user=42"}
        calls = [
            ("/v1/completions", {"model": MODEL, "prompt": "tokenized by the engine " * 10, "max_tokens": 2}),
            ("/v1/responses", {"model": MODEL, "input": "hello", "max_output_tokens": 2}),
        ]
        for path, body in calls:
            r = httpx.post(router.url + path, json=body, headers=sent, timeout=30)
            assert r.status_code == 200, r.text
        got = [t for e in colocated.engines for t in _received(e.url, caller)]
        assert sorted(t["path"] for t in got) == [
            "/tokenize",
            "/tokenize",
            "/v1/completions",
            "/v1/responses",
        ]
        for t in got:
            assert (t["traceparent"], t["tracestate"], t["baggage"]) == tuple(sent.values()), t


def test_tracing_off_both_pd_legs_carry_the_callers_trace_context(pd_fleet: Fleet) -> None:
    """A disaggregated plan with tracing off: through the HTTP door both legs carry the caller's ``traceparent``;
    through the endpoint picker the gateway forwards the client's headers itself, and the prefill leg (the
    picker's own request) carries it too."""
    prefill = next(e for e in pd_fleet.engines if e.role == "prefill")
    decode = next(e for e in pd_fleet.engines if e.role == "decode")
    for router in _router(pd_fleet, "serve"):
        caller = Caller.new()
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
        r = httpx.post(
            router.url + "/v1/completions",
            json=body,
            headers={"traceparent": caller.traceparent()},
            timeout=30,
        )
        assert r.status_code == 200 and r.headers["x-kvroute-plan"] == "disaggregated", r.text
        for engine in (prefill, decode):
            assert [t["traceparent"] for t in _received(engine.url, caller)] == [caller.traceparent()]
    for router in _router(pd_fleet, "epp", "--grpc-insecure"):
        caller = Caller.new()
        picked, out = _through_gateway(router, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}, caller)
        assert json.loads(out)["choices"], out
        assert [t["traceparent"] for t in _received(prefill.url, caller)] == [caller.traceparent()]
        assert picked.set_headers.get("traceparent", caller.traceparent()) == caller.traceparent()


# -- trace ids to users: the answer's header, error bodies, the access log ----------------------------------------
TRACE_ID = re.compile(r"^[0-9a-f]{32}$")


def _access_lines(router: Router) -> list[dict[str, Any]]:
    """uvicorn's access lines the router logged so far (JSON logs)."""
    lines = [json.loads(x) for x in router.proc.output().splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("logger") == "uvicorn.access"]


def _access_lines_with_query(router: Router, n: int) -> bool:
    """``n`` access lines of a ``/v1/completions?as=`` request so far."""
    return sum("/v1/completions?as=" in x["msg"] for x in _access_lines(router)) == n


def _wait_for_request_span(receiver: Receiver, trace_id: str) -> Span:
    """kvroute's request span of trace ``trace_id``, once it arrived."""
    receiver.wait_for(
        f"kvroute.request of trace {trace_id}",
        lambda spans: any(s.trace_id == trace_id and s.name == "kvroute.request" for s in spans),
    )
    return _one(receiver.in_trace(trace_id), "kvroute.request")


def test_tracing_on_the_http_door_names_the_trace_in_answers_and_error_bodies(
    traced_serve: Router, receiver: Receiver
) -> None:
    """Tracing on: a served answer names its trace (the caller's) in ``x-kvroute-trace-id``; a refused request
    without a ``traceparent`` names the trace the router started, in the header and in ``error.trace_id``, and
    that trace holds the request's span (the bug report leads to the trace)."""
    caller = Caller.new()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(
        traced_serve.url + "/v1/completions",
        json=body,
        headers={"traceparent": caller.traceparent()},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["x-kvroute-trace-id"] == caller.trace_id, r.text
    bad = httpx.post(
        traced_serve.url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert bad.status_code == 400, bad.text
    trace_id = bad.json()["error"]["trace_id"]
    assert TRACE_ID.match(trace_id) and bad.headers["x-kvroute-trace-id"] == trace_id
    request = _wait_for_request_span(receiver, trace_id)
    assert request.kind == SERVER and request.status_code == STATUS_ERROR, request
    # the span names the refusal the client got, not the framework's validation error
    assert request.attributes["http.response.status_code"] == 400, request.attributes
    assert request.attributes["kvroute.error.code"] == bad.json()["error"]["code"], request.attributes


def test_tracing_off_the_callers_trace_id_names_answers_errors_and_access_lines(colocated: Fleet) -> None:
    """Tracing off: a request with a valid ``traceparent`` gets its trace id back in ``x-kvroute-trace-id``, in
    ``error.trace_id`` (a refusal of the pipeline, and the framework's 404 before it) and on its access log line;
    a request without one gets none of them."""
    for router in _router(colocated, "serve", "--access-log", "--log-level", "info", "--log-format", "json"):
        caller = Caller.new()
        traced = {"traceparent": caller.traceparent()}
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        ok = httpx.post(router.url + "/v1/completions?as=traced", json=body, headers=traced, timeout=30)
        assert ok.status_code == 200 and ok.headers["x-kvroute-trace-id"] == caller.trace_id, ok.text
        for path, content, status in [("/v1/completions", b"{not json", 400), ("/v1/nowhere", b"{}", 404)]:
            bad = httpx.post(router.url + path, content=content, headers=traced, timeout=30)
            assert bad.status_code == status, bad.text
            assert bad.json()["error"]["trace_id"] == caller.trace_id == bad.headers["x-kvroute-trace-id"]
        plain = httpx.post(router.url + "/v1/completions?as=plain", json=body, timeout=30)
        assert plain.status_code == 200 and "x-kvroute-trace-id" not in plain.headers
        refused = httpx.post(router.url + "/v1/completions", content=b"{not json", timeout=30)
        assert "trace_id" not in refused.json()["error"] and "x-kvroute-trace-id" not in refused.headers

        wait_until(
            partial(_access_lines_with_query, router, 2),
            timeout=10,
            what="the access lines of both requests",
        )
        by_query = {
            x["msg"].split("?as=")[1].split()[0]: x for x in _access_lines(router) if "?as=" in x["msg"]
        }
        assert by_query["traced"]["trace_id"] == caller.trace_id
        assert "trace_id" not in by_query["plain"]


def _gateway(router: Router, path: str, body: bytes, headers: dict[str, str]) -> tuple[Any, dict[str, str]]:
    """One request through the gateway stand-in: the picker's answer, and (when it picked a replica) the headers
    it added to the client's response."""
    _, stub = stub_for(router.grpc_port, tls=False)
    s = GatewayStream(stub, timeout=30.0)
    try:
        picked = s.request(path, body, headers=headers)
        if picked.status is None:
            sent = {k: v for k, v in picked.set_headers.items() if k.lower() != "content-length"}
            assert picked.endpoint is not None
            s.relay_response(picked.endpoint, path, picked.body, sent)
    finally:
        s.close()
    return picked, s.response_set_headers


def _immediate_error(picked: Any) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(picked.immediate.body)["error"]
    return error


def test_picker_names_the_trace_in_answers_and_immediate_responses(
    traced_epp: Router, receiver: Receiver
) -> None:
    """Through the endpoint picker with tracing on: the client's answer names the caller's trace in
    ``x-kvroute-trace-id``; an ImmediateResponse names it in ``error.trace_id`` and the header, and without a
    ``traceparent`` the trace the router started, which holds the request's span."""
    caller = Caller.new()
    traced = {"traceparent": caller.traceparent()}
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()
    picked, client = _gateway(traced_epp, "/v1/completions", body, traced)
    assert picked.status is None and client["x-kvroute-trace-id"] == caller.trace_id, client
    picked, _ = _gateway(traced_epp, "/v1/completions", b"{not json", traced)
    assert picked.status == 400 and _immediate_error(picked)["trace_id"] == caller.trace_id
    assert picked.immediate_headers()["x-kvroute-trace-id"] == caller.trace_id
    picked, _ = _gateway(traced_epp, "/v1/completions", b"{not json", {})
    trace_id = _immediate_error(picked)["trace_id"]
    assert TRACE_ID.match(trace_id) and picked.immediate_headers()["x-kvroute-trace-id"] == trace_id
    request = _wait_for_request_span(receiver, trace_id)
    assert request.kind == SERVER and request.status_code == STATUS_ERROR, request


def test_picker_tracing_off_names_only_a_callers_trace(colocated: Fleet) -> None:
    """The endpoint picker with tracing off: a refusal (before the pipeline: an unauthorized request; in it: an
    invalid body) and a served answer name the caller's trace; a request without ``traceparent`` names none."""
    for router in _router(colocated, "epp", "--grpc-insecure"):
        caller = Caller.new()
        traced = {"traceparent": caller.traceparent()}
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()
        picked, client = _gateway(router, "/v1/completions", body, traced)
        assert picked.status is None and client["x-kvroute-trace-id"] == caller.trace_id, client
        for path in ("/v1/completions", "/not/served"):
            picked, _ = _gateway(router, path, b"{not json", traced)
            assert picked.status in (400, 404) and _immediate_error(picked)["trace_id"] == caller.trace_id
        picked, client = _gateway(router, "/v1/completions", body, {})
        assert picked.status is None and "x-kvroute-trace-id" not in client
        picked, _ = _gateway(router, "/v1/completions", b"{not json", {})
        assert picked.status == 400 and "trace_id" not in _immediate_error(picked)
        assert "x-kvroute-trace-id" not in picked.immediate_headers()


# -- SGLang's native /generate -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sglang(fast_export: None) -> Iterator[Fleet]:
    """One SGLang-dialect stand-in engine (its native ``/generate``)."""
    fleet = Fleet(1, EngineOptions(dialect="sglang", kv_events_format="sglang", time_scale=0.02))
    try:
        fleet.start_engines()
        yield fleet
    finally:
        fleet.stop()


def test_an_sglang_generate_request_is_traced_like_a_completion(sglang: Fleet, receiver: Receiver) -> None:
    """SGLang's ``/generate`` through ``kvroute serve``, streamed and not: kvroute's request span continues the
    caller's, the steps and the attempt are its children, and the engine receives a ``traceparent`` naming the
    attempt span."""
    for router in _router(sglang, "serve", "--otlp-traces-endpoint", receiver.endpoint):
        for stream in (False, True):
            caller = Caller.new()
            body = {"text": "route me to the cached prefix " * 8, "sampling_params": {"max_new_tokens": 3}}
            r = httpx.post(
                router.url + "/generate",
                json={**body, "stream": stream},
                headers={"traceparent": caller.traceparent()},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-trace-id"] == caller.trace_id
            attempt = _engine_endpoint_trace(receiver, caller, "/generate", STEPS)
            assert _fleet_received(sglang, caller) == [("/generate", attempt.span_id)], stream
