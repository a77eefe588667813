"""Exact pruning in ``ttft``: a pruned decision is the decision full scoring makes.

Property tests over random fleets (loads with unknown and absurd gauges, round trips to the client's region,
tiers, matches, predicted entries, LoRA adapter states (GPU-, CPU-resident, loadable, waiting for a slot, absurd
terms), heterogeneous profiles with attention and tier links, calibration, SLO targets and priorities, objectives, the
migration penalty with its tight-cache and survival variants, exact ties) and over the decisions of a simulated
fleet replaying the Mooncake conversation trace: the pruned and the full-scoring policy (same parameters, same
observations) agree on the choice, the branch, the first ``exact_ranks`` places of the ranking, every score the
pruned one carries (bit for bit), the ranking's members, the lowest predicted TTFT under a target, and their
state afterwards (exclusion counts, popularity table, calibration). Full scoring is ``prune=False``, the code
every decision ran before pruning existed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index.hashing import root_seed
from policies.adapters import AdapterCost
from policies.admission_slo import best_predicted_ttft_s, predicted_ttft_s
from policies.base import (
    Candidate,
    CandidateScore,
    Decision,
    LoadView,
    Observation,
    PrefixHit,
    ReplicaProfile,
    RouteRequest,
    TierLink,
    make_policy,
)
from policies.ttft import PrunedTTFTPolicy, TTFTPolicy, _Scored
from policies.ttft_bounds import SAFE, Bounds, bound_pass, migration_bound, worst_known
from sim.simulator import Fleet, FleetConfig, _Rec
from sim.traces import BlockKeyCache, load_mooncake, scale_rate
from tests.helpers import shared_trace

BS = 16


def assert_same_decision(pruned: Decision, full: Decision, exact_ranks: int, target: float | None) -> None:
    """What callers read from a decision is the same: the choice, the branch, the head of the ranking, the
    scored candidates' scores and terms, the ranking's members and the lowest predicted TTFT under a target."""
    assert (pruned.chosen, pruned.branch, pruned.policy) == (full.chosen, full.branch, full.policy)
    assert pruned.ranking[:exact_ranks] == full.ranking[:exact_ranks]
    assert sorted(pruned.ranking) == sorted(full.ranking)
    assert len(set(pruned.ranking)) == len(pruned.ranking)
    by_index = {s.index: s for s in full.scores}
    assert [s.index for s in pruned.scores] == [
        s.index for s in full.scores if s.index in {x.index for x in pruned.scores}
    ]
    for s in pruned.scores:
        assert s == by_index[s.index]
    scored = {s.index for s in pruned.scores}
    assert set(full.ranking[:exact_ranks]) <= scored and pruned.chosen in scored
    if target is not None:
        assert best_predicted_ttft_s(pruned.scores, pruned.ranking) == best_predicted_ttft_s(
            full.scores, full.ranking
        )
        meets = {s.index for s in full.scores if s.index in full.ranking and predicted_ttft_s(s) <= target}
        assert meets <= scored


def state(policy: TTFTPolicy) -> tuple[Any, ...]:
    """Everything a decision or an observation may change in a ``ttft`` policy."""
    return (
        policy.excluded_candidates,
        policy.last_exclusion,
        dict(policy._deep_counts),
        dict(policy._attention),
        policy._reuse_age,
        policy._reuse_n,
        dict(policy._rates),
        dict(policy._overheads),
        policy._mean_uncached,
        policy._mean_samples,
        {k: list(v) for k, v in policy._written.items()},
    )


class Twins:
    """A pruned and a full-scoring ``ttft`` policy fed the same decisions and observations, compared each time."""

    def __init__(self, **params: Any) -> None:
        self.pruned = TTFTPolicy(prune=True, prune_min_candidates=0, **params)
        self.full = TTFTPolicy(prune=False, **params)
        self.decisions = 0
        self.pruned_before = 0

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        try:
            full = self.full.choose(request, candidates)
        except ValueError as exc:  # a profile without a prefill rate: both raise the same error
            with pytest.raises(type(exc), match="prefill_tokens_per_s"):
                self.pruned.choose(request, candidates)
            return Decision(chosen=candidates[0].index, ranking=[], scores=[], policy="ttft")
        pruned = self.pruned.choose(request, candidates)
        assert_same_decision(pruned, full, self.pruned.exact_ranks, request.ttft_target_s)
        assert state(self.pruned) == state(self.full)
        self.decisions += 1
        return pruned

    def observe(self, observation: Observation) -> None:
        self.pruned.observe(observation)
        self.full.observe(observation)
        assert state(self.pruned) == state(self.full)


# ------------------------------------------------------------------ random fleets

_TOKENS = st.integers(min_value=0, max_value=40_000)


#: the profile generator's strategies, built once (see ``_BAD`` below)
_TIER_SETS = st.sets(st.sampled_from(["cpu", "disk", "remote"]))
_LINK_BYTES = st.sampled_from([1e9, 6.25e9, 25e9, 200e9])
_LINK_LATENCY = st.sampled_from([0.0, 0.001, 0.01])
_RATES = st.sampled_from([1_000.0, 5_000.0, 8_000.0, 16_000.0, 60_000.0])
_OVERHEADS = st.sampled_from([0.0, 0.005, 0.02, 0.3])
_ATTENTION = st.sampled_from([0.0, 0.0, 1e-9, 3.5e-9, 1e-7])
_BYTES_PER_TOKEN = st.sampled_from([32_768.0, 147_456.0])
_INTERFERENCE = st.sampled_from([0.0, 0.0005, 0.01])


@st.composite
def profiles(draw: st.DrawFn) -> ReplicaProfile:
    """A replica profile: any rate, overhead, attention, tier links (some too slow to use), decode interference."""
    tiers: dict[str, TierLink] = {}
    for tier in draw(_TIER_SETS):
        tiers[tier] = TierLink(draw(_LINK_BYTES), draw(_LINK_LATENCY))
    return ReplicaProfile(
        prefill_tokens_per_s=draw(_RATES),
        fixed_overhead_s=draw(_OVERHEADS),
        attention_s_per_token2=draw(_ATTENTION),
        bytes_per_token=draw(_BYTES_PER_TOKEN),
        tiers=tiers,
        fetch_overlaps_queue=draw(st.booleans()),
        decode_interference_s=draw(_INTERFERENCE),
    )


def _maybe(value: st.SearchStrategy[Any], none: float = 0.15) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), value) if none else value


#: the strategies the generators below draw from, built once (a strategy built inside a draw is built and
#: validated again for every draw: most of these tests' time went there); the draws are the same
_BAD = st.sampled_from([-1, -5_000, math.nan, math.inf, 10**400, int(1e308)])
_KV_BAD = st.sampled_from([-0.5, math.nan, math.inf, 1.5])
_UP_TO_9 = st.integers(0, 9)
_QUEUED = _maybe(st.integers(0, 60))
_RUNNING = _maybe(st.integers(0, 300))
_QUEUED_TOKENS = _maybe(st.one_of(_TOKENS, st.integers(0, 2_000_000)))
_INFLIGHT = st.integers(0, 30)
_MAYBE_TOKENS = _maybe(_TOKENS)
_KV_USAGE = _maybe(st.sampled_from([0.0, 0.1, 0.5, 0.79, 0.8, 0.85, 0.95, 0.999, 1.0]))
_AGE = st.one_of(st.none(), st.floats(0.0, 10.0))
_TOTAL_BLOCKS = st.one_of(st.none(), st.integers(100, 100_000))
_ENGINE_BS = st.sampled_from([None, 16, 32])


@st.composite
def loads(draw: st.DrawFn, absurd: bool) -> LoadView:
    """Scraped loads with unknown gauges; with ``absurd``, sometimes negative, NaN, infinite or huge ones."""

    def gauge(ok: st.SearchStrategy[Any], wrong: st.SearchStrategy[Any]) -> Any:
        if absurd and draw(_UP_TO_9) == 0:
            return draw(wrong)
        return draw(ok)

    return LoadView(
        queued_requests=gauge(_QUEUED, _BAD),
        running_requests=gauge(_RUNNING, _BAD),
        queued_prefill_tokens=gauge(_QUEUED_TOKENS, _BAD),
        inflight_requests=draw(_INFLIGHT),
        inflight_prefill_tokens=gauge(_MAYBE_TOKENS, _BAD) if absurd else draw(_TOKENS),
        kv_usage=gauge(_KV_USAGE, _KV_BAD),
        age_s=draw(_AGE),
        total_kv_blocks=draw(_TOTAL_BLOCKS),
        engine_block_size=draw(_ENGINE_BS),
    )


_UP_TO_2 = st.integers(0, 2)
_BOOLS = st.booleans()
_HIT_AGE = st.sampled_from([0.0, 1.0, 30.0, 400.0])


@st.composite
def hits(draw: st.DrawFn, prompt: int) -> PrefixHit:
    """A match: GPU / CPU / disk / remote blocks, part of it predicted, any age (sometimes past the prompt)."""
    cap = max(0, prompt + 64) // BS
    gpu = BS * draw(st.integers(0, cap))
    if draw(_UP_TO_2) == 0:
        return PrefixHit()
    half = st.integers(0, cap // 2)
    tier = [BS * draw(half) if draw(_BOOLS) else 0 for _ in range(3)]
    total = gpu + sum(tier)
    return PrefixHit(
        gpu=gpu,
        cpu=tier[0],
        disk=tier[1],
        remote=tier[2],
        predicted=draw(st.sampled_from([0, 0, total // 2, total, gpu])),
        age_s=draw(_HIT_AGE),
    )


_RTT_OK = st.sampled_from([0.0, 0.0, 0.0, 0.002, 0.075, 0.16, 0.22, 1.5])
#: a candidate's round trip to the client (``Candidate.rtt_s``), by ``absurd``: mostly one region (0) or a few
#: regions away (a few equal values, so ties stay common); with ``absurd``, sometimes negative, NaN, infinite or huge
_RTTS = {
    False: _RTT_OK,
    True: st.one_of(_RTT_OK, _RTT_OK, _RTT_OK, st.sampled_from([-0.01, math.nan, math.inf, 1e299, 1e308])),
}
_SECS = st.sampled_from([0.0, 0.0006, 0.016, 0.4, 2.0, 30.0])
_ADAPTER_TIER: st.SearchStrategy[Literal["gpu", "cpu", "storage"]] = st.sampled_from(
    ["gpu", "cpu", "storage"]
)
_SLOT_WAIT = st.sampled_from([0.0, 0.0, 0.5, 6.0])
_EVICT = st.sampled_from([0.0, 0.0, 0.0006, 0.05])
_OCCUPY = st.sampled_from([0.0, 0.0, 1.5])
_UP_TO_5 = st.integers(0, 5)
_BAD_SECS = st.sampled_from([-1.0, math.nan, math.inf, 1e308])
_COST_FIELD = st.sampled_from(["load_s", "activate_s", "slot_wait_s", "evict_s", "occupy_s"])


@st.composite
def adapter_costs(draw: st.DrawFn, absurd: bool) -> AdapterCost | None:
    """The request's LoRA adapter on a replica: GPU-resident, CPU-resident, loadable or waiting for a batch slot,
    with an eviction cost; with ``absurd``, sometimes a negative, NaN or infinite term."""
    if draw(_UP_TO_2) == 0:
        return None
    cost = AdapterCost(
        tier=draw(_ADAPTER_TIER),
        load_s=draw(_SECS),
        activate_s=draw(_SECS),
        slot_wait_s=draw(_SLOT_WAIT),
        evict_s=draw(_EVICT),
        occupy_s=draw(_OCCUPY),
    )
    if absurd and draw(_UP_TO_5) == 0:
        bad = draw(_BAD_SECS)
        setattr(cost, draw(_COST_FIELD), bad)
    return cost


_PROFILE_LISTS = st.lists(profiles(), min_size=1, max_size=3)
_LOADS = {False: loads(False), True: loads(True)}
_ADAPTERS = {False: adapter_costs(False), True: adapter_costs(True)}
_UP_TO_3 = st.integers(0, 3)


@st.composite
def fleets(draw: st.DrawFn, absurd: bool = False) -> tuple[RouteRequest, list[Candidate]]:
    """A request and its candidates. Candidates are drawn from a few templates, so exact ties are common; each
    has a round trip to the client (``_RTTS``)."""
    prompt = draw(st.integers(1, 12_000))
    nblocks = prompt // BS
    profs = draw(_PROFILE_LISTS)
    load_s, hit_s = _LOADS[absurd], hits(prompt)
    templates = draw(st.lists(st.tuples(load_s, hit_s), min_size=1, max_size=6))
    n = draw(st.integers(1, 48))
    lora = draw(_BOOLS)  # a LoRA request: candidates carry the adapter's state (some do not know it)
    template_s, profile_s = st.integers(0, len(templates) - 1), st.integers(0, len(profs) - 1)
    rtt_s, adapter_s = _RTTS[absurd], _ADAPTERS[absurd]
    cands = []
    for i in range(n):
        load, hit = templates[draw(template_s)]
        if draw(_UP_TO_3) == 0:  # a fresh one now and then
            load, hit = draw(load_s), draw(hit_s)
        prof = profs[draw(profile_s)]
        cands.append(
            Candidate(
                index=draw(_UP_TO_3) * 64 + i,
                name=f"r{i}",
                load=replace(load),
                hit=replace(hit),
                profile=prof,
                rtt_s=draw(rtt_s),
                adapter=draw(adapter_s) if lora else None,
            )
        )
    first_key = draw(_UP_TO_3) * 10_000  # a few prompts, so some prefixes become popular
    request = RouteRequest(
        model="m",
        prompt_tokens=prompt,
        block_keys=list(range(first_key, first_key + nblocks)),
        block_size=BS,
        now=draw(st.floats(0.0, 1000.0)),
        objective=draw(st.sampled_from(["mean", "tail"])),
        ttft_target_s=draw(st.sampled_from([None, None, 0.05, 0.5, 2.0, 20.0])),
        priority=draw(st.integers(0, 2)),
        lora="adapter-1" if lora else None,
    )
    return request, cands


@st.composite
def policy_params(draw: st.DrawFn) -> dict[str, Any]:
    """``ttft`` parameters: objectives, SLO, work and migration terms (tight and survival variants), hit
    probabilities, KV pressure, calibration, stale-queue draining, how many places are exact."""
    params: dict[str, Any] = {
        "objective": draw(st.sampled_from([None, "mean", "tail"])),
        "slo_ttft_s": draw(st.sampled_from([None, None, 0.2, 1.0, 5.0])),
        "work_weight": draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])),
        "migration_weight": draw(st.sampled_from([0.0, 1.0, 6.0])),
        "migration_cap_s": draw(st.sampled_from([0.0, 0.5, 1.0, 4.0])),
        "p_confirmed": draw(st.sampled_from([0.9, 0.995, 1.0])),
        "confirmed_decay_s": draw(st.sampled_from([0.0, 300.0])),
        "p_predicted": draw(st.sampled_from([0.5, 0.8])),
        "kv_pressure_threshold": draw(st.sampled_from([0.5, 0.8])),
        "kv_pressure_weight_s": draw(st.sampled_from([0.0, 0.05, 1.0])),
        "drain_stale_queue": draw(st.booleans()),
        "calibration_min_samples": 2,
        "popular_min_requests": draw(st.sampled_from([2.0, 3.0, 1000.0])),
        "exact_ranks": draw(st.integers(1, 4)),
        "slo_fast_priority": draw(st.integers(0, 2)),
    }
    if draw(st.booleans()):
        params["tight_migration_weight"] = draw(st.sampled_from([3.0, 1000.0]))
        params["tight_migration_cap_s"] = draw(st.sampled_from([0.5, 1000.0]))
        params["survival_check"] = draw(st.booleans())
        params["lifetime_window_s"] = 30.0
    return params


def _observations(data: st.DataObject, cands: list[Candidate], now: float) -> list[Observation]:
    return [
        Observation(
            index=cands[data.draw(st.integers(0, len(cands) - 1))].index,
            prompt_tokens=data.draw(st.integers(100, 8000)),
            cached_tokens=data.draw(st.integers(0, 4000)),
            queue_wait_s=data.draw(st.floats(0.0, 1.0)),
            ttft_s=data.draw(st.floats(0.05, 5.0)),
            now=now,
        )
        for _ in range(data.draw(st.integers(0, 6)))
    ]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(params=policy_params(), data=st.data())
def test_pruned_decisions_equal_full_scoring_on_random_fleets(
    params: dict[str, Any], data: st.DataObject
) -> None:
    twins = Twins(**params)
    for _ in range(data.draw(st.integers(1, 4))):
        request, cands = data.draw(fleets())
        twins.choose(request, cands)
        for obs in _observations(data, cands, request.now):
            twins.observe(obs)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(params=policy_params(), data=st.data())
def test_pruning_excludes_exactly_the_candidates_full_scoring_excludes(
    params: dict[str, Any], data: st.DataObject
) -> None:
    """Absurd gauges (negative, NaN, infinite, beyond the float range) and profiles without a prefill rate: the
    same candidates are excluded and counted, the same error is raised."""
    twins = Twins(**params)
    request, cands = data.draw(fleets(absurd=True))
    if data.draw(st.integers(0, 9)) == 0:
        victim = cands[data.draw(st.integers(0, len(cands) - 1))]
        victim.profile = replace(
            victim.profile, prefill_tokens_per_s=data.draw(st.sampled_from([0.0, -1.0, math.nan, 1e-12]))
        )
    twins.choose(request, cands)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(params=policy_params(), data=st.data())
def test_every_bound_is_at_most_what_it_bounds(params: dict[str, Any], data: st.DataObject) -> None:
    """Candidate by candidate: the bound (with the migration floor) is at most the full score, ``bound_E`` at most
    E[T] and the tail, and a candidate without a bound is one full scoring may exclude or that the bounds do not
    cover; the pass finds the worst known gauges and the deepest match as full scoring does."""
    request, cands = data.draw(fleets())
    params = {**params, "prune": False}
    full = TTFTPolicy(**params).choose(request, cands)
    deepest = TTFTPolicy(**params)._deepest_to_keep(request, cands)
    policy = TTFTPolicy(**params)
    terms = policy._bound_terms(request, need_e=True)
    if terms is None:
        return
    b = Bounds.sized(len(cands), True, terms.seeds)
    bound_pass(cands, terms, b)
    assert (b.wq, b.wr, b.wk) == worst_known(cands, terms.mean_tokens)
    assert b.gmax == max(c.hit.gpu for c in cands) and b.index == [c.index for c in cands]
    floor = policy._migration_floor(deepest)
    n, rates = request.prompt_tokens, policy._rates
    for pos, score in enumerate(full.scores):
        if pos in b.must:
            continue
        mig = migration_bound(cands[pos], n, rates, deepest, *floor) if floor else 0.0
        assert math.isfinite(score.score) and (b.lb[pos] + mig) * SAFE <= score.score
        assert b.lbe[pos] * SAFE <= score.parts["E"] and b.lbe[pos] * SAFE <= score.parts["tail"]
    bounded = sorted((b.lb[p], p) for p in range(len(cands)) if p not in b.must)
    assert [e for e in b.top if e[1] >= 0] == bounded[: terms.seeds + 1]


def test_a_bound_within_rounding_of_the_threshold_is_never_ruled_out() -> None:
    """A bound is computed in fewer operations than the score it bounds, so it can exceed it by a few ulps
    (``test_every_bound_is_at_most_what_it_bounds`` checks the ``SAFE`` margin covers that): a bound at the
    threshold times (1 + 1e-13) must still be scored, one at (1 + 1e-9) is ruled out."""
    policy = TTFTPolicy(prune=True, exact_ranks=1, migration_weight=0.0, prune_min_candidates=0)
    cands = [Candidate(i, f"r{i}") for i in range(4)]
    req = RouteRequest(model="m", prompt_tokens=100, block_keys=[])
    b = Bounds.sized(4, False, 1)
    acc = _Scored()
    acc.scores[0] = CandidateScore(0, "r0", 0.5, {})
    acc.keys[0] = 0.5
    b.lb[:] = [0.25, 0.5 * (1 + 1e-13), 0.5 * (1 + 1e-9), 0.5]
    b.cut = 0.5  # the smallest bound not scored
    assert policy._unpruned(req, cands, b, acc, None, 0) == [1, 3]


def test_the_lowest_predicted_ttft_is_exact_under_a_target() -> None:
    """With a TTFT target, SLO admission reads the lowest predicted TTFT (E) over the decision's scores: an idle
    replica that holds nothing has the lowest E but, with the work term and the migration penalty, not the lowest
    score (the holder wins); it must still be scored. Targets below every E leave nothing meeting them."""
    prof = ReplicaProfile(prefill_tokens_per_s=8_000.0, fixed_overhead_s=0.01)

    def cand(i: int, queued: int, gpu: int = 0) -> Candidate:
        load = LoadView(queued_requests=0, running_requests=0, queued_prefill_tokens=queued, kv_usage=0.1)
        return Candidate(index=i, name=f"r{i}", load=load, hit=PrefixHit(gpu=gpu, age_s=5.0), profile=prof)

    # the holders (positions 0..5) queue 1.05-1.3 s but reuse 7,680 of 8,000 tokens; the idle one waits for nothing
    cands = [cand(i, 8_400 + 400 * i, gpu=7_680) for i in range(6)] + [cand(6, 0)]
    cands += [cand(i, 40_000 + 1_000 * i) for i in range(7, 40)]
    req = RouteRequest(model="m", prompt_tokens=8_000, block_keys=list(range(500)), ttft_target_s=0.2)
    d = make_policy("ttft").choose(req, cands)
    f = TTFTPolicy().choose(req, cands)
    assert_same_decision(d, f, 3, 0.2)
    best = min(f.scores, key=predicted_ttft_s)
    assert best.index == 6 and f.ranking.index(6) >= 3  # the lowest E is not in the head of the ranking
    assert best_predicted_ttft_s(d.scores, d.ranking) == predicted_ttft_s(best) > 0.2


def test_the_registered_policy_prunes_and_the_model_class_does_not() -> None:
    """``make_policy("ttft")`` (what the router and the simulator build) prunes; ``TTFTPolicy()`` (``pd_ttft``'s
    prefill model, which reads every candidate's terms) scores every candidate unless told otherwise."""
    registered = make_policy("ttft")
    assert isinstance(registered, PrunedTTFTPolicy) and registered.prune
    unpruned = make_policy("ttft", prune=False)
    assert isinstance(unpruned, TTFTPolicy) and unpruned.prune is False
    assert TTFTPolicy().prune is False and TTFTPolicy(prune=True).prune
    with pytest.raises(ValueError):
        TTFTPolicy(exact_ranks=0)


def test_a_pruned_decision_carries_the_contenders_and_the_whole_ranking() -> None:
    """512 candidates, one holding the prompt: the pruned decision scores a handful in full, ranks every
    candidate, and its head (choice and retries) is full scoring's."""
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0, fixed_overhead_s=0.01)
    cands = [
        Candidate(
            index=i,
            name=f"r{i}",
            load=LoadView(
                queued_requests=i % 7, running_requests=8, queued_prefill_tokens=500 * (i % 97), kv_usage=0.3
            ),
            hit=PrefixHit(gpu=4096) if i == 300 else PrefixHit(),
            profile=prof,
        )
        for i in range(512)
    ]
    req = RouteRequest(model="m", prompt_tokens=4500, block_keys=list(range(281)))
    pruned = make_policy("ttft")
    assert isinstance(pruned, TTFTPolicy)  # the registered ttft policy (the pruning counter is its own)
    d = pruned.choose(req, cands)
    f = TTFTPolicy().choose(req, cands)
    assert_same_decision(d, f, 3, None)
    assert len(d.scores) < 20 and sorted(d.ranking) == list(range(512))
    assert pruned.pruned_candidates == 512 - len(d.scores)


def test_worst_known_gauges_match_the_bound_pass() -> None:
    """The stand-ins for unknown gauges are the same whichever pass finds them (one broken value ignored)."""
    cands = [
        Candidate(0, "a", LoadView(queued_prefill_tokens=10**400, running_requests=7, kv_usage=math.nan)),
        Candidate(1, "b", LoadView(queued_requests=3, kv_usage=0.4)),
        Candidate(2, "c", LoadView(running_requests=-2, queued_prefill_tokens=900)),
        Candidate(3, "d", LoadView()),
    ]
    assert worst_known(cands, 100.0) == (900.0, 7.0, 0.4)
    assert worst_known([Candidate(0, "z", LoadView())], 100.0) == (0.0, 0.0, 0.0)


# ------------------------------------------------------------------ the Mooncake trace


@pytest.mark.parametrize(
    ("params", "targets"),
    [
        ({}, False),
        ({"objective": "tail", "slo_ttft_s": 2.0}, True),
        ({"tight_migration_weight": 1000.0, "survival_check": True}, False),
    ],
    ids=["default", "tail-slo-targets", "tight-survival"],
)
def test_pruned_decisions_equal_full_scoring_on_the_mooncake_trace(
    params: dict[str, Any], targets: bool
) -> None:
    """The first 400 requests of the conversation trace at 1.5x its rate on 32 heterogeneous replicas with small
    caches (evictions, scrapes, predicted entries, calibration from observed TTFTs): every decision agrees."""
    reqs = scale_rate(load_mooncake(shared_trace())[:400], 1.5)
    cfg = FleetConfig(profiles=["a100", "h20"] * 16, gpu_blocks=2000, scrape_interval_s=1.0)
    fleet = Fleet(cfg, "ttft", BlockKeyCache(cfg.block_size, root_seed(cfg.model)))
    twins = Twins(**params)
    decide = twins.choose
    if targets:
        count = iter(range(10**9))

        def decide(request: RouteRequest, candidates: list[Candidate]) -> Decision:
            k = next(count)
            target = (None, 0.5, 3.0)[k % 3]
            return twins.choose(replace(request, ttft_target_s=target, priority=k % 2), candidates)

    fleet.policy = _Policy(decide, twins.observe)
    fleet.next_scrape = reqs[0].arrival_s
    for req in reqs:
        fleet.run_until(req.arrival_s)
        fleet.route(req, _Rec(req.arrival_s, req.prompt_tokens, req.output_tokens))
    fleet.drain()
    assert twins.decisions == len(reqs)
    assert twins.pruned.pruned_candidates > 10 * len(reqs)  # the check is not vacuous: most candidates pruned


class _Policy:
    """A ``Policy`` from two callables (the twins' checked ``choose`` and ``observe``)."""

    name = "ttft"

    def __init__(self, choose: Any, observe: Any) -> None:
        self.choose = choose
        self.observe = observe
