"""Learns the fleet's P->D link bandwidth online from observed handoffs (prefill/decode disaggregation).

The router starts from the configured ``HandoffLink`` (``Settings.pd_link_bandwidth_gbps`` /
``pd_link_latency_s``). For each disaggregated request served by the sequential relay (vLLM NIXL: the router
sees the prefill answer, then sends the decode leg), it measures ``handoff_s``: seconds from the prefill answer
to the decode leg's first byte (``kvroute_pd_handoff_seconds``). That span is the KV transfer plus the decode
side's first step, so the observed transfer time is::

    transfer_s = handoff_s - decode_first_s - latency_s          [s]
    sample     = handoff_bytes / transfer_s                       [bytes/s]

with ``decode_first_s`` the plan's predicted ``decode_first`` term (D's wait and first step, seconds),
``latency_s`` the configured fixed cost of a handoff, and ``handoff_bytes`` = the plan's ``handoff_tokens`` x
the prefill replica's ``bytes_per_token``. Samples feed an exponential moving average of bytes per second; the
learned value is used only after ``min_samples`` accepted samples and is clamped to
``[configured / 4, configured * 4]`` so one bad sample (or a slow engine) cannot poison routing. Non-positive or
non-finite inputs (including a transfer time <= 0: the decode side was faster than predicted) are ignored and
counted in ``rejected``.

Engine-reported transfers take precedence. vLLM's NixlConnector exports, on the engine that pulls the blocks,
histograms of each transfer's size and duration (``vllm:nixl_bytes_transferred``, ``vllm:nixl_xfer_time_seconds``);
the router scrapes them anyway. Between two scrapes of one engine the transfers it completed give one sample::

    sample = (delta bytes_sum / delta count) / (delta seconds_sum / delta count - latency_s)     [bytes/s]

(:func:`transfer_sample`): the engine's own clock around the transfer alone, with no decode step to subtract, so
it is unbiased, and it works for every protocol and front door whose engines export it (the router need not see
the legs). Once one engine-reported sample was accepted, the relay's own (biased) samples are no longer fed.

Pure: no I/O, no clock reads. Units: bytes, seconds, bytes per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.pd_base import HandoffLink

#: the learned bandwidth stays within [configured / CLAMP_FACTOR, configured * CLAMP_FACTOR]
CLAMP_FACTOR = 4.0


@dataclass(frozen=True, slots=True)
class LinkLearning:
    """How the link is learned (from ``Settings``; no defaults here).

    Attributes:
        enabled: False: ``link()`` is always the configured link (observations are still counted).
        min_samples: accepted samples before the learned bandwidth is used, count.
        alpha: EMA weight of a new sample, in (0, 1].
    """

    enabled: bool
    min_samples: int
    alpha: float


@dataclass(frozen=True, slots=True)
class TransferTotals:
    """What one engine reported about the KV transfers it completed so far (cumulative).

    Attributes:
        bytes_sum: bytes moved, bytes.
        seconds_sum: transfer durations summed, seconds.
        count: transfers, count.
    """

    bytes_sum: float
    seconds_sum: float
    count: float


def transfer_sample(prev: TransferTotals | None, cur: TransferTotals) -> tuple[float, float] | None:
    """(mean bytes, mean seconds) per transfer of the transfers an engine completed between reports ``prev`` and
    ``cur``; None for the first report, when no transfer completed, or when a total went down (the engine
    restarted: ``cur`` is the new baseline)."""
    if prev is None:
        return None
    n = cur.count - prev.count
    d_bytes, d_s = cur.bytes_sum - prev.bytes_sum, cur.seconds_sum - prev.seconds_sum
    if n <= 0 or d_bytes < 0 or d_s < 0 or not all(math.isfinite(x) for x in (n, d_bytes, d_s)):
        return None
    return d_bytes / n, d_s / n


class LinkEstimator:
    """EMA estimate of the P->D link bandwidth from observed handoffs (see the module docstring).

    Args:
        configured: the configured link (bandwidth bytes/s, latency s): the starting point and the clamp's centre.
        learning: on/off, sample threshold, EMA weight.
    """

    def __init__(self, configured: HandoffLink, learning: LinkLearning) -> None:
        if not configured.bandwidth_bytes_per_s > 0:
            raise ValueError("configured bandwidth must be > 0 bytes/s")
        if not 0 < learning.alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.configured = configured
        self.learning = learning
        self.lo = configured.bandwidth_bytes_per_s / CLAMP_FACTOR
        self.hi = configured.bandwidth_bytes_per_s * CLAMP_FACTOR
        #: EMA of clamped samples, bytes/s (None before the first accepted sample)
        self.ema_bytes_per_s: float | None = None
        #: accepted samples, count
        self.samples = 0
        #: ignored observations (non-positive / non-finite bytes, time or transfer time), count
        self.rejected = 0

    def observe(self, handoff_bytes: float, transfer_s: float) -> bool:
        """Feed one handoff: ``handoff_bytes`` of KV moved in ``transfer_s`` seconds of transfer (the measured
        handoff minus the predicted decode-side time; the configured latency is subtracted here). Returns
        whether the sample was accepted."""
        net_s = transfer_s - self.configured.latency_s
        if not (math.isfinite(handoff_bytes) and math.isfinite(net_s)) or handoff_bytes <= 0 or net_s <= 0:
            self.rejected += 1
            return False
        sample = min(self.hi, max(self.lo, handoff_bytes / net_s))
        a = self.learning.alpha
        self.ema_bytes_per_s = (
            sample if self.ema_bytes_per_s is None else (1 - a) * self.ema_bytes_per_s + a * sample
        )
        self.samples += 1
        return True

    def bandwidth_bytes_per_s(self) -> float:
        """The bandwidth routing uses now, bytes/s: the learned EMA once enabled and ``min_samples`` reached,
        else the configured value."""
        if (
            not self.learning.enabled
            or self.ema_bytes_per_s is None
            or self.samples < self.learning.min_samples
        ):
            return self.configured.bandwidth_bytes_per_s
        return self.ema_bytes_per_s

    def link(self) -> HandoffLink:
        """The link for the next PD decisions (configured latency, current bandwidth)."""
        bw = self.bandwidth_bytes_per_s()
        if bw == self.configured.bandwidth_bytes_per_s:
            return self.configured
        return HandoffLink(bandwidth_bytes_per_s=bw, latency_s=self.configured.latency_s)
