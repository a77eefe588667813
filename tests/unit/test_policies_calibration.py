"""policies/calibration.py: the Theil-Sen fit and the per-replica calibrator."""

from __future__ import annotations

import random
from statistics import median

from policies.calibration import PrefillCalibrator, theil_sen


def _naive(points: list[tuple[float, float]], min_dx: float) -> tuple[float, float] | None:
    """The textbook definition: the median slope over every pair i < j whose x differ by more than min_dx."""
    slopes = [
        (points[j][1] - points[i][1]) / (points[j][0] - points[i][0])
        for i in range(len(points))
        for j in range(i + 1, len(points))
        if abs(points[j][0] - points[i][0]) > min_dx
    ]
    if len(slopes) < max(3, len(points) // 2):
        return None
    b = median(slopes)
    return median([y - b * x for x, y in points]), b


def test_theil_sen_is_the_median_of_pairwise_slopes() -> None:
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randrange(0, 70)  # up to past the default window (64)
        pts = [(float(rng.choice([rng.randrange(0, 4000), 512])), rng.uniform(0.01, 3.0)) for _ in range(n)]
        min_dx = rng.choice([0.0, 10.0, 300.0])
        assert theil_sen(pts, min_dx) == _naive(pts, min_dx)


def test_theil_sen_ignores_a_minority_of_outliers() -> None:
    # y = 0.05 + x / 10000 (rate 10k tokens/s, 50 ms overhead), 20 % of the samples 10x too slow
    pts = [(float(x), 0.05 + x / 10000.0) for x in range(100, 4100, 100)]
    for i in range(0, len(pts), 5):
        pts[i] = (pts[i][0], pts[i][1] * 10)
    line = theil_sen(pts, 1.0)
    assert line is not None
    a, b = line
    assert abs(b - 1e-4) < 1e-5 and abs(a - 0.05) < 0.02


def test_calibrator_learns_rate_and_overhead_per_replica() -> None:
    cal = PrefillCalibrator()
    for k in range(64):
        x = 200.0 + 97.0 * k
        cal.add(0, x, 0.02 + x / 8000.0)
        cal.add(1, x, 0.02 + x / 16000.0)  # twice as fast
    r0, r1 = cal.rate(0), cal.rate(1)
    assert r0 is not None and r1 is not None
    assert abs(r0 - 8000.0) < 1.0 and abs(r1 - 16000.0) < 1.0
    assert abs((cal.overhead_s(0) or 0.0) - 0.02) < 1e-6
    cal.add(0, -1.0, 0.5)  # malformed: counted and dropped
    assert cal.rejected == 1
