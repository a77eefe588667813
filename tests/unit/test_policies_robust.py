"""Candidate scoring never fails a decision (issue 24, item 8): a replica whose load or profile makes its score
impossible (overflow, negative, NaN) is excluded from the ranking and counted; the others are ranked as usual."""

from __future__ import annotations

import math
from typing import Any

import pytest

from policies.base import Candidate, LoadView, Observation, PrefixHit, RouteRequest
from policies.ttft import TTFTPolicy


def _cands(bad: LoadView) -> list[Candidate]:
    good = [
        Candidate(index=i, name=f"r{i}", load=LoadView(queued_requests=i, running_requests=1, kv_usage=0.1))
        for i in (0, 1)
    ]
    return [Candidate(index=7, name="bad", load=bad, hit=PrefixHit(gpu=512)), *good]


REQ = RouteRequest(model="m", prompt_tokens=1024, block_keys=list(range(64)), block_size=16)

#: full scoring, and pruning with one exact place (so three candidates are already pruned)
PRUNE = pytest.mark.parametrize("prune", [False, True], ids=["full", "pruned"])

#: an infinite gauge, where LoadView declares an int (Any: what a broken scrape hands the policy)
INF: Any = math.inf


def _policy(prune: bool) -> TTFTPolicy:
    return TTFTPolicy(prune=prune, exact_ranks=1, prune_min_candidates=0)


@pytest.mark.parametrize(
    "bad",
    [
        LoadView(queued_requests=int(1e308), running_requests=0, kv_usage=0.0),  # OverflowError on main
        LoadView(queued_requests=10**400, running_requests=0, kv_usage=0.0),
        LoadView(queued_requests=-1000, running_requests=0, kv_usage=0.0),  # won every decision on main
        LoadView(queued_prefill_tokens=-(10**6), running_requests=0, kv_usage=0.0),
        LoadView(queued_requests=0, running_requests=-5, kv_usage=0.0),
        LoadView(queued_requests=0, running_requests=0, kv_usage=math.nan),
        LoadView(queued_prefill_tokens=INF, running_requests=0, kv_usage=0.0),
    ],
)
@PRUNE
def test_a_candidate_with_absurd_load_is_excluded_not_chosen(bad: LoadView, prune: bool) -> None:
    policy = _policy(prune)
    d = policy.choose(REQ, _cands(bad))
    assert d.chosen != 7 and 7 not in d.ranking and sorted(d.ranking) == [0, 1]
    assert policy.excluded_candidates == 1 and "bad" in policy.last_exclusion
    (s,) = [s for s in d.scores if s.index == 7]
    assert s.parts["excluded"] == 1.0 and s.score == math.inf
    assert all(math.isfinite(s.score) and s.score >= 0 for s in d.scores if s.index != 7)


@PRUNE
def test_an_infinite_gauge_behind_a_tier_hit_is_excluded_not_chosen(prune: bool) -> None:
    """Infinite running requests with no decode interference make the queue wait NaN (inf x 0); a candidate whose
    match is in a lower tier combines it as ``max(Q, R)``, which dropped the NaN: the replica scored as idle and won
    (found by the pruning property test)."""
    bad = LoadView(queued_requests=INF, running_requests=INF, kv_usage=0.0)
    cands = _cands(bad)
    cands[0] = Candidate(index=7, name="bad", load=bad, hit=PrefixHit(disk=512))
    assert cands[0].profile.decode_interference_s == 0.0
    policy = _policy(prune)
    d = policy.choose(REQ, cands)
    assert d.chosen != 7 and 7 not in d.ranking and sorted(d.ranking) == [0, 1]
    assert policy.excluded_candidates == 1 and "queue wait" in policy.last_exclusion


@PRUNE
def test_unknown_loads_do_not_inherit_an_absurd_worst_value(prune: bool) -> None:
    """A replica with unknown gauges is scored with the worst *sane* value of the others, so one broken
    replica does not take the blind ones out with it."""
    policy = _policy(prune)
    cands = [
        Candidate(index=0, name="bad", load=LoadView(queued_requests=10**400)),
        Candidate(index=1, name="blind", load=LoadView()),
        Candidate(index=2, name="known", load=LoadView(queued_requests=2, running_requests=1, kv_usage=0.2)),
    ]
    d = policy.choose(REQ, cands)
    assert d.ranking and 0 not in d.ranking and set(d.ranking) == {1, 2}
    assert policy.excluded_candidates == 1


@PRUNE
def test_when_nothing_can_be_scored_the_least_loaded_is_chosen(prune: bool) -> None:
    policy = _policy(prune)
    cands = [
        Candidate(index=i, name=f"r{i}", load=LoadView(queued_requests=-1, inflight_requests=5 - i))
        for i in range(3)
    ]
    d = policy.choose(REQ, cands)
    assert d.chosen == 2 and d.branch == "unscorable" and d.ranking == [2, 1, 0]
    assert policy.excluded_candidates == 3


def test_cache_lifetime_counts_capacity_in_the_engines_own_blocks() -> None:
    """``total_kv_blocks`` are engine blocks: a 128-token-block engine holds 8x the tokens a 16-token guess says."""
    policy = TTFTPolicy(tight_migration_weight=1000.0, calibrate=False, lifetime_window_s=60.0)
    for t in range(301):
        policy.observe(
            Observation(
                index=0, prompt_tokens=1000, cached_tokens=0, queue_wait_s=0.0, ttft_s=0.1, now=float(t)
            )
        )
    req = RouteRequest(model="m", prompt_tokens=16, block_keys=[1], block_size=16, now=300.0)
    same = policy.cache_lifetime_s(Candidate(0, "r0", LoadView(total_kv_blocks=5000)), req)
    big = policy.cache_lifetime_s(
        Candidate(0, "r0", LoadView(total_kv_blocks=5000, engine_block_size=128)), req
    )
    assert same is not None and big is not None and big == pytest.approx(8 * same)
