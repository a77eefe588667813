"""LoRA adapters on a prefill/decode fleet: ``kvroute serve`` in front of PD stand-in engines (``kvroute fake-engine
--pd-role ...``) serving an adapter as vLLM does (``--enable-lora --max-loras 1``), plans forced to disaggregate.

Both legs carry the request's adapter, as an in-place attempt does: each engine is sent the adapter's name (its KV
events key the prompt's blocks under the adapter on both, so the router matches the adapter's prompt there and not
the base model's), and the router's adapter model counts each leg (a dispatch of the adapter, resident on both
replicas afterwards), so the next request's adapter term prices what the legs loaded. The same through the endpoint
picker (``kvroute epp`` behind the gateway stand-in ``loadtest/epp_gateway.py``), which runs the prefill leg itself
and hands the gateway the decode leg's body.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fakes.fleet import EngineOptions, Fleet, pd_roles
from loadtest.epp_gateway import GatewayStream, stub_for
from tests.helpers import Proc, free_port, metric, wait_until

PROMPT = [1000 + (i * 7) % 5000 for i in range(300)]  # token ids: no tokenizer involved
ADAPTER = "ad"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    d: Path = tmp_path_factory.mktemp("adapters") / ADAPTER
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj", "v_proj"]}')
    (d / "adapter_model.safetensors").write_bytes(b"\0" * 100_000)
    lora = ["--enable-lora", "--max-loras", "1", "--lora-modules", f"{ADAPTER}={d}"]
    fleet = Fleet(2, EngineOptions(time_scale=0.01, extra_args=lora), roles=pd_roles(1, 1))
    try:
        fleet.start_engines()
        fleet.start_kvroute(
            "ttft", extra_args=["--pd-policy", "pd_ttft", "--pd-policy-params", "decode_prefills=false"]
        )
        url = _url(fleet)
        wait_until(
            lambda: all(ADAPTER in (r.get("loras") or []) for r in _replicas(url)),
            timeout=20,
            what="both replicas' adapters learned",
        )
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def picker(fleet: Fleet) -> Iterator[tuple[str, int]]:
    """``kvroute epp`` in front of the same engines, plans forced to disaggregate: (its HTTP URL, gRPC port)."""
    port, gport = free_port(), free_port()
    args = [
        "epp",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--grpc-port",
        str(gport),
        "--log-level",
        "warning",
    ]
    args += [
        "--tokenizer-mode",
        "bytes",
        "--pd-policy",
        "pd_ttft",
        "--pd-policy-params",
        "decode_prefills=false",
    ]
    for eh in fleet.engines:
        args += ["--replica", fleet.replica_spec(eh)]
    proc = Proc.kvroute(*args)
    http = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: (
                all(r["state"] == "ready" and ADAPTER in (r.get("loras") or []) for r in _replicas(http))
                and len(_replicas(http)) == 2
            ),
            timeout=40,
            what="kvroute epp with both replicas' adapters learned",
        )
        yield http, gport
    finally:
        proc.stop()


def _url(fleet: Fleet) -> str:
    assert fleet.router is not None
    return fleet.router.url


def _replicas(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(url + "/replicas", timeout=5).json()["replicas"])


def _matched(url: str, body: dict[str, Any]) -> dict[str, int]:
    """Replica -> prompt tokens of ``body`` the router holds from the engines' KV events (``/route``)."""
    r = httpx.post(url + "/route", json=body, timeout=10)
    assert r.status_code == 200, r.text
    return {c["name"]: int(c["matched_tokens"]["gpu"]) for c in r.json()["candidates"]}


def test_both_pd_legs_carry_the_requests_adapter(fleet: Fleet) -> None:
    url = _url(fleet)
    body = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": 4}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvroute-plan"] == "disaggregated"
    prefill, decode = r.headers["x-kvroute-prefill-replica"], r.headers["x-kvroute-replica"]
    assert r.json()["model"] == ADAPTER
    # the engines were sent the adapter: both keyed the prompt's blocks under it (their KV events)
    full = len(PROMPT) // 16 * 16
    wait_until(
        lambda: all(_matched(url, body)[n] >= full - 16 for n in (prefill, decode)),
        timeout=15,
        what="both legs' blocks indexed under the adapter",
    )
    assert _matched(url, {**body, "model": "kvroute-fake"}) == {prefill: 0, decode: 0}
    # the router's adapter model saw both legs: two dispatches of the adapter, resident on both replicas
    assert sum(metric(url, "kvroute_lora_dispatches_total", tier=t) for t in ("gpu", "cpu", "storage")) == 2
    for name in (prefill, decode):
        assert metric(url, "kvroute_replica_lora_adapters_resident", replica=name) == 1


def test_both_pd_legs_carry_the_requests_adapter_behind_the_picker(
    fleet: Fleet, picker: tuple[str, int]
) -> None:
    http, gport = picker
    body = {"model": ADAPTER, "prompt": [p + 1 for p in PROMPT], "max_tokens": 4}
    s = GatewayStream(stub_for(gport)[1], timeout=30.0)
    try:
        picked = s.request("/v1/completions", json.dumps(body).encode())
        assert picked.status is None and picked.endpoint is not None, picked.immediate  # routed
        sent = json.loads(picked.body)
        assert sent["model"] == ADAPTER and sent["kv_transfer_params"]["do_remote_prefill"] is True
        headers = {k: v for k, v in picked.set_headers.items() if k.lower() != "content-length"}
        out = s.relay_response(picked.endpoint, "/v1/completions", picked.body, headers)
    finally:
        s.close()
    assert json.loads(out)["model"] == ADAPTER
    names = {e.url.removeprefix("http://"): e.name for e in fleet.engines}
    decode = names[picked.endpoint]
    prefill = next(n for n in names.values() if n != decode)
    full = len(PROMPT) // 16 * 16
    wait_until(
        lambda: all(_matched(http, body)[n] >= full - 16 for n in (prefill, decode)),
        timeout=15,
        what="both legs' blocks indexed under the adapter",
    )
    assert sum(metric(http, "kvroute_lora_dispatches_total", tier=t) for t in ("gpu", "cpu", "storage")) == 2
    for name in (prefill, decode):
        assert metric(http, "kvroute_replica_lora_adapters_resident", replica=name) == 1
