"""The router's regional helpers (router/core/regions.py): residency from the tenant narrowed by a header, the hop
headers, the matrix from milliseconds, peer replicas; tenants' ``allowed_regions``; a ladder refusal as an error."""

from __future__ import annotations

import pytest

from policies.regions import RegionRefused
from router.config import Settings
from router.core.regions import (
    ALLOWED_REGIONS_HEADER,
    HOP_HEADER,
    allowed_regions,
    hop_headers,
    latency_matrix,
    parse_regions,
    peer_specs,
)
from router.core.routing import RegionUnavailable
from router.core.tenants import TenancyConfig


def test_region_allowed_header_only_narrows_the_tenants_list() -> None:
    assert allowed_regions(None, None) is None
    assert allowed_regions(["eu"], None) == {"eu"}
    assert allowed_regions(None, "eu, us") == {"eu", "us"}
    assert allowed_regions(["eu"], "eu,us") == {"eu"}  # a header cannot widen
    assert allowed_regions(["eu"], "us") == frozenset()  # nothing left: refused by the ladder
    assert parse_regions(" , ") == frozenset()


def test_region_hop_headers_carry_origin_residency_and_session() -> None:
    h = hop_headers("us", frozenset({"eu", "us"}), "X-Session-Id", "s1")
    assert h == {HOP_HEADER: "us", ALLOWED_REGIONS_HEADER: "eu,us", "x-session-id": "s1"}
    assert hop_headers("us", None, "x-session-id", None) == {HOP_HEADER: "us"}


def test_region_matrix_from_milliseconds_includes_home() -> None:
    m = latency_matrix({"us": {"eu": 80}}, 1.0, "us")
    assert m.rtt_s("eu", "us") == pytest.approx(0.08)
    assert m.rtt_s("us", "us") == pytest.approx(0.001)
    assert latency_matrix({}, 0.0, "ap").regions == {"ap"}
    with pytest.raises(ValueError):
        latency_matrix({"us": {"eu": -1}}, 0.0, "us")


def test_region_peer_specs_are_labelled_replicas() -> None:
    (spec,) = peer_specs({"eu": "http://eu.example:8080/"}, "/region/ready")
    assert spec == {
        "name": "region-eu",
        "url": "http://eu.example:8080",
        "region": "eu",
        "peer": True,
        "health_path": "/region/ready",
    }


def test_region_tenant_allowed_regions_parsed_and_checked() -> None:
    cfg = TenancyConfig.from_settings(Settings(tenants={"t": {"allowed_regions": ["eu"]}}))
    assert cfg.tenants["t"].allowed_regions == {"eu"}
    assert cfg.default_policy.allowed_regions is None
    with pytest.raises(ValueError, match="allowed_regions"):
        TenancyConfig.from_settings(Settings(tenants={"t": {"allowed_regions": "eu"}}))


def test_region_refusal_is_503_with_retry_after_and_the_reason() -> None:
    err = RegionUnavailable(RegionRefused("beyond_ladder", "too far", 7.0))
    assert err.status == 503 and err.retry
    assert err.answer_headers(1)["retry-after"] == "7"
    assert err.details == "region_beyond_ladder"
    bad = RegionUnavailable(RegionRefused("unknown_client_region", "who?", 5.0))
    assert bad.status == 400 and not bad.retry
