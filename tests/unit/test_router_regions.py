"""The router's regional helpers (router/core/regions.py): residency from the tenant narrowed by a header, the hop
headers, the matrix from milliseconds, peer replicas; tenants' ``allowed_regions``; a ladder refusal as an error;
the round trip taken out of a TTFT observed through a peer; a peer without a round trip refused at start."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from index.prefix_index import PrefixIndex
from membership.replicas import PEER_LABEL, REGION_LABEL, ReplicaState, ReplicaTable
from policies.base import Candidate, Decision, Observation, RouteRequest
from policies.peer_summary import PeerSummary
from policies.regions import RegionLadderPolicy, RegionLoad, RegionRefused
from policies.ttft import TTFTPolicy
from router.config import Settings
from router.core.regions import (
    ALLOWED_REGIONS_HEADER,
    HOP_HEADER,
    PEER_KEY_HEADER,
    PeerKeys,
    PeerViews,
    allowed_regions,
    client_region_trusted,
    hop_headers,
    latency_matrix,
    parse_regions,
    peer_specs,
)
from router.core.routing import RegionUnavailable, Router, RoutingInput
from router.core.tenants import TenancyConfig
from router.services import build_services


def test_region_allowed_header_only_narrows_the_tenants_list() -> None:
    assert allowed_regions(None, None) is None
    assert allowed_regions(["eu"], None) == frozenset({"eu"})
    assert allowed_regions(None, "eu, us") == frozenset({"eu", "us"})
    assert allowed_regions(["eu"], "eu,us") == frozenset({"eu"})  # a header cannot widen
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
    cfg = TenancyConfig.from_settings(
        Settings(tenants={"t": {"allowed_regions": ["eu"]}}).tenancy,
        client_keys_required=False,
        inflight_limit=1,
    )
    assert cfg.tenants["t"].allowed_regions == frozenset({"eu"})
    assert cfg.default_policy.allowed_regions is None
    with pytest.raises(ValueError, match="allowed_regions"):
        TenancyConfig.from_settings(
            Settings(tenants={"t": {"allowed_regions": "eu"}}).tenancy,
            client_keys_required=False,
            inflight_limit=1,
        )


def test_region_refusal_is_503_with_retry_after_and_the_reason() -> None:
    err = RegionUnavailable(RegionRefused("beyond_ladder", "too far", 7.0))
    assert err.status == 503 and err.retry
    assert err.answer_headers(1)["retry-after"] == "7"
    assert err.details == "region_beyond_ladder"
    bad = RegionUnavailable(RegionRefused("unknown_client_region", "who?", 5.0))
    assert bad.status == 400 and not bad.retry


class _Recorder:
    """A policy that records what it observes (the observation path only)."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[Observation] = []

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        return Decision(
            chosen=candidates[0].index, ranking=[c.index for c in candidates], scores=[], policy=self.name
        )

    def observe(self, observation: Observation) -> None:
        self.seen.append(observation)


def test_region_peer_round_trip_is_taken_out_of_observed_ttft() -> None:
    table = ReplicaTable()
    local = table.upsert("e0", "http://127.0.0.1:9000")
    peer = table.upsert("region-eu", "http://127.0.0.1:9001", labels={REGION_LABEL: "eu", PEER_LABEL: "true"})
    rec = _Recorder()
    router = Router(table, PrefixIndex(block_size=16), rec)
    router.peer_rtt_s = {"eu": 0.08}
    router.observe(
        Observation(index=peer.index, prompt_tokens=10, cached_tokens=0, queue_wait_s=0.0, ttft_s=0.5)
    )
    router.observe(
        Observation(index=local.index, prompt_tokens=10, cached_tokens=0, queue_wait_s=0.0, ttft_s=0.5)
    )
    router.observe(
        Observation(index=peer.index, prompt_tokens=10, cached_tokens=0, queue_wait_s=0.0, ttft_s=0.05)
    )
    assert [o.ttft_s for o in rec.seen] == [pytest.approx(0.42), 0.5, 0.0]


def test_region_peer_without_round_trip_is_a_configuration_error() -> None:
    settings = Settings(
        tokenizer_mode="bytes",
        region="us",
        region_rtt_ms={"us": {"eu": 80}},
        region_peers={"ap": "http://ap:8080"},
    )
    with pytest.raises(ValueError, match="region_peers: 'ap'"):
        build_services(settings)


def test_region_client_header_trusted_from_edge_keys_only() -> None:
    edge = frozenset({"edge-key"})
    assert client_region_trusted(None, edge, keys_required=False)  # no keys at all: as the tenant header
    assert client_region_trusted("Bearer edge-key", edge, keys_required=True)
    assert not client_region_trusted("Bearer client-key", edge, keys_required=True)
    assert not client_region_trusted(None, edge, keys_required=True)


def test_region_peer_queue_reads_back_at_the_calibrated_rate() -> None:
    """Once the policy calibrated the peer's prefill rate from requests served through it (4x the profile's
    here), the published queue wait still reads back as the published seconds: it is handed over as tokens at
    the rate the policy divides by, not at the profile's (which read 1 s back as 0.25 s)."""
    table = ReplicaTable()
    local = table.upsert("e0", "http://127.0.0.1:9000")
    peer = table.upsert("region-eu", "http://127.0.0.1:9001", labels={REGION_LABEL: "eu", PEER_LABEL: "true"})
    for rep in (local, peer):
        rep.models = ["m"]
        table.set_state(rep.name, ReplicaState.READY)
    matrix = latency_matrix({"us": {"eu": 80}}, 1.0, "us")
    policy = RegionLadderPolicy.with_ttft(matrix, "us", calibration_min_samples=4)
    router = Router(table, PrefixIndex(block_size=16), policy)
    router.home_region = "us"
    fast = 4 * peer.profile.prefill_tokens_per_s
    for n in (1000, 4000, 2000, 8000, 3000, 6000):
        router.observe(
            Observation(index=peer.index, prompt_tokens=n, cached_tokens=0, queue_wait_s=0.0, ttft_s=n / fast)
        )
    assert isinstance(policy.inner, TTFTPolicy)  # with_ttft: the ladder around a ttft policy
    calibrated = policy.inner.calibrated(peer.index)
    assert calibrated is not None and calibrated[0] == pytest.approx(fast, rel=0.05)
    views = PeerViews(15.0, 0.3, 3, lambda: 0.0)
    views.store("eu", PeerSummary("eu", {"m": RegionLoad(2, 1.0, 1.0, 0.5)}, 16))
    router.peer_views = views
    inp = RoutingInput(model="m", lora=None, token_ids=list(range(64)), keys=[], seed=0)
    scores = {s.index: s for s in router.decide(inp).decision.scores}
    assert scores[peer.index].parts["Q"] == pytest.approx(1.0, rel=0.01)


def test_region_peer_keys_are_distinct_from_client_keys_and_checked() -> None:
    keys = PeerKeys(["peer-a", "peer-b"], ["client"], "admin")
    assert keys.configured and keys.status("peer-b") == 0
    assert keys.status("client") == 401 and keys.status(None) == 401
    assert PeerKeys([], ["client"], None).status("anything") == -1  # no peer keys: the client keys apply
    for clash in (["client"], ["admin"]):
        with pytest.raises(ValueError, match="peer_api_keys"):
            PeerKeys(clash, ["client"], "admin")
    assert hop_headers("us", None, "x-session-id", None, "peer-a")[PEER_KEY_HEADER] == "peer-a"
