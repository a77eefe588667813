"""Router-controlled fields a client sends never reach an engine (router/serve/client_fields.py), on every door.

A client body carrying ``kv_transfer_params`` (pointing the engine's KV pull at a host of its choosing), SGLang's
``bootstrap_*`` and data-parallel fields, and the header ``X-data-parallel-rank``: through ``kvroute serve``
(served in place, disaggregated over the vLLM relay, disaggregated over SGLang bootstrap rooms) and through
``kvroute epp`` (the project's gateway client applies the picker's header and body mutations as Envoy does), the
stand-in engines record what each request carried (``GET /debug/pd_legs``): only the router's own values.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fakes.fleet import EngineOptions, Fleet, pd_roles
from loadtest.epp_gateway import GatewayStream, stub_for
from tests.helpers import Proc, free_port, metric, start_fake_engine, wait_http_ok
from tests.integration.test_epp_protocol import MODEL, start_epp

PROMPT = [1000 + (i * 7) % 5000 for i in range(600)]
#: what a hostile client adds to its body: each field would steer an engine's KV transfer or DP rank
HOSTILE = {
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "remote_host": "10.66.66.66",
        "remote_port": 5600,
        "remote_engine_id": "attacker",
        "remote_block_ids": [1, 2, 3],
        "remote_bootstrap_addr": "http://10.66.66.66:8998",
        "transfer_id": "t",
    },
    "bootstrap_host": "10.66.66.66",
    "bootstrap_port": 8998,
    "bootstrap_room": 42,
    "bootstrap_pair_key": "k",
    "routed_dp_rank": 3,
    "data_parallel_rank": 3,
    "disagg_prefill_dp_rank": 3,
    "kv_router_hint": {"source_control_endpoint": "tcp://10.66.66.66:1"},
}
HEADERS = {"X-data-parallel-rank": "3"}


def _body(model: str = "kvroute-fake", **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": 4, **HOSTILE, **extra}


def _records(urls: list[str], request_id: str) -> list[dict[str, Any]]:
    """The legs every engine served for ``request_id``, as the engines recorded them."""
    out: list[dict[str, Any]] = []
    for url in urls:
        legs = httpx.get(url + "/debug/pd_legs", timeout=5).json()
        out.extend(rec for rec in legs if rec["request_id"] == request_id)
    return out


def _pd_fleet(dialect: str, time_scale: float) -> Fleet:
    opts = EngineOptions(
        dialect=dialect, kv_events_format="sglang" if dialect == "sglang" else "vllm", time_scale=time_scale
    )
    fleet = Fleet(2, opts, roles=pd_roles(1, 1))
    try:
        fleet.start_engines()
        fleet.start_kvroute(
            "ttft", extra_args=["--pd-policy", "pd_ttft", "--pd-policy-params", "decode_prefills=false"]
        )
    except BaseException:
        fleet.stop()
        raise
    return fleet


@pytest.mark.parametrize(("dialect", "time_scale"), [("vllm", 0.01), ("sglang", 0.2)])
def test_disaggregated_legs_carry_only_the_routers_fields(dialect: str, time_scale: float) -> None:
    fleet = _pd_fleet(dialect, time_scale)
    try:
        assert fleet.router is not None
        for stream in (False, True):
            rid = f"hostile-{dialect}-{stream}"
            r = httpx.post(
                fleet.router.url + "/v1/completions",
                json=_body(stream=stream),
                headers={**HEADERS, "x-request-id": rid},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert r.headers.get("x-kvroute-prefill-replica"), "served disaggregated"
            legs = {rec["leg"]: rec for rec in _records([e.url for e in fleet.engines], rid)}
            assert set(legs) == {"prefill", "decode"}, legs
            for rec in legs.values():
                assert rec["dp_header"] is None, rec
                assert "routed_dp_rank" not in rec["fields"] and "data_parallel_rank" not in rec["fields"]
                assert "kv_router_hint" not in rec["fields"] and "bootstrap_pair_key" not in rec["fields"]
                assert "10.66.66.66" not in json.dumps(rec["fields"]), rec
            if dialect == "vllm":
                sent = legs["prefill"]["fields"]["kv_transfer_params"]
                assert sent["do_remote_decode"] is True and sent["remote_host"] is None
                relayed = legs["decode"]["fields"]["kv_transfer_params"]
                assert relayed["remote_host"] == "127.0.0.1" and relayed["remote_engine_id"] != "attacker"
            else:
                for rec in legs.values():
                    assert rec["fields"]["bootstrap_host"] == "127.0.0.1"
                    assert rec["fields"]["bootstrap_room"] != 42
                    assert rec["fields"]["bootstrap_port"] == fleet.engines[0].bootstrap_port
        assert metric(fleet.router.url, "kvroute_client_fields_stripped_total", field="bootstrap_host") == 2
        assert (
            metric(fleet.router.url, "kvroute_client_fields_stripped_total", field="kv_transfer_params") == 2
        )
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def plain_engine() -> Iterator[tuple[str, str]]:
    """One ordinary (co-located) stand-in engine: (its URL, its ip:port)."""
    proc, port, _, _ = start_fake_engine(
        "--model", MODEL, "--dialect", "vllm", "--time-scale", "0.01", "--max-model-len", "100000"
    )
    try:
        yield f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"
    finally:
        proc.stop()


def test_served_in_place_the_engine_gets_none_of_them(plain_engine: tuple[str, str]) -> None:
    url, _ = plain_engine
    port = free_port()
    router = Proc.kvroute(
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tokenizer-mode",
        "bytes",
        "--log-level",
        "warning",
        "--replica",
        f"name=e0,url={url},dialect=vllm,model={MODEL}",
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http_ok(base + "/readyz", timeout=30)
        rid = "hostile-in-place"
        r = httpx.post(
            base + "/v1/completions", json=_body(MODEL), headers={**HEADERS, "x-request-id": rid}, timeout=30
        )
        assert r.status_code == 200, r.text
        (rec,) = _records([url], rid)
        assert rec["fields"] == {} and rec["dp_header"] is None, rec
        assert metric(base, "kvroute_client_fields_stripped_total", field="kv_transfer_params") == 1
    finally:
        router.stop()


def test_endpoint_picker_strips_the_body_and_removes_the_header(plain_engine: tuple[str, str]) -> None:
    url, endpoint = plain_engine
    epp = start_epp([url], ready=1)
    try:
        _, stub = stub_for(epp.grpc_port)
        s = GatewayStream(stub)
        rid = "hostile-picker"
        client_headers = {**HEADERS, "x-request-id": rid}
        picked = s.request("/v1/completions", json.dumps(_body(MODEL)).encode(), headers=client_headers)
        assert picked.immediate is None and picked.endpoint == endpoint
        forwarded = json.loads(picked.body)
        assert not set(HOSTILE) & set(forwarded), forwarded
        assert "x-data-parallel-rank" in picked.removed_headers
        # the gateway applies the header mutation, then sends the picker's body to the picked engine
        kept = {k: v for k, v in client_headers.items() if k.lower() not in picked.removed_headers}
        out = s.relay_response(picked.endpoint, "/v1/completions", picked.body, headers=kept)
        s.close()
        assert json.loads(out)["choices"], out
        (rec,) = _records([url], rid)
        assert rec["fields"] == {} and rec["dp_header"] is None, rec
        assert metric(epp.http, "kvroute_client_fields_stripped_total", field="routed_dp_rank") == 1
    finally:
        epp.router.stop()


def test_endpoint_picker_refuses_absurd_depth_like_the_proxy(plain_engine: tuple[str, str]) -> None:
    """A body nested 300 levels: the picker answers the same 400 json_too_deep as the HTTP door (an
    ImmediateResponse), instead of routing it to an engine."""
    url, _ = plain_engine
    deep: Any = 1
    for _ in range(300):
        deep = {"x": deep}
    epp = start_epp([url], ready=1)
    try:
        _, stub = stub_for(epp.grpc_port)
        s = GatewayStream(stub)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "extra": deep}
        picked = s.request("/v1/completions", json.dumps(body).encode())
        s.close()
        assert picked.status == 400, picked
        assert json.loads(picked.immediate.body)["error"]["code"] == "json_too_deep"
    finally:
        epp.router.stop()
