"""The endpoint picker on a prefill/decode fleet: ``kvroute epp`` follows the PD plan behind an ordinary gateway.

Real processes on loopback: PD stand-in engines (``kvroute fake-engine --pd-role ...``, which fail or recompute, and
count it, when the router gets a protocol wrong), ``kvroute epp`` in front of them, and the gateway stand-in
(``loadtest/epp_gateway.py``: Envoy's part of ext_proc, then the HTTP hop to the picked endpoint with the body and
headers the picker handed back). Plans are forced to disaggregate (``pd_ttft`` with ``decode_prefills=false``).

For a disaggregated plan the picker runs the prefill leg itself on the planned prefill replica (the protocol
runners the HTTP door uses) and answers with the decode replica as the destination and the decode request's body:
with SGLang the bootstrap host / port / room (the decode server refuses a request without one), with vLLM's NIXL
relay the prefill's ``kv_transfer_params`` (the decode engine pulls the KV instead of recomputing). ``POST /route``
on the same process predicts the same pair.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from fakes.fleet import EngineOptions, Fleet, pd_roles, scaled_profile_args
from loadtest.epp_gateway import GatewayStream, stub_for
from tests.helpers import Proc, free_port, metric, wait_until

PROMPT = [1000 + (i * 7) % 5000 for i in range(600)]  # token ids: no tokenizer involved
MODEL = "kvroute-fake"


@dataclass
class PdPicker:
    fleet: Fleet
    http: str
    grpc_port: int
    proc: Proc

    def engine(self, name: str) -> str:
        return next(e.url for e in self.fleet.engines if e.name == name)

    def stream(self) -> GatewayStream:
        _, stub = stub_for(self.grpc_port)
        return GatewayStream(stub, timeout=30.0)


def _start(dialect: str) -> Iterator[PdPicker]:
    time_scale = 0.05
    opts = EngineOptions(
        dialect=dialect,
        kv_events_format="sglang" if dialect == "sglang" else "vllm",
        time_scale=time_scale,
    )
    fleet = Fleet(2, opts, roles=pd_roles(1, 1))
    proc: Proc | None = None
    try:
        fleet.start_engines()
        port, gport = free_port(), free_port()
        args = ["epp", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(gport)]
        args += ["--tokenizer-mode", "bytes", "--block-size", str(opts.block_size), "--log-level", "warning"]
        args += [
            "--pd-policy",
            "pd_ttft",
            "--pd-policy-params",
            "decode_prefills=false",
            "--max-retries",
            "1",
        ]
        args += scaled_profile_args(opts.profile, time_scale)
        for eh in fleet.engines:
            args += ["--replica", fleet.replica_spec(eh)]
        proc = Proc.kvroute(*args)
        http = f"http://127.0.0.1:{port}"

        def all_ready() -> bool:
            try:
                reps = httpx.get(http + "/replicas", timeout=2).json()["replicas"]
            except httpx.HTTPError:
                return False
            return len(reps) == 2 and all(
                r["state"] == "ready" and r["load"]["age_s"] is not None for r in reps
            )

        wait_until(all_ready, timeout=40, what="kvroute epp with both PD replicas ready")
        yield PdPicker(fleet, http, gport, proc)
    finally:
        if proc is not None:
            proc.stop()
        fleet.stop()


@pytest.fixture(scope="module")
def sglang_pd() -> Iterator[PdPicker]:
    yield from _start("sglang")


@pytest.fixture(scope="module")
def vllm_pd() -> Iterator[PdPicker]:
    yield from _start("vllm")


def _quiet(picker: PdPicker) -> None:
    def idle() -> bool:
        reps = httpx.get(picker.http + "/replicas", timeout=5).json()["replicas"]
        return all(
            r["load"]["inflight_requests"] == 0
            and not r["load"]["queued_requests"]
            and not r["load"]["running_requests"]
            for r in reps
        )

    wait_until(idle, timeout=15, what="every replica idle")


def _plan(picker: PdPicker, body: dict[str, Any]) -> dict[str, Any]:
    _quiet(picker)
    r = httpx.post(picker.http + "/route", json={"model": MODEL, "prompt": body["prompt"]}, timeout=10)
    assert r.status_code == 200, r.text
    chosen = r.json()["plan"]["chosen"]
    assert chosen["kind"] == "disaggregated", chosen
    return dict(chosen)


def _through_gateway(
    picker: PdPicker, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[Any, bytes]:
    """One request through the gateway stand-in: the picker's answer, and what the client receives from the
    endpoint it picked (sent with the body and the request headers the picker handed back)."""
    s = picker.stream()
    try:
        picked = s.request("/v1/completions", json.dumps(body).encode(), headers=headers)
        assert picked.status is None, picked.immediate  # routed, not refused
        headers = {k: v for k, v in picked.set_headers.items() if k.lower() not in ("content-length",)}
        assert picked.endpoint is not None
        out = s.relay_response(picked.endpoint, "/v1/completions", picked.body, headers)
    finally:
        s.close()
    return picked, out


def _counts(picker: PdPicker, plan: dict[str, Any]) -> tuple[float, float]:
    p_url, d_url = picker.engine(plan["prefill"]["name"]), picker.engine(plan["decode"]["name"])
    return metric(p_url, "fake_pd_requests_total", leg="prefill"), metric(d_url, "fake_pd_handoffs_total")


def _wire_clean(picker: PdPicker) -> None:
    for e in picker.fleet.engines:
        assert metric(e.url, "fake_pd_missing_params_total") == 0, e.name  # SGLang decode: no room -> 400
        assert metric(e.url, "fake_pd_recomputed_total") == 0, e.name  # vLLM decode without the KV
        assert metric(e.url, "fake_pd_bad_prefill_total") == 0, e.name


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_pd_fleet_behind_the_picker_serves_the_plan(sglang_pd: PdPicker, stream: bool) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": stream}
    plan = _plan(sglang_pd, body)
    prefills, handoffs = _counts(sglang_pd, plan)
    picked, out = _through_gateway(sglang_pd, body)
    d_url = sglang_pd.engine(plan["decode"]["name"])
    assert picked.endpoint == d_url.removeprefix("http://")  # /route and the picker agree on the pair
    sent = json.loads(picked.body)
    assert {"bootstrap_host", "bootstrap_port", "bootstrap_room"} <= set(sent)  # what the decode server needs
    if stream:
        assert out.rstrip().endswith(b"data: [DONE]") and b"event: error" not in out
        assert b'"choices":[]' not in out.replace(b" ", b"")  # the usage the picker asked for is removed
        # and SGLang's null usage in each token event, as the HTTP door's relay removes it
        assert b'"usage"' not in out and out.count(b'"matched_stop":null') >= 3, out
    else:
        assert json.loads(out)["choices"], out
    assert _counts(sglang_pd, plan) == (
        prefills + 1,
        handoffs + 1,
    )  # the prefill leg ran on P; D joined its room
    _wire_clean(sglang_pd)
    assert metric(sglang_pd.http, "kvroute_pd_plans_total", kind="disaggregated") >= 1
    assert metric(sglang_pd.http, "kvroute_pd_fallbacks_total") == 0
    _quiet(sglang_pd)  # both legs' holds released


def test_vllm_nixl_pd_fleet_behind_the_picker_relays_the_transfer_params(vllm_pd: PdPicker) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    plan = _plan(vllm_pd, body)
    prefills, handoffs = _counts(vllm_pd, plan)
    picked, out = _through_gateway(vllm_pd, body)
    assert picked.endpoint == vllm_pd.engine(plan["decode"]["name"]).removeprefix("http://")
    params = json.loads(picked.body)["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"]  # the prefill's, relayed
    assert json.loads(out)["choices"], out
    assert _counts(vllm_pd, plan) == (prefills + 1, handoffs + 1)  # D pulled P's KV instead of recomputing
    _wire_clean(vllm_pd)
    _quiet(vllm_pd)


def test_a_clients_prefiller_header_never_reaches_the_decode_pod(vllm_pd: PdPicker) -> None:
    """A client cannot steer llm-d's decode-side sidecar to a prefill host of its choosing: the picker removes a
    client's ``x-prefiller-host-port`` on a disaggregated plan (whose prefill leg it ran itself) and in place."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    _plan(vllm_pd, body)
    steer = {"x-prefiller-host-port": "10.9.9.9:8000", "x-prefiller-url": "http://10.9.9.9:8000"}
    picked, out = _through_gateway(vllm_pd, body, headers=steer)
    assert json.loads(picked.body)["kv_transfer_params"]["do_remote_prefill"] is True  # disaggregated
    for name in steer:  # llm-d's sidecar reads either (the URL when the host-port header is absent)
        assert name not in picked.set_headers and name in picked.removed_headers
    assert json.loads(out)["choices"], out
    _quiet(vllm_pd)
    s = vllm_pd.stream()
    try:  # headers only: nothing to hand over, so the plan is served in place
        picked = s.request("/v1/completions", None, headers=steer)
    finally:
        s.close()
    assert picked.status is None, picked.immediate
    for name in steer:  # llm-d's sidecar reads either (the URL when the host-port header is absent)
        assert name not in picked.set_headers and name in picked.removed_headers
    _quiet(vllm_pd)


def test_the_decode_leg_waits_on_its_replica_until_the_gateway_answers(sglang_pd: PdPicker) -> None:
    """Behind a gateway too, ``pd_ttft`` sees the decode legs waiting on each decode replica (as behind the HTTP
    door): from the picker's handoff (it ran the prefill leg; the gateway sends the decode leg) to the decode
    response's first byte through the picker, or the end of the gateway's stream when no response comes."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    d_name = _plan(sglang_pd, body)["decode"]["name"]

    def waiting() -> dict[str, tuple[int, int]]:
        reps = httpx.get(sglang_pd.http + "/replicas", timeout=5).json()["replicas"]
        return {r["name"]: (r["pd"]["decode_legs"], r["pd"]["decode_leg_tokens"]) for r in reps}

    s = sglang_pd.stream()
    try:
        picked = s.request("/v1/completions", json.dumps(body).encode())
        assert picked.status is None and picked.endpoint is not None, picked.immediate
        assert waiting()[d_name] == (1, len(PROMPT))  # handed to the gateway, not answered yet
        headers = {k: v for k, v in picked.set_headers.items() if k.lower() != "content-length"}
        out = s.relay_response(picked.endpoint, "/v1/completions", picked.body, headers)
        assert out.rstrip().endswith(b"data: [DONE]")
        assert waiting()[d_name] == (0, 0)  # the first byte came back through the picker
    finally:
        s.close()
    _quiet(sglang_pd)
    s = sglang_pd.stream()  # a gateway that gives up before sending the decode leg
    try:
        picked = s.request("/v1/completions", json.dumps(body).encode())
        assert picked.status is None, picked.immediate
        assert waiting()[d_name] == (1, len(PROMPT))
    finally:
        s.cancel()
    wait_until(lambda: waiting()[d_name] == (0, 0), timeout=10, what="the abandoned decode leg dropped")
    _quiet(sglang_pd)
