"""The PD policies' load reading (``policies.pd_common.read_loads``): a broken gauge counts as unknown, filled
with the worst valid known value, never read as an idle replica nor spread to the replicas whose gauges are
unknown."""

from __future__ import annotations

import math
from typing import Any

import pytest

import policies  # noqa: F401  (registers the policies)
from policies.base import Candidate, LoadView, ReplicaProfile, RouteRequest
from policies.pd_base import HandoffLink, PdCandidate, Role, make_pd_policy
from policies.pd_common import gauge, read_loads

PROFILE = ReplicaProfile(prefill_tokens_per_s=10_000.0, decode_step_s=0.02, decode_interference_s=0.001)
DECODE = ReplicaProfile(
    prefill_tokens_per_s=10_000.0,
    decode_step_s=0.02,
    decode_step_s_per_request=5e-4,
    decode_interference_s=0.001,
)
BROKEN = (math.nan, math.inf, -1.0, 10**400)


def pd(i: int, load: LoadView) -> PdCandidate:
    return PdCandidate(Candidate(i, f"r{i}", load=load, profile=PROFILE), role="both")


@pytest.mark.parametrize("bad", BROKEN)
def test_a_broken_gauge_is_unknown(bad: float) -> None:
    assert gauge(bad) is None
    assert gauge(None) is None and gauge(0) == 0.0 and gauge(7) == 7.0 and gauge(0.5) == 0.5


@pytest.mark.parametrize("bad", BROKEN)
def test_a_broken_backlog_is_filled_with_the_worst_valid_one(bad: float) -> None:
    fleet = [
        pd(0, LoadView(queued_prefill_tokens=bad, running_requests=bad, queued_requests=bad, kv_usage=bad)),  # type: ignore[arg-type]
        pd(1, LoadView(queued_prefill_tokens=5_000, running_requests=4, queued_requests=1, kv_usage=0.2)),
        pd(2, LoadView(queued_prefill_tokens=20_000, running_requests=9, queued_requests=3, kv_usage=0.7)),
        pd(3, LoadView()),  # nothing scraped yet: the worst valid values too
    ]
    loads = read_loads(fleet, mean_prefill_tokens=1_000)
    assert loads.backlog_tokens == [20_000.0, 5_000.0, 20_000.0, 20_000.0]
    assert loads.running == [9.0, 4.0, 9.0, 9.0]
    assert loads.requests == [3.0, 1.0, 3.0, 3.0]
    assert loads.kv_usage == [0.7, 0.2, 0.7, 0.7]


def test_a_broken_backlog_falls_back_to_the_queued_requests() -> None:
    fleet = [pd(0, LoadView(queued_prefill_tokens=math.nan, queued_requests=2)), pd(1, LoadView())]  # type: ignore[arg-type]
    assert read_loads(fleet, mean_prefill_tokens=1_000).backlog_tokens == [2_000.0, 2_000.0]


@pytest.mark.parametrize("bad", (math.nan, math.inf, -40.0))
def test_pd_ttft_prices_a_broken_running_gauge_as_the_worst_known(bad: float) -> None:
    """A decode replica whose running-requests gauge is broken is priced as busy as the busiest known one (60
    running), and the plans stay sorted by predicted TTFT. Before: NaN gave a NaN plan that broke the ranking's
    order, infinity an infinite one, and -40 made the replica look less busy than one with 10 running."""
    # Any: the broken gauge is a float where LoadView declares an int (what a bad scrape hands the policy)
    rows: tuple[tuple[int, Role, Any], ...] = (
        (0, "prefill", 0),
        (1, "decode", bad),
        (2, "decode", 10),
        (3, "decode", 60),
    )
    fleet = [
        PdCandidate(
            Candidate(i, f"r{i}", load=LoadView(0, running, 0, kv_usage=0.1), profile=DECODE), role=role
        )
        for i, role, running in rows
    ]
    req = RouteRequest(model="m", prompt_tokens=4_000, block_keys=[], block_size=16)
    plans = make_pd_policy("pd_ttft").choose_plan(req, fleet, HandoffLink(25e9)).plans
    ttfts = [p.predicted_ttft_s for p in plans]
    assert all(math.isfinite(t) for t in ttfts) and ttfts == sorted(ttfts), plans
    by_pair = {(p.prefill, p.decode): p.predicted_ttft_s for p in plans if p.kind == "disaggregated"}
    assert by_pair[(0, 1)] == by_pair[(0, 3)] > by_pair[(0, 2)], by_pair
