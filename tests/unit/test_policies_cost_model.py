"""Pure functions of ``policies.cost_model`` (units: tokens, seconds, bytes, bytes/s)."""

from __future__ import annotations

import pytest

from policies.base import PrefixHit, ReplicaProfile, TierLink
from policies.cost_model import (
    CostParams,
    estimate,
    fetch_s,
    kv_penalty_s,
    quantile,
    serial_link,
    split_confirmed,
    tier_usable,
)


def test_tv3_tier_fetch_times_of_an_8k_qwen3_prefix() -> None:
    bpt = 147_456.0
    host = TierLink(25e9)  # PCIe 4.0 x16
    assert fetch_s(8192, host, bpt) * 1e3 == pytest.approx(48.318, abs=1e-3)
    pool = serial_link(25e9, 25e9)  # NIC then PCIe, store and forward
    assert fetch_s(8192, pool, bpt) * 1e3 == pytest.approx(96.64, abs=0.01)
    ssd = TierLink(7.1e9)
    assert fetch_s(8192, ssd, bpt) * 1e3 == pytest.approx(170.1, abs=0.1)


def test_break_even_rule_per_token_and_in_total() -> None:
    rate = 10_000.0  # 100 µs per token
    assert tier_usable(100, TierLink(1000.0 / 50e-6), 1000.0, rate)  # 50 µs/token fetch
    assert not tier_usable(100, TierLink(1000.0 / 100e-6), 1000.0, rate)  # equal: no saving
    assert not tier_usable(100, TierLink(1000.0 / 150e-6), 1000.0, rate)  # slower than recompute
    # cheap per token, but a 20 ms lookup for 100 tokens (10 ms of recompute) does not pay
    assert not tier_usable(100, TierLink(1000.0 / 1e-6, lookup_latency_s=0.020), 1000.0, rate)
    assert tier_usable(1000, TierLink(1000.0 / 1e-6, lookup_latency_s=0.020), 1000.0, rate)
    assert not tier_usable(100, None, 1000.0, rate)


def test_quantile_and_confirmed_split() -> None:
    outcomes = [(0.9, 0.1), (0.1, 1.0)]
    assert quantile(outcomes, 0.5) == 0.1
    assert quantile(outcomes, 0.9) == 0.1
    assert quantile(outcomes, 0.99) == 1.0
    assert split_confirmed(PrefixHit(gpu=320, cpu=160, predicted=400)) == (0, 80, 0, 0)
    assert split_confirmed(PrefixHit(gpu=320, remote=64, predicted=100)) == (220, 0, 0, 64)


def test_kv_penalty_grows_towards_full() -> None:
    p = CostParams()
    values = [kv_penalty_s(k, p) for k in (0.5, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)]
    assert values[:2] == [0.0, 0.0]
    assert all(a < b for a, b in zip(values[1:], values[2:], strict=False))
    assert values[-1] > 5.0


def test_estimate_three_outcomes_for_a_partly_predicted_match() -> None:
    prof = ReplicaProfile(prefill_tokens_per_s=10_000.0)
    hit = PrefixHit(gpu=1000, predicted=500)
    params = CostParams(p_confirmed=0.9, p_predicted=0.5, predicted_decay_s=0.0)
    est = estimate(2000, hit, 0.1, prof, 10_000.0, 0.0, params)
    t_all, t_conf, t_none = 0.1 + 0.1, 0.1 + 0.15, 0.1 + 0.2
    assert est.t_hit == pytest.approx(t_all) and est.t_miss == pytest.approx(t_none)
    assert est.p == pytest.approx(0.45)
    assert est.expected == pytest.approx(0.45 * t_all + 0.45 * t_conf + 0.1 * t_none)
    assert est.tail == pytest.approx(t_none)  # p99: the 10 % "nothing left" outcome
