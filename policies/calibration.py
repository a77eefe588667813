"""Online, per-replica calibration of prefill rate and fixed overhead from observed TTFTs.

Each observation gives ``x`` = uncached prompt tokens and ``y`` = prefill seconds (TTFT minus queue wait, minus
the profile's quadratic attention term when one is configured). The model is ``y = overhead + x / rate``.

Per replica, the last ``window`` samples are kept; every ``refit_every`` new samples the line is re-fitted with
Theil–Sen (median of pairwise slopes over pairs whose ``x`` differ enough; breakdown point ~29 %, so a minority
of outliers — a mis-estimated queue wait, a preempted request — cannot drag it), then residuals beyond
``outlier_mads`` median absolute deviations are dropped and the fit is repeated once. When the ``x`` values are
too alike to give a slope, the rate falls back to the median of ``x / (y - overhead)`` with the current overhead.
Replicas are fitted independently, so replicas that differ 2x in speed are learned separately. The calibrated
values are used once ``min_samples`` samples exist, and are clamped to ``[rate_floor, rate_ceiling]`` tokens/s.

Pure (no clock); cost: O(window^2) per refit, amortised over ``refit_every`` observations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from statistics import median

import numpy as np
import numpy.typing as npt


@dataclass(slots=True)
class ReplicaFit:
    """Calibration state of one replica.

    Attributes:
        samples: recent ``(uncached tokens, prefill seconds)`` pairs.
        since_fit: samples added since the last refit.
        rate: fitted prefill rate, tokens per second (None until fitted).
        overhead_s: fitted fixed overhead, seconds (None until fitted).
    """

    samples: deque[tuple[float, float]]
    since_fit: int = 0
    rate: float | None = None
    overhead_s: float | None = None


def _pairs(n: int) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """The index pairs ``i < j`` of ``n`` points (cached: a calibrator's windows have a few sizes)."""
    got = _PAIRS.get(n)
    if got is None:
        if len(_PAIRS) >= 256:
            _PAIRS.clear()
        got = _PAIRS[n] = np.triu_indices(n, 1)
    return got


_PAIRS: dict[int, tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]] = {}


def _median(values: npt.NDArray[np.float64]) -> float:
    """``statistics.median`` of a non-empty array, to the bit (the mean of the two middle values as
    ``(lo + hi) / 2``)."""
    n = len(values)
    half = n // 2
    if n % 2:
        return float(np.partition(values, half)[half])
    part = np.partition(values, (half - 1, half))
    return (float(part[half - 1]) + float(part[half])) / 2


def theil_sen(points: list[tuple[float, float]], min_dx: float) -> tuple[float, float] | None:
    """Theil–Sen line ``y = a + b x`` over pairs whose x differ by more than ``min_dx``; None if too few pairs.

    Vectorised (a window of 64 points has 2,016 pairs): the same float operations per slope as
    ``(yj - yi) / (xj - xi)`` in Python, and the medians as ``statistics.median`` takes them, so the same line to
    the bit (``tests/unit/test_policies_calibration.py`` compares it with the textbook loop)."""
    n = len(points)
    if n < 2:
        return None
    pts = np.fromiter(chain.from_iterable(points), np.float64, 2 * n).reshape(n, 2)
    xs, ys = pts[:, 0], pts[:, 1]
    i, j = _pairs(n)
    dx = xs[j] - xs[i]
    keep = np.abs(dx) > min_dx
    # a pair's slope is the same either way round: (yi - yj) / (xi - xj) negates both exactly
    slopes = (ys[j] - ys[i])[keep] / dx[keep]
    if len(slopes) < max(3, n // 2):
        return None
    b = _median(slopes)
    return _median(ys - b * xs), b


@dataclass(slots=True)
class PrefillCalibrator:
    """Robust per-replica fit of ``prefill_s = overhead + uncached_tokens / rate``.

    Attributes:
        window: samples kept per replica.
        min_samples: samples needed before the calibrated values are reported.
        refit_every: refit after this many new samples.
        outlier_mads: residuals beyond this many (scaled) MADs are dropped before the second fit.
        min_x_spread: pairs need ``|dx| > min_x_spread * median(x)`` to contribute a slope.
        rate_floor, rate_ceiling: clamp for the fitted rate, tokens per second.
        rejected: observations refused as malformed (negative or non-finite values).
    """

    window: int = 64
    min_samples: int = 16
    refit_every: int = 8
    outlier_mads: float = 3.0
    min_x_spread: float = 0.05
    rate_floor: float = 10.0
    rate_ceiling: float = 1e8
    rejected: int = 0
    _fits: dict[int, ReplicaFit] = field(default_factory=dict)

    def add(self, index: int, uncached_tokens: float, prefill_s: float) -> None:
        """Record one sample for replica ``index`` (tokens, seconds); malformed samples are counted and dropped."""
        if not (uncached_tokens >= 0 and prefill_s > 0) or prefill_s == float("inf"):
            self.rejected += 1
            return
        fit = self._fits.get(index)
        if fit is None:
            fit = ReplicaFit(samples=deque(maxlen=self.window))
            self._fits[index] = fit
        fit.samples.append((float(uncached_tokens), float(prefill_s)))
        fit.since_fit += 1
        if len(fit.samples) >= self.min_samples and (fit.rate is None or fit.since_fit >= self.refit_every):
            self._refit(fit)

    def _refit(self, fit: ReplicaFit) -> None:
        """Fit the replica's line (two passes, outliers dropped in between)."""
        fit.since_fit = 0
        pts = list(fit.samples)
        xs = [x for x, _ in pts]
        min_dx = self.min_x_spread * max(1.0, median(xs))
        line = theil_sen(pts, min_dx)
        if line is not None:
            a, b = line
            res = [y - a - b * x for x, y in pts]
            mad = median([abs(r) for r in res]) * 1.4826
            if mad > 0:
                kept = [p for p, r in zip(pts, res, strict=True) if abs(r) <= self.outlier_mads * mad]
                if len(kept) >= self.min_samples // 2:
                    line2 = theil_sen(kept, min_dx)
                    if line2 is not None:
                        a, b = line2
            if b > 0:
                fit.rate = min(self.rate_ceiling, max(self.rate_floor, 1.0 / b))
                fit.overhead_s = max(0.0, a)
                return
        # x values too alike (or a non-positive slope): median of ratios with the current overhead
        ov = fit.overhead_s or 0.0
        ratios = [x / (y - ov) for x, y in pts if x > 0 and y > ov]
        if ratios:
            fit.rate = min(self.rate_ceiling, max(self.rate_floor, median(ratios)))
            fit.overhead_s = ov

    def rate(self, index: int) -> float | None:
        """Calibrated prefill rate of replica ``index`` in tokens/s, or None while not enough samples."""
        fit = self._fits.get(index)
        if fit is None or len(fit.samples) < self.min_samples:
            return None
        return fit.rate

    def overhead_s(self, index: int) -> float | None:
        """Calibrated fixed overhead of replica ``index`` in seconds, or None while not enough samples."""
        fit = self._fits.get(index)
        if fit is None or len(fit.samples) < self.min_samples:
            return None
        return fit.overhead_s

    def forget(self, index: int) -> None:
        """Drop everything learned about replica ``index`` (it left the fleet or restarted)."""
        self._fits.pop(index, None)

    def snapshot(self) -> dict[int, tuple[float | None, float | None, int]]:
        """Per replica: ``(rate tokens/s, overhead s, samples)`` for logs and ``/debug`` endpoints."""
        return {i: (f.rate, f.overhead_s, len(f.samples)) for i, f in self._fits.items()}
