"""Regions in the pure policies: the round-trip term of ``ttft``, the failover ladder, residency, the baselines.

Adversarial cases: every allowed region down, an empty allowed set, allowed regions the matrix does not know,
replicas of unknown regions, absurd round trips, a client region nobody configured.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Candidate, LoadView, PrefixHit, ReplicaProfile, RouteRequest
from policies.regions import (
    LadderParams,
    LatencyMatrix,
    RegionLadderPolicy,
    RegionLocalPolicy,
    RegionNearestPolicy,
    RegionRefused,
    ladder_ranking,
    plan_ladder,
    queue_seconds,
    region_load,
)
from policies.ttft import TTFTPolicy

PROF = ReplicaProfile(prefill_tokens_per_s=10_000.0, fixed_overhead_s=0.01)

#: us-east, eu-west, ap-southeast: round trips in seconds (intra-region 5 ms)
MATRIX = LatencyMatrix.from_pairs(
    {
        "us-east": {"eu-west": 0.075, "ap-southeast": 0.22},
        "eu-west": {"ap-southeast": 0.16},
    },
    intra_s=0.005,
)


def cand(i: int, region: str, queued: int = 0, gpu: int = 0, rtt: float = 0.0) -> Candidate:
    """A replica in ``region`` with ``queued`` prefill tokens waiting (10k tokens/s: 1 s per 10k)."""
    return Candidate(
        index=i,
        name=f"{region}-{i}",
        load=LoadView(queued_requests=0, running_requests=0, queued_prefill_tokens=queued, kv_usage=0.1),
        hit=PrefixHit(gpu=gpu),
        profile=PROF,
        region=region,
        rtt_s=rtt,
    )


def req(client: str | None = "us-east", allowed: frozenset[str] | None = None, n: int = 2000) -> RouteRequest:
    return RouteRequest(
        model="m",
        prompt_tokens=n,
        block_keys=list(range(n // 16)),
        client_region=client,
        allowed_regions=allowed,
    )


def ladder(**params: Any) -> RegionLadderPolicy:
    return RegionLadderPolicy.with_ttft(MATRIX, "us-east", LadderParams(**params), migration_weight=0.0)


# ------------------------------------------------------------------ the round trip in ttft


def test_region_round_trip_is_part_of_the_predicted_ttft() -> None:
    """``rtt_s`` adds to E, the tail and the score (the TTFT the client sees), not to T or the work term."""
    near = cand(0, "us-east", queued=5_000)
    far = cand(1, "eu-west", queued=4_000, rtt=0.075)
    d = TTFTPolicy(migration_weight=0.0).choose(req(), [near, far])
    s_near, s_far = d.scores
    assert s_far.parts["RTT"] == 0.075 and s_near.parts["RTT"] == 0.0
    assert s_far.parts["E"] == pytest.approx(s_far.parts["T"] + 0.075)
    assert s_far.parts["tail"] == pytest.approx(s_far.parts["T"] + 0.075)
    without = TTFTPolicy(migration_weight=0.0).choose(req(), [near, cand(1, "eu-west", queued=4_000)])
    assert s_far.score == pytest.approx(without.scores[1].score + 0.075)
    assert s_far.parts["W"] == without.scores[1].parts["W"]
    assert d.chosen == 1  # 0.1 s less queue pays for a 0.075 s round trip
    d2 = TTFTPolicy(migration_weight=0.0).choose(req(), [near, cand(1, "eu-west", queued=4_500, rtt=0.075)])
    assert d2.chosen == 0  # 0.05 s less queue does not pay a 0.075 s round trip


@pytest.mark.parametrize("bad", [-0.001, math.nan, math.inf])
def test_region_round_trip_that_is_not_a_time_excludes_the_candidate(bad: float) -> None:
    policy = TTFTPolicy()
    d = policy.choose(req(), [cand(0, "us-east", queued=50_000), cand(1, "eu-west", rtt=bad)])
    assert d.chosen == 0 and d.ranking == [0]
    assert d.scores[1].parts["excluded"] == 1 and policy.excluded_candidates == 1
    assert "round trip" in policy.last_exclusion


def test_region_round_trip_keeps_the_pruned_decision_exact() -> None:
    """64 replicas in three regions, the idle ones far away: pruning bounds the round trip and decides as full
    scoring does (the property tests in test_policies_ttft_pruning.py draw round trips too)."""
    regions = [("us-east", 0.005), ("eu-west", 0.075), ("ap-southeast", 0.22)]
    cands = [
        cand(i, regions[i % 3][0], queued=(0 if i % 3 else 3_000) + 37 * i, rtt=regions[i % 3][1])
        for i in range(64)
    ]
    pruned = TTFTPolicy(prune=True, prune_min_candidates=0).choose(req(), cands)
    full = TTFTPolicy(prune=False).choose(req(), cands)
    assert pruned.chosen == full.chosen and pruned.ranking[:3] == full.ranking[:3]
    assert len(pruned.scores) < len(full.scores)


# ------------------------------------------------------------------ the latency matrix


def test_region_matrix_is_symmetric_with_an_intra_region_default() -> None:
    assert MATRIX.rtt_s("ap-southeast", "us-east") == MATRIX.rtt_s("us-east", "ap-southeast") == 0.22
    assert MATRIX.rtt_s("eu-west", "eu-west") == 0.005
    assert MATRIX.rtt_s("us-east", "mars") is None
    assert MATRIX.missing_pairs() == []
    partial = LatencyMatrix.from_pairs({"a": {"b": 0.01}, "c": {}})
    assert partial.missing_pairs() == [("a", "c"), ("b", "c")]


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, "x"])
def test_region_matrix_rejects_values_that_are_not_times(bad: Any) -> None:
    with pytest.raises(ValueError):
        LatencyMatrix.from_pairs({"a": {"b": bad}})


def test_region_matrix_rejects_a_pair_given_twice_differently() -> None:
    with pytest.raises(ValueError, match="twice"):
        LatencyMatrix.from_pairs({"a": {"b": 0.01}, "b": {"a": 0.02}})
    assert LatencyMatrix.from_pairs({"a": {"b": 0.01}, "b": {"a": 0.01}}).rtt_s("a", "b") == 0.01


@pytest.mark.parametrize(
    "params",
    [{"margin_s": -1.0}, {"max_regions": 0}, {"max_extra_rtt_s": math.nan}, {"attempts_per_region": 0}],
)
def test_region_ladder_params_out_of_range_are_refused(params: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LadderParams(**params)


# ------------------------------------------------------------------ the ladder's plan


def test_region_plan_is_nearest_first_and_bounded() -> None:
    up = {"us-east", "eu-west", "ap-southeast"}
    plan = plan_ladder("us-east", None, up, MATRIX, LadderParams(max_regions=2, max_extra_rtt_s=0.3))
    assert [r.region for r in plan.rungs] == ["us-east", "eu-west"]
    assert plan.home == "us-east" and plan.home_up
    assert plan.skipped == (("ap-southeast", "max_regions"),)
    plan = plan_ladder("us-east", None, up, MATRIX, LadderParams(max_regions=3, max_extra_rtt_s=0.1))
    assert [r.region for r in plan.rungs] == ["us-east", "eu-west"]
    assert plan.skipped == (("ap-southeast", "too_far"),)
    assert plan.rungs[1].extra_s == pytest.approx(0.07)


def test_region_plan_skips_a_down_home_without_counting_it() -> None:
    plan = plan_ladder("ap-southeast", None, {"us-east", "eu-west"}, MATRIX, LadderParams(max_regions=2))
    assert [r.region for r in plan.rungs] == ["eu-west", "us-east"]
    assert plan.home == "ap-southeast" and not plan.home_up
    assert plan.skipped == (("ap-southeast", "down"),)


def test_region_plan_home_is_the_nearest_allowed_region() -> None:
    """An EU-only request from a US client: home is eu-west (extra round trips are counted from there)."""
    plan = plan_ladder("us-east", frozenset({"eu-west"}), {"us-east", "eu-west"}, MATRIX, LadderParams())
    assert plan.home == "eu-west" and [r.region for r in plan.rungs] == ["eu-west"]
    assert plan.rungs[0].extra_s == 0.0 and plan.skipped == (("us-east", "residency"),)


def test_region_refused_when_every_allowed_region_is_down() -> None:
    with pytest.raises(RegionRefused) as err:
        plan_ladder("us-east", frozenset({"eu-west"}), {"us-east", "ap-southeast"}, MATRIX, LadderParams())
    assert err.value.reason == "no_allowed_region_up" and err.value.retry_after_s == 5.0
    assert err.value.plan is not None and ("eu-west", "down") in err.value.plan.skipped


def test_region_refused_when_the_allowed_set_is_empty() -> None:
    with pytest.raises(RegionRefused) as err:
        plan_ladder("us-east", frozenset(), {"us-east"}, MATRIX, LadderParams())
    assert err.value.reason == "residency_empty"


def test_region_refused_when_only_unknown_regions_are_allowed() -> None:
    """Allowed names the matrix does not know (a typo, a region not deployed) never match a replica, even one
    labelled with that name: its distance is unknown."""
    with pytest.raises(RegionRefused) as err:
        plan_ladder("us-east", frozenset({"eu-central"}), {"us-east", "eu-central"}, MATRIX, LadderParams())
    assert err.value.reason == "no_allowed_region_up"
    assert err.value.plan is not None and ("eu-central", "unpriced") in err.value.plan.skipped


def test_region_refused_for_a_client_region_nobody_configured() -> None:
    with pytest.raises(RegionRefused) as err:
        plan_ladder("mars", None, {"us-east"}, MATRIX, LadderParams())
    assert err.value.reason == "unknown_client_region"


def test_region_refused_when_the_only_regions_up_are_beyond_the_ladder() -> None:
    with pytest.raises(RegionRefused) as err:
        plan_ladder("ap-southeast", None, {"us-east"}, MATRIX, LadderParams(max_extra_rtt_s=0.1))
    assert err.value.reason == "beyond_ladder"
    assert err.value.plan is not None and err.value.plan.skipped == (
        ("ap-southeast", "down"),
        ("eu-west", "down"),
        ("us-east", "too_far"),
    )


# ------------------------------------------------------------------ the ladder's decisions


def test_region_ladder_stays_home_while_remote_is_not_faster_by_the_margin() -> None:
    """The home replica queues 0.3 s; eu-west is idle but 75 ms away (5 ms at home): remote is predicted 0.23 s
    faster, more than a 0.1 s margin -> remote; less than a 0.25 s margin -> home."""
    cands = [cand(0, "us-east", queued=3_000), cand(1, "eu-west")]
    d = ladder(margin_s=0.1).choose(req(), cands)
    assert (d.chosen, d.branch) == (1, "faster_region")
    d = ladder(margin_s=0.25).choose(req(), cands)
    assert (d.chosen, d.branch) == (0, "home")
    by = {s.index: s for s in d.scores}
    assert by[1].parts["RTT"] == 0.075 and by[0].parts["RTT"] == 0.005


def test_region_ladder_does_not_hop_to_a_busy_region_because_it_holds_the_prompt() -> None:
    """eu-west holds the whole 2000-token prompt but queues 0.25 s: predicted 0.33 s (queue + 75 ms) against
    home's 0.21 s, so home, although eu-west's score is lower (its hit saves home's 0.2 s of prefill work, the
    work term). Idle, the same hit is faster by more than the margin: eu-west. The busy region stays on the
    ladder for retries, after home."""
    busy = [cand(0, "us-east"), cand(1, "eu-west", queued=2_500, gpu=2000)]
    d = ladder(margin_s=0.02).choose(req(), busy)
    by = {s.index: s for s in d.scores}
    assert by[1].score + 0.02 < by[0].score  # what the ranking followed before
    assert by[1].parts["E"] > by[0].parts["E"]
    assert (d.chosen, d.branch, d.ranking) == (0, "home", [0, 1])
    idle = [cand(0, "us-east"), cand(1, "eu-west", gpu=2000)]
    d = ladder(margin_s=0.02).choose(req(), idle)
    assert (d.chosen, d.branch) == (1, "faster_region")


def test_region_ladder_fails_over_when_home_is_down_and_picks_by_predicted_ttft() -> None:
    """ap-southeast down: eu-west (160 ms) is busy, us-east (220 ms) idle -> us-east; no margin among failover
    rungs."""
    cands = [cand(0, "eu-west", queued=2_000), cand(1, "us-east")]
    policy = ladder(max_regions=2)
    d = policy.choose(req("ap-southeast"), cands)
    assert (d.chosen, d.branch) == (1, "failover")
    assert policy.last_plan is not None and not policy.last_plan.home_up
    d = policy.choose(req("ap-southeast"), [cand(0, "eu-west", queued=500), cand(1, "us-east")])
    assert (d.chosen, d.branch) == (0, "failover")  # 0.05 s queue + 0.16 < 0.22
    assert policy.counts == {"failover": 2}


def test_region_ladder_never_leaves_the_allowed_regions_even_when_home_is_overloaded() -> None:
    cands = [cand(0, "eu-west", queued=200_000), cand(1, "us-east")]
    d = ladder().choose(req("eu-west", frozenset({"eu-west"})), cands)
    assert d.chosen == 0 and d.ranking == [0] and [s.index for s in d.scores] == [0]


def test_region_ladder_refuses_rather_than_violating_residency() -> None:
    policy = ladder()
    with pytest.raises(RegionRefused) as err:
        policy.choose(req("eu-west", frozenset({"eu-west"})), [cand(1, "us-east"), cand(2, "ap-southeast")])
    assert err.value.reason == "no_allowed_region_up"
    assert policy.counts == {"refused_no_allowed_region_up": 1}


def test_region_ladder_ignores_replicas_of_unknown_regions() -> None:
    d = ladder().choose(req(), [cand(0, "", queued=0), cand(1, "us-east", queued=90_000), cand(2, "lunar")])
    assert d.chosen == 1 and d.ranking == [1]


def test_region_ladder_uses_the_routers_region_without_a_client_region() -> None:
    d = ladder().choose(req(client=None), [cand(0, "eu-west"), cand(1, "us-east")])
    assert d.chosen == 1 and d.branch == "home"


def test_region_ladder_ranking_steps_down_the_ladder_for_retries() -> None:
    """Three home replicas beat the remote ones, yet the third place goes to the best remote replica: a router
    retrying after connection failures leaves a dead region after ``attempts_per_region`` tries."""
    cands = [cand(i, "us-east", queued=100 * i) for i in range(3)] + [
        cand(3 + i, "eu-west", queued=20_000 + 100 * i) for i in range(2)
    ]
    d = ladder(attempts_per_region=2).choose(req(), cands)
    assert d.ranking == [0, 1, 3, 4, 2]  # rounds: two places per region, then the next two
    d = ladder(attempts_per_region=1).choose(req(), cands)
    assert d.ranking == [0, 3, 1, 4, 2]


def test_region_ladder_ranking_puts_unscored_candidates_last_and_keeps_exclusions_out() -> None:
    cands = [cand(0, "us-east"), cand(1, "eu-west"), cand(2, "us-east")]
    inner = TTFTPolicy(migration_weight=0.0).choose(req(), cands)
    inner.scores = [s for s in inner.scores if s.index != 2]  # as a pruned decision would
    assert ladder_ranking(cands, inner, "us-east", 0.1, 5) == [0, 1, 2]
    inner.ranking = [0, 1]  # 2 excluded
    assert ladder_ranking(cands, inner, "us-east", 0.1, 5) == [0, 1]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_region_ladder_never_violates_residency_on_random_fleets(data: st.DataObject) -> None:
    """Any fleet, any allowed set (names known or not, empty), any client: the choice and every retry are inside
    the allowed set and on the ladder's rungs, or the request is refused."""
    names = ["us-east", "eu-west", "ap-southeast", "", "eu-central"]
    n = data.draw(st.integers(0, 12))
    cands = [
        cand(i, data.draw(st.sampled_from(names)), queued=data.draw(st.integers(0, 80_000)), gpu=0)
        for i in range(n)
    ]
    allowed = data.draw(st.one_of(st.none(), st.frozensets(st.sampled_from(names), max_size=3)))
    client = data.draw(st.sampled_from([None, "us-east", "eu-west", "ap-southeast", "mars"]))
    params = LadderParams(
        margin_s=data.draw(st.sampled_from([0.0, 0.1, 1.0])),
        max_regions=data.draw(st.integers(1, 3)),
        max_extra_rtt_s=data.draw(st.sampled_from([0.0, 0.1, 0.3])),
    )
    policy = RegionLadderPolicy.with_ttft(MATRIX, "us-east", params)
    try:
        if not cands:
            raise RegionRefused("no_allowed_region_up", "empty fleet", 5.0)
        d = policy.choose(req(client, allowed), cands)
    except RegionRefused as refusal:
        assert refusal.reason in (
            "unknown_client_region",
            "residency_empty",
            "no_allowed_region_up",
            "beyond_ladder",
        )
        return
    region = {c.index: c.region for c in cands}
    assert policy.last_plan is not None
    rungs = {r.region for r in policy.last_plan.rungs}
    assert len(rungs) <= params.max_regions
    for idx in d.ranking:
        assert region[idx] in rungs and region[idx] in MATRIX.regions
        assert allowed is None or region[idx] in allowed
    assert d.chosen == d.ranking[0]


# ------------------------------------------------------------------ baselines and the region load


def test_region_local_serves_only_the_clients_region() -> None:
    policy = RegionLocalPolicy(TTFTPolicy(), MATRIX, "us-east")
    d = policy.choose(req("eu-west"), [cand(0, "us-east"), cand(1, "eu-west", queued=90_000)])
    assert d.chosen == 1 and d.ranking == [1] and d.policy == "region_local"
    with pytest.raises(RegionRefused):
        policy.choose(req("ap-southeast"), [cand(0, "us-east")])


def test_region_nearest_takes_the_nearest_region_with_capacity() -> None:
    """GeoDNS: the nearest region unless its best replica queues over the shed threshold; residency unseen."""
    policy = RegionNearestPolicy(TTFTPolicy(), MATRIX, "us-east", shed_queue_s=2.0)
    cands = [cand(0, "eu-west", queued=15_000), cand(1, "us-east"), cand(2, "ap-southeast")]
    assert policy.choose(req("eu-west", frozenset({"eu-west"})), cands).chosen == 0  # 1.5 s <= 2 s
    cands[0] = cand(0, "eu-west", queued=25_000)
    d = policy.choose(req("eu-west", frozenset({"eu-west"})), cands)
    assert d.chosen == 1 and d.policy == "region_nearest"  # shed to us-east: residency is not DNS's business
    for c in cands:
        c.load.queued_prefill_tokens = 90_000
    assert policy.choose(req("ap-southeast"), cands).chosen == 2  # all full: the nearest


def test_region_load_is_what_a_region_publishes() -> None:
    cs = [cand(0, "a", queued=10_000), cand(1, "a", queued=30_000)]
    cs[1].load.kv_usage = None
    load = region_load(cs, 1024)
    assert (load.replicas, load.queue_s_min, load.queue_s_mean) == (2, 1.0, 2.0)
    assert load.kv_free == pytest.approx(0.45)
    assert region_load([], 1024).replicas == 0 and math.isinf(region_load([], 1024).queue_s_min)
    blind = Candidate(0, "x", LoadView(queued_requests=3, inflight_prefill_tokens=1000), profile=PROF)
    assert queue_seconds(blind, 1000.0) == pytest.approx(0.4)
    broken = Candidate(0, "x", LoadView(queued_prefill_tokens=-5), profile=PROF)
    assert math.isinf(queue_seconds(broken, 1000.0))
