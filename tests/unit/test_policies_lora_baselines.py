"""The peers' LoRA routing baselines, as their sources behave: llm-d's lora-affinity scorer, AIBrix's
lora-affinity router (with its capacity bug), Dynamo's HRW allocation controller and filter."""

from __future__ import annotations

from collections import Counter

import pytest

from policies.adapters import AdapterSlots
from policies.base import Candidate, LoadView, PrefixHit, RouteRequest, make_policy, policy_names
from policies.lora_dynamo import (
    LoraDynamoPolicy,
    active_replica_counts,
    hrw_score,
    rank_workers,
    replica_set_with_slots,
)
from policies.lora_llmd import lora_affinity_score


def _slots(
    running: tuple[str, ...] = (), max_loras: int = 2, info: bool = True, **kw: object
) -> AdapterSlots:
    return AdapterSlots(max_loras=max_loras, running=running, waiting=running, requests_info=info, **kw)  # type: ignore[arg-type]


def _cand(i: int, slots: AdapterSlots | None, inflight: int = 0, queued: int = 0) -> Candidate:
    load = LoadView(
        queued_requests=queued, running_requests=0, kv_usage=0.2, inflight_requests=inflight, adapters=slots
    )
    return Candidate(index=i, name=f"r{i}", load=load, hit=PrefixHit())


REQ = RouteRequest(model="base", prompt_tokens=1024, block_keys=list(range(64)), lora="a")


def test_the_baselines_are_registered() -> None:
    assert {"lora_llmd", "lora_aibrix", "lora_dynamo"} <= set(policy_names())


# ------------------------------------------------------------------ llm-d


def test_llmd_scores_request_activity_not_residency() -> None:
    """1.0 when the adapter has requests running, 0.8 with room in the batch, 0 when full; an adapter resident
    but idle (in a GPU slot, absent from lora_requests_info) scores like one never loaded: the peer bug."""
    assert lora_affinity_score(REQ, _cand(0, _slots(("a",)))) == 1.0
    assert lora_affinity_score(REQ, _cand(0, _slots(("b",)))) == 0.8
    assert lora_affinity_score(REQ, _cand(0, _slots(("b", "c")))) == 0.0
    idle = _slots(("b", "c"), gpu=("a", "b", "c"))
    assert lora_affinity_score(REQ, _cand(0, idle)) == 0.0
    waiting_only = AdapterSlots(max_loras=1, running=("b",), waiting=("a",), requests_info=True)
    assert lora_affinity_score(REQ, _cand(0, waiting_only)) == 0.6
    assert lora_affinity_score(REQ, _cand(0, _slots(info=False))) == 0.0  # no metric family yet
    assert lora_affinity_score(REQ, _cand(0, None)) == 0.0


def test_llmd_prefers_the_active_replica_all_else_equal() -> None:
    cands = [_cand(0, _slots(("b",))), _cand(1, _slots(("a",))), _cand(2, _slots(("b", "c")))]
    d = make_policy("lora_llmd").choose(REQ, cands)
    assert d.chosen == 1 and d.branch == "lora" and d.scores[1].parts["lora"] == 1.0


# ------------------------------------------------------------------ AIBrix


def test_aibrix_least_request_among_affinity_pods() -> None:
    cands = [_cand(0, _slots(("a",)), inflight=5), _cand(1, _slots(("a",)), inflight=2), _cand(2, _slots())]
    d = make_policy("lora_aibrix").choose(REQ, cands)
    assert d.chosen == 1 and d.branch == "affinity"


def test_aibrix_never_sees_capacity_as_its_code_reads_max_from_the_waiting_list() -> None:
    """No affinity anywhere: every pod exporting LoRA metrics lacks capacity (Atoi of the waiting adapters is 0),
    so the pod is random even though one is idle; with the intended ``max_lora`` check, the available group's
    least-request pod (an empty list still counts one entry: ``strings.Split("", ",")``)."""
    cands = [_cand(0, _slots(("b",), 4), inflight=9), _cand(1, _slots((), 4)), _cand(2, _slots(("c",), 4), 9)]
    picks = Counter(make_policy("lora_aibrix", seed=s).choose(REQ, cands).chosen for s in range(60))
    assert set(picks) == {0, 1, 2}
    assert make_policy("lora_aibrix", seed=0).choose(REQ, cands).branch == "random"
    fixed = make_policy("lora_aibrix", capacity_from_max_lora=True, seed=0).choose(REQ, cands)
    assert fixed.chosen == 1 and fixed.branch == "available"


def test_aibrix_pods_without_lora_metrics_count_as_available() -> None:
    cands = [_cand(0, None, inflight=3), _cand(1, _slots(info=False), inflight=1), _cand(2, _slots(("b",)))]
    d = make_policy("lora_aibrix").choose(REQ, cands)
    assert d.chosen == 1 and d.branch == "available"


# ------------------------------------------------------------------ Dynamo


def test_hrw_ranking_is_deterministic_and_stable_when_workers_leave() -> None:
    workers = list(range(8))
    ranked = rank_workers("lora-x", workers)
    assert ranked == rank_workers("lora-x", list(reversed(workers))) and sorted(ranked) == workers
    assert hrw_score("lora-x", 3) == hrw_score("lora-x", 3) != hrw_score("lora-y", 3)
    gone = ranked[-1]
    assert rank_workers("lora-x", [w for w in workers if w != gone]) == ranked[:-1]


def test_slot_aware_sticky_placement() -> None:
    """Dynamo's hrw.rs cases: full workers are skipped, all-full falls back to plain HRW, a prior placement that
    is not full is kept, a full prior worker is replaced."""
    workers = list(range(5))
    ranked = rank_workers("lora-x", workers)
    usage = {w: (4, 4) if w in ranked[:2] else (1, 4) for w in workers}
    assert replica_set_with_slots("lora-x", workers, 2, usage) == ranked[2:4]
    all_full = {w: (4, 4) for w in workers}
    assert replica_set_with_slots("lora-x", workers, 2, all_full) == ranked[:2]
    free = {w: (0, 4) for w in workers}
    prior = ranked[3:5]
    assert sorted(replica_set_with_slots("lora-x", workers, 2, free, prior)) == sorted(prior)
    free[prior[0]] = (4, 4)
    kept = replica_set_with_slots("lora-x", workers, 2, free, prior)
    assert prior[1] in kept and prior[0] not in kept


def test_proportional_replica_counts() -> None:
    """Dynamo's controller tests: 60/30/10 of 12 slots on 5 workers keeps the order; 50/50 of 2 slots gives one
    each; more active adapters than slots keeps the top ones by load."""
    c = active_replica_counts({"a": 60, "b": 30, "c": 10}, 12, 5)
    assert 1 <= c["c"] <= c["b"] <= c["a"] <= 5
    assert active_replica_counts({"a": 50, "b": 50}, 2, 10) == {"a": 1, "b": 1}
    assert active_replica_counts({"a": 5, "b": 1, "c": 3}, 2, 4).keys() == {"a", "c"}


def _dyn_cands(n: int = 4, max_loras: int = 2) -> list[Candidate]:
    return [_cand(i, AdapterSlots(max_loras=max_loras)) for i in range(n)]


def test_dynamo_keeps_an_adapter_on_its_replica_set_and_pins_it_when_idle() -> None:
    """Every request for one adapter goes to its allocated workers; after the 90 s window with no arrivals it
    is inactive and pinned to its HRW-top worker."""
    policy = LoraDynamoPolicy(seed=0)
    cands = _dyn_cands()
    chosen = set()
    for k in range(20):
        req = RouteRequest(model="base", prompt_tokens=512, block_keys=[], lora="a", now=0.5 * k)
        chosen.add(policy.choose(req, cands).chosen)
    entry = policy.state.table["a"]
    assert entry.active and chosen <= set(entry.workers)
    late = policy.choose(
        RouteRequest(model="base", prompt_tokens=512, block_keys=[], lora="b", now=400.0), cands
    )
    assert (
        not policy.state.table["a"].active
        and policy.state.table["a"].workers == rank_workers("a", [0, 1, 2, 3])[:1]
    )
    assert late.policy == "lora_dynamo"
    assert len(late.ranking) == 4 and sorted(late.ranking) == [0, 1, 2, 3]


def test_dynamo_routes_base_requests_by_kv_cost_alone() -> None:
    cands = _dyn_cands()
    cands[2].hit = PrefixHit(gpu=1008)
    d = LoraDynamoPolicy().choose(RouteRequest(model="base", prompt_tokens=1024, block_keys=[]), cands)
    assert d.chosen == 2 and d.branch == "base"


def test_dynamo_parameters_are_checked() -> None:
    with pytest.raises(ValueError):
        LoraDynamoPolicy(timestep_s=0)
