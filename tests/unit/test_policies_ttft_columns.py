"""``ttft``'s bound pass over columns (``policies.ttft_columns``) against the pass over objects and full scoring.

Over the random fleets of the pruning tests (unknown and absurd gauges, tiers, round trips, adapters, profiles
with attention, calibration): the column pass finds the same worst known gauges and deepest match, leaves unbounded
every candidate the pass over objects leaves unbounded, bounds every other one at least as tightly (exactly as
tightly where no gauge was filled), and every bound stays at most the candidate's full score.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.base import Candidate, Decision, LoadView, PrefixHit, ReplicaProfile, RouteRequest
from policies.ttft import TTFTPolicy
from policies.ttft_bounds import SAFE, Bounds, bound_pass, migration_bound, worst_known
from policies.ttft_columns import BoundColumns, ColumnBounds, ColumnCandidates, column_bounds
from tests.unit.test_policies_ttft_pruning import (
    Twins,
    _observations,
    assert_same_decision,
    fleets,
    policy_params,
    state,
)

#: 300 random fleets per property (slow draws allowed)
RANDOM_FLEETS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


def _filled(c: Candidate) -> bool:
    """Whether the bound of ``c`` uses a stand-in for an unknown gauge."""
    load = c.load
    return load.queued_prefill_tokens is None or load.running_requests is None or load.kv_usage is None


@RANDOM_FLEETS
@given(params=policy_params(), absurd=st.booleans(), data=st.data())
def test_column_bounds_are_the_object_bounds_or_tighter_and_never_above_the_score(
    params: dict[str, Any], absurd: bool, data: st.DataObject
) -> None:
    request, cands = data.draw(fleets(absurd=absurd))
    policy = TTFTPolicy(**{**params, "prune": False})
    for obs in _observations(data, cands, request.now):  # calibrated rates and overheads for some
        policy.observe(obs)
    terms = policy._bound_terms(request, need_e=True)
    if terms is None:
        return
    b = Bounds.sized(len(cands), True, terms.seeds)
    bound_pass(cands, terms, b)
    cols = BoundColumns.of(cands, policy._rates, policy._overheads)
    cb = column_bounds(cols, terms)

    assert (cb.wq, cb.wr, cb.wk) == worst_known(cands, terms.mean_tokens)
    assert (cb.gmax, cb.gpos) == (b.gmax, b.gpos)
    assert cols.index.tolist() == b.index
    assert set(b.must) <= set(cb.must)
    bounded = [p for p in range(len(cands)) if p not in cb.must]
    for p in bounded:
        assert cb.lb[p] >= b.lb[p], (p, cb.lb[p], b.lb[p])
        assert cb.lbe[p] >= b.lbe[p], (p, cb.lbe[p], b.lbe[p])
        if not _filled(cands[p]):
            assert (cb.lb[p], cb.lbe[p]) == (b.lb[p], b.lbe[p])
    assert all(cb.lb[p] == -math.inf for p in cb.must)
    expect = sorted((float(cb.lb[p]), p) for p in bounded)[: terms.seeds + 1]
    assert cb.top == expect + [(math.inf, -1)] * (terms.seeds + 1 - len(expect))
    assert cb.cut == cb.top[-1][0]

    try:
        full = policy.choose(request, cands)
    except ValueError:  # a profile without a prefill rate: such a candidate is never bounded
        assert all(p in cb.must for p, c in enumerate(cands) if not c.profile.prefill_tokens_per_s > 0)
        return
    deepest = TTFTPolicy(**params)._deepest_to_keep(request, cands)
    floor = policy._migration_floor(deepest)
    for p in bounded:
        score = full.scores[p]
        mig = (
            migration_bound(cands[p], request.prompt_tokens, policy._rates, deepest, *floor) if floor else 0.0
        )
        assert math.isfinite(score.score) and (cb.lb[p] + mig) * SAFE <= score.score
        assert cb.lbe[p] * SAFE <= score.parts["E"] and cb.lbe[p] * SAFE <= score.parts["tail"]


def _plain(i: int, queued: int | None, running: int | None = 3, kv: float | None = 0.5) -> Candidate:
    return Candidate(
        index=i,
        name=f"r{i}",
        load=LoadView(
            queued_prefill_tokens=queued, running_requests=running, kv_usage=kv, queued_requests=None
        ),
        hit=PrefixHit(),
        profile=ReplicaProfile(prefill_tokens_per_s=10_000.0, fixed_overhead_s=0.01),
    )


def _both_passes(policy: TTFTPolicy, cands: list[Candidate]) -> tuple[RouteRequest, Bounds, ColumnBounds]:
    """A 1,000-token request's bounds over ``cands``: the pass over objects and the column pass."""
    request = RouteRequest(model="m", prompt_tokens=1_000, block_keys=[], block_size=16, now=0.0)
    terms = policy._bound_terms(request, need_e=False)
    assert terms is not None
    b = Bounds.sized(len(cands), False, terms.seeds)
    bound_pass(cands, terms, b)
    return request, b, column_bounds(BoundColumns.of(cands), terms)


def test_an_unknown_gauge_gets_the_decisions_worst_known_where_the_object_pass_has_only_seen_part() -> None:
    """The blind replica comes first: the pass over objects has seen no backlog yet and fills 0; the columns
    fill the decision's worst known (9,000 tokens), as full scoring does, so its bound is 0.9 s tighter."""
    cands = [_plain(0, None), _plain(1, 100), _plain(2, 9_000)]
    policy = TTFTPolicy(prune=False, work_weight=0.0)
    request, b, cb = _both_passes(policy, cands)
    assert cb.wq == 9_000.0
    assert cb.lb[0] - b.lb[0] == 9_000 / 10_000.0
    assert cb.lb[0] == cb.lb[2] and cb.lb[1:].tolist() == b.lb[1:]
    full = policy.choose(request, cands)
    assert cb.lb[0] * SAFE <= full.scores[0].score


def test_ties_at_the_last_seed_keep_the_first_positions() -> None:
    """Many equal bounds: the kept smallest are the first positions, as the object pass's sorted insert keeps."""
    _, b, cb = _both_passes(TTFTPolicy(prune=False), [_plain(i, 500) for i in range(40)])
    assert cb.top == b.top and [p for _, p in cb.top] == list(range(len(cb.top)))


# ------------------------------------------------------------------ decisions on columns


def as_columns(cands: list[Candidate]) -> tuple[ColumnCandidates, list[int]]:
    """``cands`` as column candidates whose ``Candidate``s are the same objects, and the positions built."""
    built: list[int] = []

    def build(p: int) -> Candidate:
        built.append(p)
        return cands[p]

    holders = {p: c for p, c in enumerate(cands) if c.hit.gpu or c.hit.cpu or c.hit.disk or c.hit.remote}
    return ColumnCandidates(BoundColumns.of(cands), holders, build), built


class ColumnTwins(Twins):
    """A column-pruned and a full-scoring ``ttft`` policy fed the same decisions and observations."""

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        try:
            full = self.full.choose(request, candidates)
        except ValueError as exc:
            with pytest.raises(type(exc), match="prefill_tokens_per_s"):
                self.pruned.choose(request, as_columns(candidates)[0])
            return Decision(chosen=candidates[0].index, ranking=[], scores=[], policy="ttft")
        cc, built = as_columns(candidates)
        pruned = self.pruned.choose(request, cc)
        assert_same_decision(pruned, full, self.pruned.exact_ranks, request.ttft_target_s)
        assert state(self.pruned) == state(self.full)
        self.decisions += 1
        self.built = len(set(built))
        return pruned


@RANDOM_FLEETS
@given(params=policy_params(), absurd=st.booleans(), data=st.data())
def test_decisions_on_columns_equal_full_scoring_on_random_fleets(
    params: dict[str, Any], absurd: bool, data: st.DataObject
) -> None:
    twins = ColumnTwins(**params)
    for _ in range(data.draw(st.integers(1, 4))):
        request, cands = data.draw(fleets(absurd=absurd))
        twins.choose(request, cands)
        for obs in _observations(data, cands, request.now):
            twins.observe(obs)


def test_a_decision_on_columns_builds_only_the_candidates_it_scores() -> None:
    """4,096 replicas, none holding the prompt but one: a handful of ``Candidate``s are built, the rest stay
    columns; the decision is full scoring's."""
    from loadtest.bench_policies import build_scenarios

    request, cands = build_scenarios(4096, 1, 7)[0]
    twins = ColumnTwins()
    twins.choose(request, cands)
    holders = sum(1 for c in cands if c.hit.gpu or c.hit.cpu or c.hit.disk or c.hit.remote)
    assert twins.built - holders < 40, (twins.built, holders)
