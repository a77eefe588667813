"""policies.pd_link.LinkEstimator: the P->D link bandwidth learned online (issue 19)."""

from __future__ import annotations

import math

import pytest

from policies.pd_base import HandoffLink
from policies.pd_link import LinkEstimator, LinkLearning, TransferTotals, transfer_sample

GIB = 1024**3


def _est(
    gbps: float = 25.0,
    *,
    enabled: bool = True,
    min_samples: int = 1,
    alpha: float = 0.5,
    latency_s: float = 0.0,
) -> LinkEstimator:
    return LinkEstimator(HandoffLink(gbps * 1e9, latency_s), LinkLearning(enabled, min_samples, alpha))


def test_tv14_sample_is_25_gbps() -> None:
    """TV-14: 1.125 GiB in 48.3 ms -> 25 GB/s (1.2079e9 bytes / 0.0483 s = 25.01e9 bytes/s)."""
    est = _est(10.0)
    assert est.observe(1.125 * GIB, 0.0483)
    assert est.bandwidth_bytes_per_s() == pytest.approx(25.0e9, rel=1e-3)
    assert est.link().bandwidth_bytes_per_s == pytest.approx(25.0e9, rel=1e-3)


def test_configured_link_until_min_samples() -> None:
    est = _est(25.0, min_samples=3)
    assert est.link() == est.configured
    for i in range(2):
        est.observe(1e9, 0.1)  # 10 GB/s
        assert est.bandwidth_bytes_per_s() == 25e9, i
    est.observe(1e9, 0.1)
    assert est.bandwidth_bytes_per_s() == pytest.approx(10e9)


def test_ema_moves_towards_new_samples() -> None:
    est = _est(25.0, alpha=0.5)
    est.observe(1e9, 0.1)  # 10 GB/s: first sample seeds the EMA
    est.observe(2e9, 0.1)  # 20 GB/s -> 0.5 * 10 + 0.5 * 20 = 15 GB/s
    assert est.bandwidth_bytes_per_s() == pytest.approx(15e9)


def test_clamped_to_quarter_and_four_times_configured() -> None:
    slow = _est(25.0)
    slow.observe(1e6, 1.0)  # 1 MB/s -> clamped to 6.25 GB/s
    assert slow.bandwidth_bytes_per_s() == pytest.approx(6.25e9)
    fast = _est(25.0)
    fast.observe(1e12, 1.0)  # 1 TB/s -> clamped to 100 GB/s
    assert fast.bandwidth_bytes_per_s() == pytest.approx(100e9)


def test_latency_is_subtracted_before_the_rate() -> None:
    est = _est(25.0, latency_s=0.01)
    est.observe(1e9, 0.11)  # 1 GB in 0.1 s net -> 10 GB/s
    assert est.bandwidth_bytes_per_s() == pytest.approx(10e9)
    assert est.link().latency_s == 0.01


@pytest.mark.parametrize(
    ("nbytes", "seconds"),
    [(0.0, 0.1), (-1.0, 0.1), (1e9, 0.0), (1e9, -0.5), (math.nan, 0.1), (1e9, math.inf), (math.inf, 0.1)],
)
def test_bad_samples_are_ignored_and_counted(nbytes: float, seconds: float) -> None:
    est = _est(25.0)
    assert not est.observe(nbytes, seconds)
    assert est.rejected == 1 and est.samples == 0
    assert est.bandwidth_bytes_per_s() == 25e9


def test_disabled_keeps_configured_link() -> None:
    est = _est(25.0, enabled=False)
    est.observe(5e8, 0.1)
    assert est.samples == 1
    assert est.link() == est.configured


def test_invalid_learning_rejected() -> None:
    with pytest.raises(ValueError):
        _est(25.0, alpha=0.0)


def test_router_uses_the_estimators_link_after_observations() -> None:
    """Router.observe_handoff feeds the estimator and the next decisions read ``Router.pd_link`` from it."""
    from index.prefix_index import PrefixIndex
    from membership.replicas import ReplicaTable
    from policies.base import make_policy
    from router.core.routing import Router
    from tests.helpers import FakeClock

    router = Router(
        ReplicaTable(),
        PrefixIndex(block_size=16, clock=FakeClock()),
        make_policy("round_robin"),
        block_size=16,
    )
    assert not router.observe_handoff(1e9, 0.1)  # no estimator: fixed link
    assert router.pd_link.bandwidth_bytes_per_s == 25e9
    router.pd_link_estimator = _est(25.0, min_samples=2)
    assert router.observe_handoff(1e9, 0.1)
    assert router.pd_link.bandwidth_bytes_per_s == 25e9  # one sample: still configured
    assert not router.observe_handoff(1e9, -1.0)  # rejected, counted
    assert router.observe_handoff(1e9, 0.1)
    assert router.pd_link.bandwidth_bytes_per_s == pytest.approx(10e9)
    assert router.pd_link_estimator.rejected == 1


def test_transfer_sample_is_the_mean_transfer_between_reports() -> None:
    before = TransferTotals(bytes_sum=1e9, seconds_sum=0.04, count=1)
    after = TransferTotals(bytes_sum=1e9 + 2 * 1.2079e9, seconds_sum=0.04 + 2 * 0.0483, count=3)
    size, took = transfer_sample(before, after)  # type: ignore[misc]
    assert size == pytest.approx(1.2079e9) and took == pytest.approx(0.0483)  # TV-14: 1.125 GiB in 48.3 ms


@pytest.mark.parametrize(
    "prev, cur",
    [
        (None, TransferTotals(5.0, 1.0, 1)),  # first report: only a baseline
        (TransferTotals(5.0, 1.0, 1), TransferTotals(5.0, 1.0, 1)),  # nothing new
        (TransferTotals(9e9, 3.0, 7), TransferTotals(1e9, 0.1, 1)),  # totals went down: engine restarted
        (TransferTotals(5.0, 1.0, 1), TransferTotals(float("nan"), 2.0, 2)),
    ],
)
def test_no_transfer_sample(prev: TransferTotals | None, cur: TransferTotals) -> None:
    assert transfer_sample(prev, cur) is None
