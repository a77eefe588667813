"""Regions through the endpoint picker (``kvroute epp``): when the ladder picks another region's router, the
gateway is told to send the request there with the hop header, the allowed regions and the session id (the
headers the HTTP door's proxy adds); a request that already hopped is never sent to a peer again. The peer region's
router is stood in for by a ``kvroute fake-engine`` (what the gateway then sends is not part of this test)."""

from __future__ import annotations

import json

from tests.helpers import start_fake_engine
from tests.integration.test_epp_protocol import MODEL, start_epp


def _body(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()


def test_region_picker_names_the_peer_with_hop_headers() -> None:
    peer, port, _, _ = start_fake_engine("--model", MODEL, "--dialect", "vllm", "--time-scale", "0.02")
    f = None
    try:
        f = start_epp(
            [],
            "--region",
            "us",
            "--region-rtt-ms",
            json.dumps({"us": {"eu": 80}}),
            "--region-peers",
            f"eu=http://127.0.0.1:{port}",
            "--region-peer-health-path",
            "/health",
            "--tenants",
            json.dumps({"eu-only": {"allowed_regions": ["eu"]}}),
            ready=1,
            tls=False,
        )
        s = f.stream()
        headers = {"x-kvroute-tenant": "eu-only", "x-session-id": "conv-7"}
        picked = s.request("/v1/completions", _body("served in eu"), headers=headers)
        assert picked.immediate is None and picked.endpoint == f"127.0.0.1:{port}"
        assert picked.set_headers["x-kvroute-hop"] == "us"
        assert picked.set_headers["x-kvroute-allowed-regions"] == "eu"
        assert picked.set_headers["x-session-id"] == "conv-7"
        s.cancel()
        hopped = f.stream().request("/v1/completions", _body("came from eu"), headers={"x-kvroute-hop": "eu"})
        assert hopped.status == 503  # no engine of its own, and a hop is never handed on
    finally:
        if f is not None:
            f.router.stop()
        peer.stop()
