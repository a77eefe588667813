"""The seeds' PD throughput bound and pool sizing (000 §9.2, §9.7; seeds digest TV-14, TV-15)."""

from __future__ import annotations

import pytest

from sim.pd_simulator import best_pd_split, pd_capacity_rps, pd_replica_profile
from sim.simulator import fleet_capacity_rps
from sim.traces import Request

GIB_8192 = 8192 * 147_456  # the KV of one 8192-token Qwen3-8B prompt: 1.125 GiB


def design(output_tokens: int, n: int = 4) -> list[Request]:
    """The chapter-9 design condition: 8192-token prompts, ``output_tokens`` out (Qwen3-8B)."""
    return [Request(f"r{i}", float(i), 8192, output_tokens, ((i, 8192),)) for i in range(n)]


def test_tv15_mu_pd_for_4_a100_prefill_and_4_h20_decode() -> None:
    mu = pd_capacity_rps(design(1025), ["a100"] * 4, ["h20"] * 4, 25e9)
    assert mu["mu_p"] == pytest.approx(4 / 0.856, abs=0.02)  # 4.67
    assert mu["mu_d"] == pytest.approx(4 / 0.878, abs=0.02)  # 4.55
    assert mu["mu_pd"] == pytest.approx(4.55, abs=0.02)
    assert fleet_capacity_rps(design(1025), ["a100"] * 4 + ["h20"] * 4) == pytest.approx(3.02, abs=0.02)


def test_tv15_drain_times_follow_from_mu() -> None:
    """Backlog of 35 (3.5 req/s for 10 s) drains at 10 + 35 / (mu - 3.5): ~43rd s for direct PD, never co-located."""
    mu_pd = pd_capacity_rps(design(1025), ["a100"] * 4, ["h20"] * 4, 25e9)["mu_pd"]
    assert 10 + 3.5 * 10 / (mu_pd - 3.5) == pytest.approx(43.3, abs=0.8)
    assert fleet_capacity_rps(design(1025), ["a100"] * 4 + ["h20"] * 4) < 3.5  # mu_co 3.02: never drains


def test_tv14_link_binds_only_below_mu_times_kv_size() -> None:
    """B_net >= mu x V_KV ~ 5.5 GB/s for GQA: four 1.25 GB/s links (5 GB/s) bind, four 25 GB/s links do not."""
    assert 4.55 * GIB_8192 / 1e9 == pytest.approx(5.5, abs=0.05)
    slow = pd_capacity_rps(design(1025), ["a100"] * 4, ["h20"] * 4, 1.25e9)
    assert slow["mu_link"] == pytest.approx(5e9 / GIB_8192, rel=1e-9) and slow["mu_pd"] == slow["mu_link"]
    assert 8 * GIB_8192 / 1e9 == pytest.approx(9.7, abs=0.05)  # 8 handoffs/s need 9.7 GB/s


def test_tv14_short_outputs_split_4_a100_and_3_h20_on_prefill() -> None:
    """129-token outputs: best split 4 A100 + 3 H20 prefill, 1 H20 decode, ~6.33 req/s; co-location 5.84."""
    split, mu = best_pd_split(design(129), {"a100": 4, "h20": 4})
    assert split == {"a100": 4, "h20": 3}
    assert mu["mu_pd"] == pytest.approx(6.33, abs=0.03)
    assert fleet_capacity_rps(design(129), ["a100"] * 4 + ["h20"] * 4) == pytest.approx(5.84, abs=0.06)


def test_tv14_prefix_hit_of_6144_splits_2_a100_on_prefill() -> None:
    """6144 of 8192 cached on P: an A100 prefills in 0.238 s (4.20 req/s per card); best split 2 A100 prefill
    (8.41) + 2 A100 and 4 H20 decode (2/1.764 + 4/0.878 = 5.69 req/s)."""
    one = pd_capacity_rps(design(1025), ["a100"], ["h20"], None, cached_tokens=6144)
    assert one["mu_p"] == pytest.approx(4.20, abs=0.03)
    split, mu = best_pd_split(design(1025), {"a100": 4, "h20": 4}, cached_tokens=6144)
    assert split == {"a100": 2, "h20": 0}
    assert mu["mu_p"] == pytest.approx(8.41, abs=0.05)
    assert mu["mu_pd"] == pytest.approx(5.69, abs=0.03)


def test_decode_step_terms_of_the_engine_profiles() -> None:
    """The routing profile's first-decode-step terms reproduce the engine model's decode round: A100 55.1 ms and
    H20 27.4 ms at batch 32 x 8.7 k context (seeds 000 §9.2.3)."""
    for name, step_32 in (("a100", 0.0551), ("h20", 0.0274)):
        prof = pd_replica_profile(name)
        assert prof.decode_step_s + 32 * prof.decode_step_s_per_request == pytest.approx(step_32, abs=0.001)
        assert 0 < prof.decode_step_s < step_32
