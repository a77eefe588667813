"""Lower bounds of the ``ttft`` score, so a decision scores in full only the candidates that can win.

For a prompt of ``N`` tokens and a candidate whose matched tokens (every tier) are ``M``, with the candidate's
queue wait ``Q``, KV-pressure penalty ``pen``, prefill rate and fixed overhead exactly as ``ttft`` scores them
(``policies.ttft``, the same code on the same inputs)::

    u        = min(N, M)                                    the most tokens any outcome reuses
    comp     = (N - u) / rate + a * (N - u) * (N + u + 1) / 2     the least compute of any outcome, s
    bound_E  = Q + pen + overhead + comp + rtt + A          <= E[T] and <= the tail quantile, s
    bound    = bound_E + work_weight * (comp + A_imp) + mig <= the score (E + W, or tail + W), s
    mig      = min(w_lo * (deepest - u) / rate, cap_lo)     when deepest > u, else 0
    A, A_imp = the LoRA adapter's delay and imposed seconds (``policies.adapters``), 0 without an adapter

Why each is a lower bound (``a`` = attention seconds per token pair >= 0):

* Every outcome (hit, confirmed-only, miss) reuses ``v <= u`` tokens and computes ``overhead + (N - v) / rate +
  a * (N - v) * (N + v + 1) / 2``, which decreases in ``v``; its time is ``max(Q, R) + C >= Q + C`` (the fetch
  overlaps the queue; a candidate with non-GPU matches on a profile that fetches after queueing gets no bound).
  ``E[T]`` is a mean of outcomes and the tail quantile is one of them; both add ``pen`` and the candidate's round
  trip ``rtt`` (``Candidate.rtt_s``, the same in every outcome).
* The adapter term is the same in every outcome: its delay ``A`` is added to each outcome's time, and ``work_weight
  * A_imp`` to ``W``, exactly as full scoring adds them (a term that is negative or not finite: no bound).
* ``W`` is ``work_weight`` times the expected compute without the overhead (``>= comp``), plus the migration
  penalty: charged when the deepest GPU match exceeds what the candidate reuses, ``min(weight x lost seconds,
  cap)`` with weight and cap between their loose and tight values (``w_lo``, ``cap_lo``: the smaller of each),
  and lost seconds at least ``(deepest - u) / rate``. With the survival check the penalty may be dropped for all,
  so ``mig = 0``.
* Rounding: every term is non-negative (a candidate with a negative overhead gets no bound), so the float score
  and the float bound differ from the real ones by a few ulps of themselves; a bound is compared as ``bound x
  SAFE`` (``1 - 1e-12``), far below the score whatever the order of operations.

A candidate gets no bound (it is always scored in full, so its exclusion or error is exactly full scoring's) when a
load gauge or its round trip is not a finite non-negative number, its rate is below ``MIN_RATE`` or not a number, its overhead is
negative, its attention coefficient is outside ``(0, 1]`` s/token², a matched-token count is negative or above
``MAX_TOKENS``, a match's age is above ``BIG``, the arithmetic fails, or the bound reaches ``BIG`` seconds. Below
those limits the full score is finite whenever the bound is (no overflow), so a pruned candidate is never one that
full scoring would have excluded.

The same pass finds the worst known gauges (``worst_known``: the stand-ins for unknown ones) and keeps the few
smallest bounds (the first candidates to score). Pure: no I/O, no clock.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass, field

from policies.adapters import adapter_delay_s, adapter_imposed_s
from policies.base import Candidate

_INF = float("inf")
_NEG = float("-inf")
#: bounds are scaled by this (1 - 1e-12) so float rounding never lifts a bound above the score it bounds
SAFE = 1.0 - 1e-12
#: lowest prefill rate (tokens/s) a bound is computed for; slower ones are scored in full (no overflow below it)
MIN_RATE = 1e-9
#: seconds (and match ages) from which a candidate is scored in full: far below the float range, so nothing the
#: full score adds to a bound under this can overflow
BIG = 1e300
#: most matched tokens a bound is computed for (a count beyond it is scored in full)
MAX_TOKENS = 10**15
#: largest ``work_weight`` for which decisions are pruned (a larger one could overflow the score)
MAX_WORK_WEIGHT = 1e6


@dataclass(slots=True)
class BoundTerms:
    """The per-decision constants of the bound pass (units as in the module docstring).

    Attributes:
        n: prompt tokens.
        mean_tokens: uncached tokens per queued request when only the request count is scraped, tokens.
        k0, kw: KV-pressure threshold (0..1) and weight (s).
        ww: ``work_weight`` (0 ... ``MAX_WORK_WEIGHT``).
        drain: subtract what the replica prefilled since the scrape from the scraped backlog.
        rates, overheads: calibrated prefill rate (tokens/s) and overhead (s) per replica index.
        attention: per replica index, the attention coefficient seen (recorded as full scoring records it).
        need_e: also keep ``bound_E`` per candidate (decisions with a TTFT target or an SLO under ``tail``).
        seeds: how many of the smallest bounds to keep (the first candidates scored in full).
    """

    n: int
    mean_tokens: float
    k0: float
    kw: float
    ww: float
    drain: bool
    rates: dict[int, float]
    overheads: dict[int, float]
    attention: dict[int, float]
    need_e: bool
    seeds: int


@dataclass(slots=True)
class Bounds:
    """The bound pass's results, per candidate position (lists of the decision's length).

    Bounds are kept unscaled: a candidate is ruled out by a threshold ``v`` when ``bound * SAFE > v``, i.e. when
    ``bound > v / SAFE`` (one division per decision instead of a product per candidate).

    Attributes:
        lb: lower bound of each candidate's score without the migration penalty, s (``-inf``: no bound, always
            scored); ``migration_bound`` gives the penalty's bound once the deepest match is known.
        lbe: lower bound of each candidate's expected TTFT and tail, s (only with ``need_e``).
        index: each candidate's replica index.
        must: positions with no bound (scored in full whatever the others score).
        top: ``(bound, position)`` of the ``seeds + 1`` smallest finite bounds, ascending; ``(inf, -1)``
            fills the places of a decision with fewer bounded candidates.
        cut: the largest bound in ``top`` (every candidate not among the first ``seeds`` has a bound of at least
            this; infinite when fewer than ``seeds + 1`` candidates have a bound).
        wq, wr, wk: the worst known backlog (tokens), running requests and KV usage (``worst_known``).
        gmax, gpos: the deepest GPU match (tokens) and the first position holding it.
    """

    lb: list[float]
    lbe: list[float]
    index: list[int]
    must: list[int] = field(default_factory=list)
    top: list[tuple[float, int]] = field(default_factory=list)
    cut: float = _INF
    wq: float = 0.0
    wr: float = 0.0
    wk: float = 0.0
    gmax: int = 0
    gpos: int = 0

    @classmethod
    def sized(cls, n: int, need_e: bool, seeds: int) -> Bounds:
        """Empty results for ``n`` candidates, keeping the ``seeds + 1`` smallest bounds."""
        return cls(
            lb=[0.0] * n,
            lbe=[_NEG] * n if need_e else [],
            index=[0] * n,
            top=[(_INF, -1)] * (seeds + 1),
        )


def as_float(value: float) -> float:
    """``value`` as a float; an integer too large for a float is infinity (never an ``OverflowError``)."""
    try:
        return float(value)
    except OverflowError:
        return _INF


def _larger(value: float, current: float) -> float:
    """``value`` as a float if it is finite (it compared above ``current``), else ``current``."""
    f = as_float(value)
    return f if f < _INF else current


def worst_known(candidates: Sequence[Candidate], mean_tokens: float) -> tuple[float, float, float]:
    """Largest known (backlog tokens, running requests, KV usage) among ``candidates``; 0 when none is known.

    Backlog: ``queued_prefill_tokens``, else ``queued_requests * mean_tokens``. Values that are not finite and
    non-negative are ignored (a broken gauge is no stand-in for the others; that candidate is excluded).
    """
    wq = wr = wk = 0.0
    for c in candidates:
        load = c.load
        qt = load.queued_prefill_tokens
        running = load.running_requests
        kv = load.kv_usage
        if running is not None and running > wr:
            wr = _larger(running, wr)
        if kv is not None and kv > wk:
            wk = _larger(kv, wk)
        if qt is not None:
            if qt > wq:
                wq = _larger(qt, wq)
        elif load.queued_requests is not None:
            b = as_float(load.queued_requests) * mean_tokens
            if wq < b < _INF:
                wq = b
    return wq, wr, wk


def migration_bound(
    cand: Candidate, n: int, rates: dict[int, float], deepest: int, weight: float, cap: float
) -> float:
    """Lower bound of the candidate's migration penalty, seconds (unscaled, as ``Bounds.lb``):
    ``min(weight * (deepest - u) / rate, cap)`` when ``deepest > u`` (``u``: its matched tokens of every tier, at
    most the prompt's ``n``), else 0. ``weight``, ``cap`` > 0: the least any tightness gives. Only for candidates
    the pass bounded (valid counts and rate)."""
    hit = cand.hit
    u = hit.gpu + hit.cpu + hit.disk + hit.remote
    if u > n:
        u = n
    if deepest <= u:
        return 0.0
    prof = cand.profile
    rate = rates.get(cand.index, prof.prefill_tokens_per_s) if rates else prof.prefill_tokens_per_s
    m = weight * (deepest - u) / rate
    return m if m < cap else cap


def bound_pass(candidates: Sequence[Candidate], t: BoundTerms, out: Bounds) -> None:
    """Bound every candidate into ``out`` (``Bounds.sized(len(candidates), t.need_e, t.seeds)``), in one pass.

    The bound is ``(backlog + in-flight + (1 + work_weight) * (N - u)) / rate + overhead + decode interference
    + round trip + KV penalty + (1 + work_weight) * attention term``: the module docstring's ``bound`` without the migration
    penalty, in few operations. An unknown gauge is filled as full scoring fills it, with the worst known value
    *so far* (at most the decision's worst known, which full scoring uses): the score grows with each of them
    (backlog, running requests with a non-negative decode interference, KV usage), so the bound stays a lower
    bound. The pass also finds the worst known gauges, the deepest GPU match and the replica indices, so each
    candidate is read once.

    Long because: it is the hot loop of a pruned decision (every request, every candidate), kept whole on locals
    with same-type comparisons (an int against a float costs twice an int against an int): a call per candidate
    costs as much as the bound itself (measured: ``python -m loadtest.bench_policies``).
    """
    n = t.n
    mean_tokens = t.mean_tokens
    k0, kw, ww = t.k0, t.kw, t.ww
    drain = t.drain
    rates, overheads, attention = t.rates, t.overheads, t.attention
    lb_out, index_out = out.lb, out.index
    lbe_out = out.lbe if t.need_e else None
    must = out.must.append
    top = out.top
    cut = top[-1][0]
    wq: float = 0  # the worst known gauges so far, as the gauges' own values (same-type comparisons)
    wr: float = 0
    wk = 0.0
    gmax, gpos = candidates[0].hit.gpu, 0
    inf, neg, big, min_rate, max_tokens = _INF, _NEG, BIG, MIN_RATE, MAX_TOKENS
    c1 = 1.0 + ww
    c1n = c1 * n
    for pos, cand in enumerate(candidates):
        load = cand.load
        hit = cand.hit
        idx = cand.index
        index_out[pos] = idx
        g = hit.gpu
        if g > gmax:
            gmax = g
            gpos = pos
        qt: float | None = load.queued_prefill_tokens
        running: float | None = load.running_requests
        kv: float | None = load.kv_usage
        prof = cand.profile
        try:
            dis = prof.decode_interference_s
            if running is None:
                running = wr if wr > load.inflight_requests else load.inflight_requests
                if not dis >= 0.0:  # the fill is a lower bound only if running requests add time
                    must(pos)
                    lb_out[pos] = neg
                    continue
            elif running > wr and as_float(running) < inf:
                wr = running
            if kv is None:
                kv = wk
            elif kv > wk and as_float(kv) < inf:
                wk = kv
            if qt is None:
                qr = load.queued_requests
                if qr is None:
                    qt = wq
                else:
                    qt = qr * mean_tokens
                    if wq < qt:  # a new largest backlog: as ``worst_known`` computes it
                        b = as_float(qr) * mean_tokens
                        if wq < b < inf:
                            wq = b
            elif qt > wq and as_float(qt) < inf:
                wq = qt
            inflight = load.inflight_prefill_tokens
            if rates:
                rate = rates.get(idx, prof.prefill_tokens_per_s)
                ov = overheads.get(idx, prof.fixed_overhead_s)
            else:
                rate = prof.prefill_tokens_per_s
                ov = prof.fixed_overhead_s
            if not (qt >= 0 and running >= 0 and kv >= 0.0 and inflight >= 0 and rate >= min_rate):
                must(pos)  # full scoring excludes it (or, for a rate <= 0, raises)
                lb_out[pos] = neg
                continue
            att = prof.attention_s_per_token2
            if drain and load.age_s:
                qt = max(0.0, qt - rate * load.age_s)
            if hit.cpu or hit.disk or hit.remote:
                cp, dk, rm = hit.cpu, hit.disk, hit.remote
                if not prof.fetch_overlaps_queue or g < 0 or cp < 0 or dk < 0 or rm < 0:
                    must(pos)
                    lb_out[pos] = neg
                    continue
                g += cp + dk + rm
            if g:
                if not 0 < g <= max_tokens or hit.age_s > big:
                    must(pos)
                    lb_out[pos] = neg
                    continue
                if g > n:
                    g = n
                x = (qt + inflight + c1 * (n - g)) / rate + ov
            else:
                x = (qt + inflight + c1n) / rate + ov
            if running:
                x += dis * running
            rtt = cand.rtt_s
            # the round trip is in every outcome (full scoring excludes what is not a finite rtt >= 0)
            if rtt:
                if not 0.0 <= rtt < big:
                    must(pos)
                    lb_out[pos] = neg
                    continue
                x += rtt
            if kv > k0:
                x += kw * (kv - k0) / (1.0 - kv if kv < 0.999 else 1e-3)
            if att:
                attention[idx] = att
                if not 0.0 < att <= 1.0:
                    must(pos)
                    lb_out[pos] = neg
                    continue
                x += c1 * att * ((n - g) * (n + g + 1) / 2)
            a_s = 0.0
            ad = cand.adapter
            if ad is not None:  # exact, as full scoring adds it (raises for a bad term: no bound)
                a_s = adapter_delay_s(ad)
                x += a_s + ww * adapter_imposed_s(ad)
            if not (ov >= 0.0 and x < big):
                must(pos)
                lb_out[pos] = neg
                continue
            lb_out[pos] = x
            if lbe_out is not None:
                lbe_out[pos] = (
                    _bound_e(qt, inflight, running, kv, n, g, rate, ov, dis, att, k0, kw) + rtt + a_s
                )
            if x < cut:
                insort(top, (x, pos))
                top.pop()
                cut = top[-1][0]
        except (ArithmeticError, ValueError, TypeError):
            must(pos)
            lb_out[pos] = neg
    out.cut = cut
    out.wq, out.wr, out.wk = float(wq), float(wr), float(wk)
    out.gmax, out.gpos = gmax, gpos


def _bound_e(
    qt: float,
    inflight: float,
    running: float,
    kv: float,
    n: int,
    u: int,
    rate: float,
    ov: float,
    dis: float,
    att: float,
    k0: float,
    kw: float,
) -> float:
    """``bound_E`` of one candidate (unscaled, seconds): queue, overhead, KV penalty and the least compute,
    from the values the pass validated (``u``: reused tokens at most)."""
    e = (qt + inflight + (n - u)) / rate + ov + dis * running
    if kv > k0:
        e += kw * (kv - k0) / (1.0 - kv if kv < 0.999 else 1e-3)
    if att:
        e += att * ((n - u) * (n + u + 1) / 2)
    return e
