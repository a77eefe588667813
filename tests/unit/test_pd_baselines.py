"""The PD baselines behave like the peers they mimic (SMG, llm-d, Dynamo, random pairs)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import policies  # noqa: F401  (registers the policies)
from policies.base import Candidate, LoadView, PrefixHit, ReplicaProfile, RouteRequest
from policies.pd_base import HandoffLink, PdCandidate, Role, make_pd_policy
from policies.pd_common import plan_request

PROF = ReplicaProfile(prefill_tokens_per_s=10_000.0)
LINK = HandoffLink(25e9)
BASELINES = ["pd_smg", "pd_llmd", "pd_dynamo", "pd_random"]


def cand(
    i: int,
    role: Role,
    *,
    gpu_hit: int = 0,
    queued: int = 0,
    active_blocks: int | None = None,
    kv: float = 0.1,
) -> PdCandidate:
    load = LoadView(queued_requests=queued, running_requests=0, kv_usage=kv, active_kv_blocks=active_blocks)
    return PdCandidate(Candidate(i, f"r{i}", load=load, hit=PrefixHit(gpu=gpu_hit), profile=PROF), role=role)


def req(n: int, first_key: int = 0) -> RouteRequest:
    return RouteRequest(
        model="m", prompt_tokens=n, block_keys=list(range(first_key, first_key + n // 16)), block_size=16
    )


def pd_fleet() -> list[PdCandidate]:
    return [cand(0, "prefill"), cand(1, "prefill"), cand(2, "decode"), cand(3, "decode")]


@pytest.mark.parametrize("name", BASELINES + ["pd_ttft"])
def test_every_plan_respects_roles(name: str) -> None:
    pol = make_pd_policy(name)
    for k in range(30):
        d = pol.choose_plan(req(16 * (1 + 37 * k % 400), first_key=1000 * k), pd_fleet(), LINK)
        plan = d.chosen
        assert plan.decode in (2, 3)
        if plan.kind == "disaggregated":
            assert plan.prefill in (0, 1) and plan.handoff_tokens > 0
        assert d.plans[0] is plan and d.policy == name


def test_smg_pairs_independently_and_always_disaggregates() -> None:
    """Prefill by cache_aware: a prompt routed once goes back to the same prefill replica; decode by
    power_of_two over the decode pool; every request disaggregated (SMG's PD mode has no in-place path)."""
    pol = make_pd_policy("pd_smg")
    first = pol.choose_plan(req(4096, 7), pd_fleet(), LINK).chosen
    again = [pol.choose_plan(req(4096, 7), pd_fleet(), LINK).chosen for _ in range(5)]
    assert first.kind == "disaggregated" and all(p.kind == "disaggregated" for p in again)
    assert {p.prefill for p in again} == {first.prefill}
    short = pol.choose_plan(req(32, 99_000), pd_fleet(), LINK).chosen
    assert short.kind == "disaggregated"


def test_llmd_decides_on_the_chosen_decode_pods_uncached_suffix() -> None:
    fleet = [cand(0, "prefill"), cand(1, "decode", gpu_hit=4000), cand(2, "decode")]
    pol = make_pd_policy("pd_llmd")
    near = pol.choose_plan(req(4096), fleet, LINK)  # decode pod 1 (prefix scorer) misses 96 < 128 tokens
    assert near.chosen.kind == "in_place" and near.chosen.decode == 1 and near.branch == "decider_in_place"
    far = pol.choose_plan(req(8192), fleet, LINK)  # still decode pod 1, but 4192 tokens uncached
    assert far.chosen.kind == "disaggregated" and far.chosen.decode == 1 and far.chosen.prefill == 0
    off = make_pd_policy("pd_llmd", non_cached_tokens=0).choose_plan(req(8192), fleet, LINK)
    assert off.chosen.kind == "in_place"  # llm-d's default 0 turns disaggregation off
    with pytest.raises(ValueError):
        make_pd_policy("pd_llmd", non_cached_tokens=-1)


def test_dynamo_prefill_follows_kv_overlap_and_decode_ignores_it() -> None:
    fleet = [
        cand(0, "prefill", active_blocks=0),
        cand(1, "prefill", gpu_hit=3072, active_blocks=0),
        cand(2, "decode", gpu_hit=4000, active_blocks=5000),
        cand(3, "decode", active_blocks=100),
    ]
    plan = make_pd_policy("pd_dynamo").choose_plan(req(4096), fleet, LINK).chosen
    assert plan.kind == "disaggregated"
    assert plan.prefill == 1  # the overlap lowers its prefill blocks
    assert plan.decode == 3  # load only: the decode replica holding the prefix is busier


@pytest.mark.parametrize("name", BASELINES)
def test_colocated_fleet_serves_in_place(name: str) -> None:
    both = [cand(0, "both"), cand(1, "both"), cand(2, "both")]
    plan = make_pd_policy(name).choose_plan(req(1024), both, LINK).chosen
    assert plan.kind == "in_place" and plan.prefill is None and plan.prefill_tokens == 1024


@pytest.mark.parametrize("name", BASELINES + ["pd_ttft"])
def test_no_feasible_plan_is_a_clear_error(name: str) -> None:
    with pytest.raises(ValueError, match="no feasible PD plan|at least one candidate"):
        make_pd_policy(name).choose_plan(req(64), [cand(0, "prefill"), cand(1, "prefill")], LINK)
    with pytest.raises(ValueError):
        make_pd_policy(name).choose_plan(req(64), [], LINK)


@pytest.mark.parametrize("name", BASELINES + ["pd_ttft"])
def test_parallel_sampling_is_served_in_place_by_every_policy(name: str) -> None:
    """n > 1 / best_of > 1 (``RouteRequest.sequences``): in place on a decode / both replica that serves alone,
    whatever the policy would otherwise pair (pd_smg always pairs; pd_ttft with decode_prefills=false never serves
    in place on a decode replica); with no such replica (an SGLang fleet) the policy's own plan stands."""
    params = {"decode_prefills": False} if name == "pd_ttft" else {}
    pol = make_pd_policy(name, **params)
    long = replace(req(8192, 5), sequences=2)
    d = plan_request(pol, long, pd_fleet(), LINK)
    assert d.chosen.kind == "in_place" and d.chosen.decode in (2, 3) and d.chosen.prefill is None
    assert all(p.kind == "in_place" for p in d.plans) and d.branch == "parallel_sampling_in_place"
    assert plan_request(pol, req(8192, 5), pd_fleet(), LINK).chosen.kind == "disaggregated"
    sglang = [cand(0, "prefill"), cand(1, "prefill"), cand(2, "decode"), cand(3, "decode")]
    for c in sglang[2:]:
        c.serves_alone = False
    assert plan_request(pol, long, sglang, LINK).chosen.kind == "disaggregated"
