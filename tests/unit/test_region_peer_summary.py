"""A peer region's published summary and how a router prices the peer from it (policies/peer_summary.py,
router/core/regions.py ``PeerViews``): the wire form, the queue and prefix terms, the fallbacks, and the measured
round trip (EWMA over probes, the configured value as the prior)."""

from __future__ import annotations

import json
import math

import pytest

from index.summary import PrefixSummary, SummaryParams
from policies.base import Candidate, LoadView, ReplicaProfile, RouteRequest
from policies.peer_summary import (
    PeerSummary,
    RttEstimator,
    price_peer,
    publish_summary,
    summary_json,
    with_round_trip,
)
from policies.regions import LadderParams, LatencyMatrix, RegionLadderPolicy, RegionLoad
from router.core.regions import PeerViews

BS = 16
KEYS = [(i * 0x9E3779B97F4A7C15 + 7) & ((1 << 64) - 1) for i in range(1, 65)]  # a prompt's 64 block keys


def _summary(queue_s: float = 0.0, held: int = 0, block_size: int = BS) -> PeerSummary:
    prefix = PrefixSummary.from_keys(KEYS[:held] or [1], SummaryParams(10.0, 1))
    body = summary_json("eu", {"m": RegionLoad(2, queue_s, queue_s, 0.5)}, block_size, prefix)
    return PeerSummary.from_json(body)


def _peer() -> Candidate:
    return Candidate(index=9, name="region-eu", region="eu")


def test_region_summary_wire_round_trip_and_bad_bodies() -> None:
    s = _summary(queue_s=1.5, held=40)
    assert s.region == "eu" and s.block_size == BS
    assert s.loads["m"] == RegionLoad(2, 1.5, 1.5, 0.5)
    assert s.prefix is not None and s.prefix.matched_blocks(KEYS) == 40
    assert s.size_bytes == s.prefix.size_bytes > 0
    inf = PeerSummary.from_json(summary_json("eu", {"m": RegionLoad()}, BS, None))
    assert math.isinf(inf.loads["m"].queue_s_min) and inf.prefix is None  # unknown wait stays infinite
    for bad in ({}, {"region": "eu", "block_size": 16, "models": {"m": {}}}, {"models": 3}, None):
        with pytest.raises(ValueError):
            PeerSummary.from_json(bad)
    body = summary_json("eu", {}, BS, None)
    body["prefix"] = "not base64!"
    with pytest.raises(ValueError):
        PeerSummary.from_json(body)
    body = summary_json("eu", {"m": RegionLoad(1, -1.0, 0.0, 0.0)}, BS, None)
    with pytest.raises(ValueError):
        PeerSummary.from_json(body)


def test_region_peer_priced_from_queue_seconds_and_prefix_filter() -> None:
    cand = _peer()
    priced = price_peer(cand, _summary(queue_s=2.0, held=40), "m", KEYS, BS, 64 * BS)
    assert priced is not None
    rate = cand.profile.prefill_tokens_per_s
    assert priced.load.queued_prefill_tokens == round(2.0 * rate)  # 2 s at the profile's rate
    assert priced.hit.gpu == 40 * BS and priced.hit.predicted == 0
    # a different block size: no prefix credit (keys would not line up); an unknown model: no pricing
    other = price_peer(cand, _summary(held=40, block_size=32), "m", KEYS, BS, 64 * BS)
    assert other is not None and other.hit.gpu == 0
    assert price_peer(cand, _summary(), "other-model", KEYS, BS, 64 * BS) is None
    # a short prompt is never credited more than its length
    short = price_peer(cand, _summary(held=40), "m", KEYS[:3], BS, 40)
    assert short is not None and short.hit.gpu == 40


def test_region_ladder_hops_on_published_prefix_and_not_on_published_load() -> None:
    """The ladder with the summary's terms: a prefix region B holds makes B faster than home by the margin; B's
    published queue wait cancels it."""
    matrix = LatencyMatrix.from_pairs({"us": {"eu": 0.08}}, 0.001)
    home = Candidate(
        index=0, name="us-0", region="us", load=LoadView(queued_requests=0, queued_prefill_tokens=0)
    )
    req = RouteRequest(model="m", prompt_tokens=64 * BS, block_keys=KEYS, block_size=BS)
    ladder = RegionLadderPolicy.with_ttft(matrix, "us", LadderParams(margin_s=0.01))
    slow = ReplicaProfile(prefill_tokens_per_s=1000.0)
    home.profile = slow
    peer = _peer()
    peer.profile = slow
    cached = price_peer(peer, _summary(queue_s=0.0, held=64), "m", KEYS, BS, 64 * BS)
    loaded = price_peer(peer, _summary(queue_s=5.0, held=64), "m", KEYS, BS, 64 * BS)
    cold = price_peer(peer, _summary(queue_s=0.0, held=0), "m", KEYS, BS, 64 * BS)
    assert cached is not None and loaded is not None and cold is not None
    assert ladder.choose(req, [home, cached]).chosen == peer.index
    assert ladder.choose(req, [home, loaded]).chosen == home.index
    assert ladder.choose(req, [home, cold]).chosen == home.index
    assert ladder.counts["faster_region"] == 1 and ladder.counts["home"] == 2


def test_region_peer_views_fall_back_when_stale_missing_or_model_unknown() -> None:
    now = [100.0]
    views = PeerViews(stale_after_s=3.0, rtt_alpha=0.5, rtt_min_samples=2, clock=lambda: now[0])
    seen: list[tuple[str, str]] = []
    views.on_fallback.append(lambda peer, why: seen.append((peer, why)))
    cand = _peer()
    assert views.price(cand, "m", KEYS, BS, 64 * BS) is cand
    views.store("eu", _summary(queue_s=1.0, held=10))
    fresh = views.price(cand, "m", KEYS, BS, 64 * BS)
    assert fresh.hit.gpu == 10 * BS
    assert views.price(cand, "n", KEYS, BS, 64 * BS) is cand
    now[0] += 3.5
    assert views.age_s("eu") == pytest.approx(3.5)
    assert views.price(cand, "m", KEYS, BS, 64 * BS) is cand
    assert seen == [("eu", "missing"), ("eu", "model"), ("eu", "stale")]


def test_region_rtt_estimator_ewma_with_configured_prior() -> None:
    est = RttEstimator(alpha=0.5, min_samples=3)
    assert est.estimate(0.08) == 0.08  # no probe yet: the configured value
    est.observe(0.2)
    est.observe(0.1)
    assert est.estimate(0.08) == 0.08  # two probes: still the prior
    est.observe(0.1)
    assert est.estimate(0.08) == pytest.approx(0.1 + 0.25 * 0.1)  # 0.2 -> 0.15 -> 0.125
    for bad in (math.nan, -1.0, math.inf):
        est.observe(bad)
    assert est.samples == 3
    for _ in range(30):
        est.observe(0.04)
    assert est.estimate(0.08) == pytest.approx(0.04, abs=1e-6)
    with pytest.raises(ValueError):
        RttEstimator(alpha=0.0, min_samples=1)
    views = PeerViews(stale_after_s=3.0, rtt_alpha=1.0, rtt_min_samples=2, clock=lambda: 0.0)
    assert views.observe_rtt("eu", 0.05) is None and views.observe_rtt("eu", 0.07) == 0.07


def test_region_measured_round_trip_replaces_the_configured_pair() -> None:
    m = LatencyMatrix.from_pairs({"us": {"eu": 0.08, "ap": 0.2}}, 0.001)
    m2 = with_round_trip(m, "us", "eu", 0.05)
    assert m2.rtt_s("eu", "us") == m2.rtt_s("us", "eu") == 0.05
    assert m2.rtt_s("us", "ap") == 0.2 and m.rtt_s("us", "eu") == 0.08


def test_region_published_summary_answers_304_lean_or_full() -> None:
    """One build answers a reader holding it with 304 and no body, one holding its filter with the body without
    the filter (read back with the filter it holds), anyone else with the full body; an unchanged filter the
    reader does not hold is a ValueError (the feed then fetches in full)."""
    prefix = PrefixSummary.from_keys(KEYS, SummaryParams(10.0, 1))
    pub = publish_summary("eu", {"m": RegionLoad(2, 0.5, 0.7, 0.5)}, BS, prefix)
    assert pub.answer(f'"{pub.etag}"', None) == (304, b"")
    assert pub.answer(f'W/"x", "{pub.etag}"', None) == (304, b"")
    status, body = pub.answer('"other"', pub.prefix_etag)
    assert (
        status == 200 and body == pub.lean and b'prefix":null' in pub.lean and len(pub.lean) < len(pub.full)
    )
    assert pub.answer(None, "other") == (200, pub.full)
    held = PeerSummary.from_json(json.loads(pub.full))
    assert held.prefix_etag == pub.prefix_etag and held.prefix is not None
    lean = PeerSummary.from_json(json.loads(pub.lean), held)
    assert lean.prefix is held.prefix and lean.loads["m"].queue_s_min == 0.5
    with pytest.raises(ValueError):
        PeerSummary.from_json(json.loads(pub.lean))
    same = publish_summary("eu", {"m": RegionLoad(2, 0.5, 0.7, 0.5)}, BS, PrefixSummary.from_keys(KEYS[::-1]))
    assert same.etag == pub.etag  # the same content, the same tag (304 across rebuilds)
    busier = publish_summary("eu", {"m": RegionLoad(2, 0.9, 0.9, 0.5)}, BS, prefix)
    assert busier.etag != pub.etag and busier.prefix_etag == pub.prefix_etag
