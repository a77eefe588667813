"""``kvroute epp`` as a real process between a gateway stand-in (a real gRPC client built from Envoy's ext_proc
protos, ``loadtest/epp_gateway.py``, dialing TLS as gateways do) and real ``kvroute fake-engine`` processes on
loopback.

Covers the endpoint-picker protocol: destination header and ``envoy.lb`` metadata (identical), route-cache
clearing, bodies re-streamed within Envoy's message limit (also bodies larger than one message), headers-only
requests, streamed responses passed through with usage feedback and in-flight release, the subset hint (in and
out of the pool, empty), 503 with no ready replica, 429 when shedding, client cancel mid-stream, malformed
bodies (ImmediateResponse 400), the gRPC health services; and that the HTTP service (/route, /metrics) still
answers in EPP mode, with the same pick.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest.epp_gateway import FULL_DUPLEX, GatewayStream, channel_for, stub_for
from tests.helpers import Proc, free_port, metric, start_fake_engine, wait_until

MODEL = "m"


@dataclass
class Fleet:
    http: str
    grpc_port: int
    engines: list[str]  # ip:port
    router: Proc
    tls: bool = True  # the picker serves TLS (the default); False: started with --grpc-insecure

    def stream(
        self, mode: int = FULL_DUPLEX, response_mode: int | None = None, timeout: float = 20.0
    ) -> GatewayStream:
        _, stub = stub_for(self.grpc_port, tls=self.tls)
        return GatewayStream(stub, timeout, mode=mode, response_mode=response_mode)

    def channel(self) -> grpc.Channel:
        return channel_for(self.grpc_port, tls=self.tls)

    def inflight(self) -> int:
        reps = httpx.get(self.http + "/replicas", timeout=5).json()["replicas"]
        return sum(int(r["load"]["inflight_requests"]) for r in reps)


def _engine(seed: int) -> tuple[Proc, int]:
    """A fake vLLM engine (started again on new ports if another process took one); (process, HTTP port)."""
    proc, port, _, _ = start_fake_engine(
        "--model",
        MODEL,
        "--dialect",
        "vllm",
        "--time-scale",
        "0.02",
        "--max-model-len",
        "1000000",
        "--enable-prompt-tokens-details",
        "--seed",
        str(seed),
    )
    return proc, port


def start_epp(replicas: list[str], *extra: str, ready: int | None = None, tls: bool = True) -> Fleet:
    """``kvroute epp`` on ``replicas`` (serving TLS unless ``tls`` is False: ``--grpc-insecure``), up (and with
    ``ready`` routable replicas)."""
    port, gport = free_port(), free_port()
    args = [
        "epp",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--grpc-port",
        str(gport),
        "--tokenizer-mode",
        "bytes",
        "--probe-interval-s",
        "0.3",
        "--probe-timeout-s",
        "0.5",
        "--log-level",
        "warning",
        *([] if tls else ["--grpc-insecure"]),
        *extra,
    ]
    for i, url in enumerate(replicas):
        args += ["--replica", f"name=e{i},url={url},dialect=vllm,model={MODEL}"]
    router = Proc.kvroute(*args)
    http = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _get_ok(http + "/healthz"), timeout=30, what="kvroute epp up")
        if ready:
            wait_until(
                lambda: httpx.get(http + "/readyz").json().get("routable_replicas") == ready,
                timeout=20,
                what=f"{ready} routable replicas",
            )
    except BaseException:
        router.stop()
        raise
    return Fleet(http, gport, [u.removeprefix("http://") for u in replicas], router, tls)


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    engines: list[Proc] = []
    ports: list[int] = []
    f: Fleet | None = None
    try:
        for seed in (1, 2):
            proc, port = _engine(seed)
            engines.append(proc)
            ports.append(port)
        f = start_epp([f"http://127.0.0.1:{p}" for p in ports], ready=2)
        yield f
    finally:
        if f is not None:
            f.router.stop()
        for e in engines:
            e.stop()


def _body(prompt: str, **kw: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, **kw}).encode()


def test_bodied_request_gets_destination_header_and_identical_metadata(fleet: Fleet) -> None:
    body = _body("hello " * 50)
    s = fleet.stream()
    picked = s.request("/v1/completions", body)
    assert picked.immediate is None
    assert picked.endpoint in fleet.engines
    assert picked.metadata_endpoint == picked.endpoint  # header and envoy.lb metadata never differ
    assert picked.clear_route_cache
    assert picked.body == body and picked.eos_flags[-1]  # non-streamed: the body goes back unchanged
    assert "content-length" not in picked.set_headers
    # the gateway forwards; the client gets the engine's answer through the picker's response path
    out = s.relay_response(picked.endpoint, "/v1/completions", picked.body)
    s.close()
    assert json.loads(out)["usage"]["prompt_tokens"] > 0
    wait_until(lambda: fleet.inflight() == 0, timeout=5, what="in-flight released")
    # /route on the same process picks the same replica for the same request (one core, two front doors)
    r = httpx.post(fleet.http + "/route", content=body, timeout=10).json()
    names = {f"e{i}": e for i, e in enumerate(fleet.engines)}
    assert names[r["chosen"]["name"]] == picked.endpoint


def test_chunked_body_larger_than_one_message_is_restreamed_within_envoy_limits(fleet: Fleet) -> None:
    body = _body("x" * 200_000)  # ~200 KB: 4 gateway messages of 64 KiB
    s = fleet.stream()
    picked = s.request("/v1/completions", body, chunk=65536)
    s.cancel()
    assert picked.immediate is None and picked.endpoint in fleet.engines
    assert picked.body == body
    assert max(picked.chunk_sizes) <= 62_000 and len(picked.chunk_sizes) == 4
    assert picked.eos_flags == [False, False, False, True]
    wait_until(lambda: fleet.inflight() == 0, timeout=5, what="in-flight released after the cancel")


def test_headers_only_request_is_routed_by_load(fleet: Fleet) -> None:
    s = fleet.stream()
    picked = s.request("/v1/models", None, method="GET")
    s.cancel()
    assert picked.immediate is None
    assert picked.endpoint in fleet.engines and picked.metadata_endpoint == picked.endpoint
    assert picked.body == b"" and picked.chunk_sizes == []  # nothing re-streamed: there was no body


def test_streamed_response_feeds_back_usage_and_releases(fleet: Fleet) -> None:
    before = metric(fleet.http, "kvroute_ttft_seconds_count")
    body = _body("stream me " * 40, stream=True)
    s = fleet.stream()
    picked = s.request("/v1/completions", body)
    assert picked.immediate is None
    # the picker asks for stream usage (as the proxy does) and says the new length
    sent = json.loads(picked.body)
    assert sent["stream_options"] == {"include_usage": True}
    assert picked.set_headers["content-length"] == str(len(picked.body))
    assert fleet.inflight() == 1
    assert picked.endpoint is not None  # an endpoint was picked (not answered immediately)
    out = s.relay_response(picked.endpoint, "/v1/completions", picked.body)
    s.close()
    assert out.rstrip().endswith(b"data: [DONE]")
    assert b'"usage"' not in out  # the client did not ask for usage: the usage chunk is removed
    wait_until(lambda: fleet.inflight() == 0, timeout=5, what="in-flight released at the end of the stream")
    assert metric(fleet.http, "kvroute_ttft_seconds_count") == before + 1


def test_subset_hint_in_pool_out_of_pool_and_empty(fleet: Fleet) -> None:
    body = _body("subset " * 30)
    for target in fleet.engines:  # in the pool: the only eligible endpoint is picked
        s = fleet.stream()
        picked = s.request("/v1/completions", body, subset=[target])
        s.cancel()
        assert picked.endpoint == target
    for subset in (["10.255.255.1:8000"], []):  # out of the pool, and an empty hint: 503
        s = fleet.stream()
        picked = s.request("/v1/completions", body, subset=subset)
        assert picked.status == 503
        assert picked.immediate_headers()["x-kvroute-rejected-reason"] == "no_endpoint_in_subset"
    wait_until(lambda: fleet.inflight() == 0, timeout=5, what="in-flight released")


def test_malformed_body_is_an_immediate_400_not_a_broken_stream(fleet: Fleet) -> None:
    s = fleet.stream()
    picked = s.request("/v1/completions", b'{"model": "m", "prompt": ')
    assert picked.status == 400
    err = json.loads(picked.immediate.body)["error"]
    assert err["code"] == "invalid_json"
    assert picked.immediate_headers()["x-kvroute-rejected-reason"] == "invalid_json"
    s2 = fleet.stream()  # invalid fields: 422 naming the field, as the HTTP routes answer
    picked2 = s2.request("/v1/completions", b'{"model": "m"}')
    assert picked2.status == 422 and "prompt" in json.loads(picked2.immediate.body)["error"]["message"]


def test_client_cancel_mid_stream_releases_inflight(fleet: Fleet) -> None:
    s = fleet.stream()
    picked = s.request("/v1/completions", _body("cancel me " * 20, stream=True))
    assert picked.immediate is None
    assert fleet.inflight() == 1
    assert metric(fleet.http, "kvroute_inflight_requests") == 1
    s.cancel()  # the client went away: Envoy resets the ext_proc stream
    wait_until(lambda: fleet.inflight() == 0, timeout=5, what="replica in-flight released on cancel")
    wait_until(
        lambda: metric(fleet.http, "kvroute_inflight_requests") == 0,
        timeout=5,
        what="admission slot released on cancel",
    )


def test_http_service_and_grpc_health_in_epp_mode(fleet: Fleet) -> None:
    assert httpx.get(fleet.http + "/readyz").status_code == 200
    assert "kvroute_epp_requests_total" in httpx.get(fleet.http + "/metrics").text
    s = fleet.stream()
    assert s.request("/v1/completions", _body("open")).immediate is None
    assert metric(fleet.http, "kvroute_epp_streams_active") == 1
    s.cancel()
    wait_until(lambda: metric(fleet.http, "kvroute_epp_streams_active") == 0, timeout=5, what="stream closed")
    channel = fleet.channel()
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
    channel.close()


def test_no_ready_replica_is_503_and_shedding_is_429() -> None:
    """(In plaintext: ``--grpc-insecure``, for gateways that dial h2c.)"""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: never ready
    f = start_epp([dead], "--no-panic-routing", tls=False)
    try:
        s = f.stream()
        picked = s.request("/v1/completions", _body("nobody home"))
        assert picked.status == 503
        assert picked.immediate_headers()["x-kvroute-rejected-reason"] == "no_routable_replica"
        channel = f.channel()
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=5
        )
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        channel.close()
    finally:
        f.router.stop()
    engine, port = _engine(3)
    g: Fleet | None = None
    try:
        g = start_epp(
            [f"http://127.0.0.1:{port}"],
            "--max-inflight-total",
            "1",
            "--max-queued-requests",
            "0",
            ready=1,
            tls=False,
        )
        first = g.stream()
        assert first.request("/v1/completions", _body("one")).immediate is None  # holds the only slot
        second = g.stream()
        picked = second.request("/v1/completions", _body("two"))
        assert picked.status == 429
        headers = picked.immediate_headers()
        assert headers["x-kvroute-rejected-reason"] and "retry-after" in headers
        first.cancel()
        wait_until(lambda: g is not None and g.inflight() == 0, timeout=5, what="slot released")
        third = g.stream()
        assert third.request("/v1/completions", _body("three")).immediate is None
        third.cancel()
    finally:
        if g is not None:
            g.router.stop()
        engine.stop()


def test_tenant_identity_quota_and_slo_through_the_picker() -> None:
    """The picker admits like the HTTP front door (router/core/tenant_admission.py): a malformed identity header is a
    400 naming it, a tenant over its quota a 429 ``quota``, an unattainable TTFT target a 429
    ``slo_unattainable``, and an admitted request is counted for its tenant and class."""
    engine, port = _engine(4)
    quota = json.dumps({"small": {"tokens_per_s": 1, "burst_tokens": 20}})
    g: Fleet | None = None
    try:
        g = start_epp([f"http://127.0.0.1:{port}"], "--tenants", quota, ready=1)
        bad = g.stream().request("/v1/completions", _body("hi"), headers={"x-kvroute-priority": "whenever"})
        assert bad.status == 400 and json.loads(bad.immediate.body)["error"]["param"] == "x-kvroute-priority"
        over = g.stream().request(
            "/v1/completions",
            _body("a prompt longer than twenty tokens " * 3),
            headers={"x-kvroute-tenant": "small"},
        )
        assert over.status == 429 and over.immediate_headers()["x-kvroute-rejected-reason"] == "quota"
        assert json.loads(over.immediate.body)["error"]["reason"] == "quota"
        slo = g.stream().request(
            "/v1/completions", _body("hello"), headers={"x-kvroute-ttft-target-ms": "0.0001"}
        )
        assert (
            slo.status == 429 and slo.immediate_headers()["x-kvroute-rejected-reason"] == "slo_unattainable"
        )
        s = g.stream()
        ok = s.request(
            "/v1/completions",
            _body("hello"),
            headers={"x-kvroute-tenant": "acme", "x-kvroute-priority": "critical"},
        )
        assert ok.immediate is None and ok.endpoint == f"127.0.0.1:{port}"
        s.relay_response(ok.endpoint, "/v1/completions", ok.body)
        s.close()
        assert metric(g.http, "kvroute_tenant_requests_total", tenant="acme", **{"class": "critical"}) == 1
        wait_until(lambda: g is not None and g.inflight() == 0, timeout=5, what="released")
    finally:
        if g is not None:
            g.router.stop()
        engine.stop()
