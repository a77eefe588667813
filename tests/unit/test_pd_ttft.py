"""pd_ttft pair choice: the seeds' handoff numbers (TV-14) and the behaviours issue 19 asks for."""

from __future__ import annotations

import pytest

import policies  # noqa: F401  (registers the policies)
from policies.base import Candidate, LoadView, PrefixHit, ReplicaProfile, RouteRequest
from policies.pd_base import HandoffLink, PdCandidate, Role, make_pd_policy, pd_policy_names, plan_charges

#: Qwen3-8B KV bytes per token (seeds 004 §8.1.2: 2 x 36 x 8 x 128 x 2 = 147,456 B); 8192 tokens = 1.125 GiB.
BPT = 147_456.0
A100 = ReplicaProfile(
    prefill_tokens_per_s=9566.0, bytes_per_token=BPT, decode_step_s=0.026, decode_interference_s=0.01
)
H20 = ReplicaProfile(
    prefill_tokens_per_s=4538.0,
    bytes_per_token=BPT,
    decode_step_s=0.026,
    decode_step_s_per_request=5e-5,
    decode_interference_s=0.01,
)
LINK = HandoffLink(bandwidth_bytes_per_s=25e9)


def cand(
    i: int,
    role: Role,
    profile: ReplicaProfile,
    *,
    backlog: int = 0,
    running: int = 0,
    gpu_hit: int = 0,
    inflight: int = 0,
) -> PdCandidate:
    load = LoadView(
        queued_requests=0,
        running_requests=running,
        queued_prefill_tokens=backlog,
        kv_usage=0.1,
        inflight_requests=inflight,
    )
    return PdCandidate(
        Candidate(i, f"r{i}", load=load, hit=PrefixHit(gpu=gpu_hit), profile=profile), role=role
    )


def req(n: int) -> RouteRequest:
    return RouteRequest(model="m", prompt_tokens=n, block_keys=[], block_size=16)


def test_tv14_handoff_of_one_eighth_gib_at_25_gbps_is_48_3_ms() -> None:
    assert LINK.transfer_s(8192 * BPT) == pytest.approx(0.0483, abs=0.0001)
    assert 8192 * BPT == 1_207_959_552  # 1.125 GiB exactly
    assert HandoffLink(12.5e9).transfer_s(8192 * BPT) == pytest.approx(0.0966, abs=0.0001)  # 100 GbE


def test_tv14_disaggregated_ttft_is_prefill_plus_handoff_plus_first_step() -> None:
    """Idle A100 prefill, idle H20 decode, 8192 uncached tokens: 0.856 s + 48.3 ms + one decode round."""
    fleet = [cand(0, "prefill", A100), cand(1, "decode", H20)]
    d = make_pd_policy("pd_ttft", decode_prefills=False).choose_plan(req(8192), fleet, LINK)
    plan = d.chosen
    assert plan.kind == "disaggregated" and plan.prefill == 0 and plan.decode == 1
    assert plan.terms["C_p"] == pytest.approx(8192 / 9566, abs=1e-3)  # 0.856 s
    assert plan.terms["handoff"] == pytest.approx(0.0483, abs=1e-4)
    assert plan.handoff_tokens == 8192 and plan.prefill_tokens == 8192
    assert plan.predicted_ttft_s == pytest.approx(0.856 + 0.0483 + 0.026 + 0.0, abs=2e-3)


def test_prefix_hit_on_p_still_moves_the_whole_prompt() -> None:
    """TV-14 (6144 hit on P, 2048 new): A100 prefill 0.214 s of new tokens; the 1.125 GiB handoff is still needed."""
    fleet = [cand(0, "prefill", A100, gpu_hit=6144), cand(1, "decode", H20)]
    plan = make_pd_policy("pd_ttft", decode_prefills=False).choose_plan(req(8192), fleet, LINK).chosen
    assert plan.prefill_tokens == 2048 and plan.handoff_tokens == 8192
    assert plan.terms["C_p"] == pytest.approx(2048 / 9566, abs=1e-3)
    assert plan.terms["handoff"] == pytest.approx(0.0483, abs=1e-4)


def test_short_prompt_is_served_in_place() -> None:
    """64 tokens: a decode replica's own prefill (14 ms on an H20) beats P + handoff + a decode round."""
    fleet = [cand(0, "prefill", A100), cand(1, "decode", H20)]
    d = make_pd_policy("pd_ttft").choose_plan(req(64), fleet, HandoffLink(25e9, latency_s=0.002))
    assert d.chosen.kind == "in_place" and d.chosen.decode == 1
    assert d.branch == "in_place"
    assert {p.kind for p in d.plans} == {"in_place", "disaggregated"}


def test_decode_replica_holding_the_prefix_serves_in_place() -> None:
    fleet = [cand(0, "prefill", A100), cand(1, "decode", H20, gpu_hit=7936), cand(2, "decode", H20)]
    d = make_pd_policy("pd_ttft").choose_plan(req(8192), fleet, LINK)
    assert d.chosen.kind == "in_place" and d.chosen.decode == 1
    assert d.chosen.prefill_tokens == 8192 - 7936


def test_long_uncached_prompt_with_idle_prefill_is_disaggregated() -> None:
    """8192 uncached tokens: the H20 decode replica would take 1.8 s (and stall its batch); P + handoff 0.93 s."""
    fleet = [cand(0, "prefill", A100), cand(1, "decode", H20, running=16)]
    d = make_pd_policy("pd_ttft").choose_plan(req(8192), fleet, LINK)
    assert d.chosen.kind == "disaggregated" and (d.chosen.prefill, d.chosen.decode) == (0, 1)
    in_place = [p for p in d.plans if p.kind == "in_place"][0]
    assert in_place.predicted_ttft_s > d.chosen.predicted_ttft_s + 0.5


def test_busy_prefill_pool_falls_back_to_in_place() -> None:
    fleet = [cand(0, "prefill", A100, backlog=60_000), cand(1, "decode", H20)]
    d = make_pd_policy("pd_ttft").choose_plan(req(4096), fleet, LINK)
    assert d.chosen.kind == "in_place"


def test_decode_holding_a_prefix_reduces_the_handoff() -> None:
    fleet = [cand(0, "prefill", A100), cand(1, "decode", H20, gpu_hit=4096)]
    d = make_pd_policy("pd_ttft", decode_prefills=False).choose_plan(req(8192), fleet, LINK)
    assert d.chosen.handoff_tokens == 4096
    assert d.chosen.terms["handoff"] == pytest.approx(4096 * BPT / 25e9, rel=1e-6)


def test_burst_spreads_over_prefill_replicas_when_both_legs_are_charged() -> None:
    """Charging ``plan_charges`` before each dispatch spreads 8 simultaneous requests over the 4 prefill replicas
    and the 4 decode replicas; without the charge every one goes to prefill #0 (the sglang #27547 bug class)."""
    fleet = [cand(i, "prefill", A100) for i in range(4)] + [cand(4 + i, "decode", H20) for i in range(4)]
    pol = make_pd_policy("pd_ttft", decode_prefills=False)
    prefills: list[int] = []
    decodes = []
    for _ in range(8):
        plan = pol.choose_plan(req(4096), fleet, LINK).chosen
        assert plan.prefill is not None  # every plan here has a prefill leg (the sort below relies on it)
        prefills.append(plan.prefill)
        decodes.append(plan.decode)
        for charge in plan_charges(plan):
            load = fleet[charge.index].candidate.load
            load.inflight_requests += charge.requests
            load.inflight_prefill_tokens += charge.prefill_tokens
    assert sorted(prefills) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len(set(decodes)) == 4
    uncharged = [
        make_pd_policy("pd_ttft", decode_prefills=False)
        .choose_plan(req(4096), [cand(i, "prefill", A100) for i in range(4)] + [cand(4, "decode", H20)], LINK)
        .chosen.prefill
        for _ in range(8)
    ]
    assert set(uncharged) == {0}


def test_link_backlog_moves_the_request_to_another_prefill_replica() -> None:
    fleet = [cand(0, "prefill", A100), cand(1, "prefill", A100), cand(2, "decode", H20)]
    fleet[0].link_busy_s = 2.0  # handoffs queued on replica 0's NIC
    plan = make_pd_policy("pd_ttft", decode_prefills=False).choose_plan(req(8192), fleet, LINK).chosen
    assert plan.prefill == 1


def test_plan_charges_cover_both_legs() -> None:
    fleet = [cand(0, "prefill", A100, gpu_hit=1024), cand(1, "decode", H20)]
    plan = make_pd_policy("pd_ttft", decode_prefills=False).choose_plan(req(8192), fleet, LINK).chosen
    charges = {c.index: (c.requests, c.prefill_tokens) for c in plan_charges(plan)}
    assert charges == {0: (1, 8192 - 1024), 1: (1, 0)}


def test_only_prefill_replicas_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no feasible PD plan"):
        make_pd_policy("pd_ttft").choose_plan(req(100), [cand(0, "prefill", A100)], LINK)


def test_colocated_fleet_serves_in_place_on_the_shortest_ttft() -> None:
    fleet = [cand(0, "both", A100, backlog=20_000), cand(1, "both", A100, gpu_hit=2048)]
    d = make_pd_policy("pd_ttft").choose_plan(req(4096), fleet, LINK)
    assert d.chosen.kind == "in_place" and d.chosen.decode == 1
    assert all(p.kind == "in_place" for p in d.plans)


def test_pd_random_pairs_are_seeded_and_feasible() -> None:
    fleet = [
        cand(0, "prefill", A100),
        cand(1, "prefill", A100),
        cand(2, "decode", H20),
        cand(3, "decode", H20),
    ]
    a = [make_pd_policy("pd_random", seed=3).choose_plan(req(100), fleet, LINK).chosen for _ in range(1)]
    pol1, pol2 = make_pd_policy("pd_random", seed=3), make_pd_policy("pd_random", seed=3)
    seq1 = [
        (p.prefill, p.decode) for p in (pol1.choose_plan(req(100), fleet, LINK).chosen for _ in range(20))
    ]
    seq2 = [
        (p.prefill, p.decode) for p in (pol2.choose_plan(req(100), fleet, LINK).chosen for _ in range(20))
    ]
    assert seq1 == seq2 and a[0].kind == "disaggregated"
    assert {p for p, _ in seq1} == {0, 1} and {d for _, d in seq1} == {2, 3}
    both = [cand(0, "both", A100), cand(1, "both", A100)]
    assert make_pd_policy("pd_random").choose_plan(req(100), both, LINK).chosen.kind == "in_place"


def test_registered_names() -> None:
    assert {"pd_ttft", "pd_random"} <= set(pd_policy_names())


def test_in_place_prediction_is_ttfts_own_estimate() -> None:
    """The prefill side is the ``ttft`` model: an in-place plan predicts exactly ``ttft``'s E[T] for that replica."""
    from policies.base import make_policy

    fleet = [cand(0, "both", A100, backlog=3000, running=4, gpu_hit=1024), cand(1, "both", H20, gpu_hit=2048)]
    d = make_pd_policy("pd_ttft").choose_plan(req(4096), fleet, LINK)
    ref = make_policy("ttft").choose(req(4096), [c.candidate for c in fleet])
    by_replica = {p.decode: p.predicted_ttft_s for p in d.plans}
    for sc in ref.scores:
        assert by_replica[sc.index] == pytest.approx(sc.parts["E"], rel=1e-12)
    assert d.chosen.decode == ref.chosen


def test_aged_backlog_prefers_the_replica_that_started_first() -> None:
    """Equal in-flight backlogs: with ``age_inflight`` the replica working longest on it is seen to finish first,
    and a stale scraped queue is not added on top of the router's own in-flight tokens."""
    fleet = [cand(0, "prefill", A100), cand(1, "prefill", A100), cand(2, "decode", H20)]
    for c, elapsed in ((fleet[0], 0.1), (fleet[1], 0.6)):
        c.candidate.load.inflight_prefill_tokens = 8192
        c.candidate.load.inflight_requests = 1
        c.candidate.load.inflight_prefill_elapsed_s = elapsed
    plain = make_pd_policy("pd_ttft", decode_prefills=False).choose_plan(req(4096), fleet, LINK).chosen
    aged = make_pd_policy("pd_ttft", decode_prefills=False, age_inflight=True).choose_plan(
        req(4096), fleet, LINK
    )
    assert plain.prefill == 0  # equal backlogs, ties by candidate order
    assert aged.chosen.prefill == 1
    assert aged.chosen.terms["Q_p"] == pytest.approx(8192 / 9566 - 0.6, abs=0.01)
    fleet[1].candidate.load.queued_prefill_tokens = 8192  # the same request, queued at the scrape 0.6 s ago
    fleet[1].candidate.load.age_s = 0.6
    again = make_pd_policy("pd_ttft", decode_prefills=False, age_inflight=True).choose_plan(
        req(4096), fleet, LINK
    )
    assert again.chosen.prefill == 1


@pytest.mark.parametrize("policy", ["pd_ttft", "pd_llmd", "pd_random", "pd_smg", "pd_dynamo"])
def test_decode_engine_that_cannot_serve_alone_gets_no_in_place_plan(policy: str) -> None:
    """An SGLang decode-mode server (``serves_alone`` False) only takes decode legs: the 64-token prompt that
    ``test_short_prompt_is_served_in_place`` serves on the decode replica is disaggregated instead."""
    fleet = [cand(0, "prefill", A100), cand(1, "decode", H20)]
    fleet[1].serves_alone = False
    d = make_pd_policy(policy).choose_plan(req(64), fleet, HandoffLink(25e9, latency_s=0.002))
    assert d.chosen.kind == "disaggregated" and d.chosen.prefill == 0 and d.chosen.decode == 1
    assert all(p.kind == "disaggregated" for p in d.plans)


def test_no_plan_when_only_decode_engines_that_cannot_serve_alone() -> None:
    fleet = [cand(0, "decode", H20), cand(1, "decode", H20)]
    for c in fleet:
        c.serves_alone = False
    with pytest.raises(ValueError):
        make_pd_policy("pd_ttft").choose_plan(req(64), fleet, LINK)
