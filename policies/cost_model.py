"""The tiered time-to-first-token model (DESIGN §4; seeds 000 §9.5.4, 002 item 1.3).

For a prompt of ``N`` tokens on replica ``i``::

    Q = (queued uncached prefill tokens, scraped + dispatched by this router since the scrape) / rate
        + decode_interference_s * running requests                                         [s]
    R = sum over usable non-GPU tiers t of  matched_t * bytes_per_token / bandwidth_t + lookup_t   [s]
    C = fixed_overhead + (N - usable)/rate + attention * (new * usable + new * (new + 1) / 2)     [s]
    T = max(Q, R) + C    when the engine fetches while the request is queued, else  Q + R + C
    E[T] = sum over outcomes (all matched blocks present / only the confirmed ones / none) of p * T

A non-GPU tier is *usable* only if fetching is cheaper than recomputing: per token
(``bytes_per_token / bandwidth < 1 / rate``) and in total (``matched * fetch + lookup < matched / rate``).
An unusable tier's tokens are recomputed (break-even rule, 002 item 1.3). A tier without a configured
``TierLink`` is unusable. GPU-tier tokens are always usable (no fetch).

Hit probabilities: blocks confirmed by engine events are present with probability ``p_confirmed`` (~1; optional
exponential decay with age); blocks known only from this router's own routing decisions ("predicted") with
``p_predicted * exp(-age / predicted_decay_s)``. Predicted tokens are the deepest matched tokens and are taken
out of the GPU tier first (routing predictions are GPU entries).

Objectives: ``mean`` scores ``E[T]``; ``tail`` scores the ``tail_quantile`` (default p99) of the outcome
distribution, so a hit that is present with p = 0.9 is scored by its miss path (seeds TV-5). With
``slo_ttft_s`` set, the tail objective prefers candidates whose tail meets the SLO, by lowest ``E[T]``.

KV pressure: ``kv_pressure_weight_s * max(0, k - k0) / max(1e-3, 1 - k)`` seconds added to the score when the
replica's KV usage ``k`` exceeds ``k0`` (preemption risk grows like an M/M/1 barrier as ``k -> 1``).

All functions are pure; units are tokens, seconds, bytes, bytes per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.base import PrefixHit, ReplicaProfile, TierLink

#: Non-GPU tiers in the order the engine would read them (fastest first).
FETCH_TIERS: tuple[str, ...] = ("cpu", "disk", "remote")


@dataclass(slots=True)
class CostParams:
    """Tunables of the TTFT model (defaults are the documented ones).

    Attributes:
        p_confirmed: probability that engine-confirmed blocks are still cached.
        confirmed_decay_s: e-folding age of confirmed entries, seconds (0 = no decay: engines report removals).
        p_predicted: probability that blocks known only from routing predictions are cached, at age 0.
        predicted_decay_s: e-folding age of predicted entries, seconds (the index's predicted TTL is 120 s).
        kv_pressure_threshold: KV usage above which the preemption penalty starts, 0..1.
        kv_pressure_weight_s: scale of the KV-pressure penalty, seconds.
        mean_prefill_tokens: uncached tokens assumed per queued request when only the request count is
            scraped, tokens.
        tail_quantile: quantile scored by the ``tail`` objective (0.99 = p99).
        slo_ttft_s: optional TTFT target for the ``tail`` objective, seconds (None = none).
    """

    p_confirmed: float = 0.995
    confirmed_decay_s: float = 0.0
    p_predicted: float = 0.8
    predicted_decay_s: float = 120.0
    kv_pressure_threshold: float = 0.8
    kv_pressure_weight_s: float = 0.05
    mean_prefill_tokens: int = 1024
    tail_quantile: float = 0.99
    slo_ttft_s: float | None = None


def recompute_s(
    new_tokens: int, context_tokens: int, rate: float, attention_s_per_token2: float = 0.0
) -> float:
    """Seconds to prefill ``new_tokens`` after ``context_tokens`` already in KV (no fixed overhead).

    Linear term ``new / rate`` plus the causal attention term ``a * (new * context + new * (new + 1) / 2)``.
    """
    if new_tokens <= 0:
        return 0.0
    t = new_tokens / rate
    if attention_s_per_token2:
        t += attention_s_per_token2 * (new_tokens * context_tokens + new_tokens * (new_tokens + 1) / 2)
    return t


def fetch_s(tokens: int, link: TierLink, bytes_per_token: float) -> float:
    """Seconds to bring ``tokens`` of KV over ``link``: lookup latency + bytes / bandwidth."""
    if tokens <= 0:
        return 0.0
    return link.lookup_latency_s + tokens * bytes_per_token / link.bandwidth_bytes_per_s


def serial_link(*bandwidths_bytes_per_s: float, lookup_latency_s: float = 0.0) -> TierLink:
    """A ``TierLink`` for a path of store-and-forward stages (e.g. network then PCIe): 1/B = sum 1/B_k."""
    inv = sum(1.0 / b for b in bandwidths_bytes_per_s)
    return TierLink(bandwidth_bytes_per_s=1.0 / inv, lookup_latency_s=lookup_latency_s)


def tier_usable(tokens: int, link: TierLink | None, bytes_per_token: float, rate: float) -> bool:
    """Break-even rule: fetching ``tokens`` over ``link`` must beat recomputing them, per token and in total."""
    if tokens <= 0 or link is None or link.bandwidth_bytes_per_s <= 0:
        return False
    per_token = bytes_per_token / link.bandwidth_bytes_per_s
    if per_token >= 1.0 / rate:
        return False
    return tokens * per_token + link.lookup_latency_s < tokens / rate


def combine(q: float, r: float, c: float, overlap: bool) -> float:
    """``T = max(Q, R) + C`` when the fetch overlaps queueing, else ``Q + R + C`` (seconds)."""
    return (q if q > r else r) + c if overlap else q + r + c


def ttft_given(
    prompt_tokens: int,
    gpu: int,
    cpu: int,
    disk: int,
    remote: int,
    queue_s: float,
    profile: ReplicaProfile,
    rate: float,
    overhead_s: float,
) -> tuple[float, float, float, int]:
    """TTFT if exactly these matched tokens per tier are present.

    Returns:
        ``(T, R, C, usable_tokens)`` in seconds, seconds, seconds, tokens.
    """
    usable = gpu
    r = 0.0
    if cpu or disk or remote:
        tiers = profile.tiers
        bpt = profile.bytes_per_token
        for name, tokens in (("cpu", cpu), ("disk", disk), ("remote", remote)):
            if tokens:
                link = tiers.get(name)
                if link is not None and tier_usable(tokens, link, bpt, rate):
                    r += fetch_s(tokens, link, bpt)
                    usable += tokens
    if usable > prompt_tokens:
        usable = prompt_tokens
    c = overhead_s + recompute_s(prompt_tokens - usable, usable, rate, profile.attention_s_per_token2)
    return combine(queue_s, r, c, profile.fetch_overlaps_queue), r, c, usable


def queue_s(backlog_tokens: float, running_requests: float, profile: ReplicaProfile, rate: float) -> float:
    """Q: seconds until the replica can start this prefill (backlog / rate + decode interference)."""
    return backlog_tokens / rate + profile.decode_interference_s * running_requests


def kv_penalty_s(kv_usage: float, params: CostParams) -> float:
    """Preemption-risk penalty in seconds for KV usage ``kv_usage`` (0..1)."""
    k0 = params.kv_pressure_threshold
    if kv_usage <= k0:
        return 0.0
    return params.kv_pressure_weight_s * (kv_usage - k0) / max(1e-3, 1.0 - kv_usage)


def hit_probabilities(hit: PrefixHit, params: CostParams) -> tuple[float, float]:
    """``(p_confirmed_part, p_predicted_part)`` for a match, from freshness and confirmation."""
    age = hit.age_s if hit.age_s > 0 else 0.0
    pc = params.p_confirmed
    if params.confirmed_decay_s > 0:
        pc *= math.exp(-age / params.confirmed_decay_s)
    pp = params.p_predicted
    if params.predicted_decay_s > 0:
        pp *= math.exp(-age / params.predicted_decay_s)
    return pc, pp


def split_confirmed(hit: PrefixHit) -> tuple[int, int, int, int]:
    """Per-tier matched tokens that are engine-confirmed: predicted tokens removed from gpu, remote, disk, cpu."""
    pred = hit.predicted
    gpu, cpu, disk, remote = hit.gpu, hit.cpu, hit.disk, hit.remote
    for_take = min(pred, gpu)
    gpu -= for_take
    pred -= for_take
    for_take = min(pred, remote)
    remote -= for_take
    pred -= for_take
    for_take = min(pred, disk)
    disk -= for_take
    pred -= for_take
    cpu -= min(pred, cpu)
    return gpu, cpu, disk, remote


def quantile(outcomes: list[tuple[float, float]], q: float) -> float:
    """The ``q``-quantile of a discrete distribution given as ``(probability, value)`` pairs."""
    acc = 0.0
    ordered = sorted(outcomes, key=lambda o: o[1])
    for p, v in ordered:
        acc += p
        if acc >= q - 1e-12:
            return v
    return ordered[-1][1]


@dataclass(slots=True)
class Estimate:
    """One candidate's TTFT estimate (seconds unless noted).

    Attributes:
        q, r, c: queue wait, state-ready time and remaining compute on the hit path.
        t_hit: TTFT if every matched block is present; ``t_miss``: if none is.
        p: probability that every matched block is present.
        expected: E[T] over the outcomes; ``tail``: the ``tail_quantile`` of the outcomes.
        kv_penalty: KV-pressure penalty added to ``expected`` and ``tail``.
        usable_tokens: matched tokens actually reused on the hit path (tokens).
    """

    q: float
    r: float
    c: float
    t_hit: float
    t_miss: float
    p: float
    expected: float
    tail: float
    kv_penalty: float
    usable_tokens: int


def estimate(
    prompt_tokens: int,
    hit: PrefixHit,
    q: float,
    profile: ReplicaProfile,
    rate: float,
    overhead_s: float,
    params: CostParams,
    kv_usage: float = 0.0,
) -> Estimate:
    """Full estimate for one candidate given its queue wait ``q`` (seconds) and matched tokens ``hit``."""
    n = prompt_tokens
    pen = kv_penalty_s(kv_usage, params)
    total = hit.gpu + hit.cpu + hit.disk + hit.remote
    t_hit, r, c, usable = ttft_given(n, hit.gpu, hit.cpu, hit.disk, hit.remote, q, profile, rate, overhead_s)
    if total == 0 or usable == 0:
        return Estimate(q, r, c, t_hit, t_hit, 1.0, t_hit + pen, t_hit + pen, pen, usable)
    t_miss = ttft_given(n, 0, 0, 0, 0, q, profile, rate, overhead_s)[0]
    pc, pp = hit_probabilities(hit, params)
    pred = hit.predicted
    if pred <= 0:
        outcomes = [(pc, t_hit), (1.0 - pc, t_miss)]
        p = pc
    elif pred >= total:
        outcomes = [(pp, t_hit), (1.0 - pp, t_miss)]
        p = pp
    else:
        g, cp, d, rm = split_confirmed(hit)
        t_conf = ttft_given(n, g, cp, d, rm, q, profile, rate, overhead_s)[0]
        p = pc * pp
        outcomes = [(p, t_hit), (pc - p, t_conf), (1.0 - pc, t_miss)]
    expected = 0.0
    for prob, t in outcomes:
        expected += prob * t
    tail = quantile(outcomes, params.tail_quantile)
    return Estimate(q, r, c, t_hit, t_miss, p, expected + pen, tail + pen, pen, usable)
