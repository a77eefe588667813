"""``ttft`` (the default policy): pick the replica with the lowest estimated time to first token.

Per candidate it evaluates the tiered model of ``policies.cost_model`` (``Q``, ``R``, ``C``, ``T``, hit
probability ``p``, ``E[T]``, tail, KV-pressure penalty) and picks the minimum of ``E[T]`` (objective ``mean``)
or of the tail quantile (objective ``tail``), plus ``W``: the work term ``work_weight * the request's own expected
prefill seconds`` (the delay it imposes on requests queued behind it) and the migration penalty
``migration_weight * (deepest GPU match - the tokens this candidate can reuse) / rate`` (the recompute a move
throws away; later turns of the conversation follow the new copy), at most ``migration_cap_s`` seconds, and not
charged when the deepest match is a popular prefix (matched by many requests right now: replicate it instead of
pinning it). ``work_weight=0, migration_weight=0`` scores this request's TTFT alone, as the seed examples do. The
objective comes from the request unless the policy was built with a fixed one.

Load inputs and what happens when they are unknown (``None``):

* backlog tokens = scraped ``queued_prefill_tokens`` + ``inflight_prefill_tokens`` (work this router dispatched
  since the scrape; the router adds a request's uncached tokens right after deciding, which is what spreads a
  burst sharing one system prompt over the fleet instead of piling it on the replica holding the prompt).
  If only ``queued_requests`` is scraped, it is multiplied by the mean uncached tokens per request (learned from
  ``observe`` as an exponential moving average once ``calibration_min_samples`` observations arrived, else
  ``mean_prefill_tokens``). If neither is known, the largest backlog any candidate reports is assumed (never
  zero: a blind replica must not look idle); when no candidate reports one, every candidate gets 0 and the
  in-flight counters decide.
* running requests (decode interference) unknown -> the largest known, or this router's in-flight requests.
* KV usage unknown -> the largest known, else 0.
* optionally (``drain_stale_queue``) the scraped backlog is reduced by ``rate * age_s`` (what the replica has
  prefilled since the scrape).

Prefill rate and fixed overhead come from the candidate's profile until online calibration (``observe``) has
``calibration_min_samples`` samples for that replica; then the calibrated values are used.

A candidate whose inputs make its score impossible (a load value that is negative, NaN or so large the
arithmetic overflows; a score that is not a finite non-negative number of seconds) is excluded: it gets score
``inf`` and ``parts["excluded"] = 1``, is left out of the ranking and counted in ``excluded_candidates``; the
decision is made among the others (when none is left, by fewest in-flight requests, branch ``unscorable``). One
replica's broken metrics never fail a request. A profile without a positive prefill rate is a configuration
error and raises.

LoRA adapters (``Candidate.adapter``, ``policies.adapters``): the request's own wait for its adapter ``A`` (a
batch slot held by other adapters, then the load from storage or the activation from the CPU cache; 0 when it is in
a GPU slot) is part of every outcome's TTFT (``T``, ``T_miss``, ``E``, ``tail``), and what it imposes on others
(the batch waits for the fetch; the adapter it evicts reloads) joins ``W`` with ``work_weight``.

Ties are broken by candidate order (deterministic). The decision's parts per candidate: ``Q``, ``R``, ``C``,
``p``, ``T`` (hit path), ``T_miss``, ``E``, ``tail``, ``kv_penalty``, ``W``, ``RTT`` (seconds / probability), ``A``
(seconds, only for adapter requests), ``matched_gpu/cpu/disk/remote`` and ``usable`` (tokens). The score is ``E +
W`` (mean) or ``tail + W`` (tail).
``calibrated(index)`` gives the rate in use.

Distance: ``RTT`` is the candidate's ``rtt_s``, the network round trip between the client's region and the
replica's (``policies.regions`` sets it from the latency matrix; 0 within one region). It is part of the TTFT the
client sees, so it is added to ``E`` and to the tail (and with them to the score, the SLO checks and the lowest
predicted TTFT), never to ``T`` / ``T_miss`` (the engine's side) or to ``W`` (the work term prices the engine's
compute). A candidate whose ``rtt_s`` is not a finite non-negative number of seconds is excluded. The match a
candidate carries is its own cache's, so a replica in another region than a cached copy gets no reuse from it.

Pruning (``prune``; on for the registered ``ttft`` policy, off for ``TTFTPolicy`` itself; decisions with at least
``prune_min_candidates`` candidates, default 32). Scoring a candidate in
full costs ~1.5 µs (its parts, the hit paths, a ``CandidateScore``); a lower bound of its score costs a few
hundred ns (``policies.ttft_bounds``: queue, overhead, KV penalty and the least compute any outcome needs, with
the work term and the least migration penalty). A pruned decision bounds every candidate, scores in full the
``exact_ranks + 2`` smallest bounds and every candidate it cannot bound (bad gauges, unusual profiles: these are
exactly the ones full scoring may exclude), then every other candidate whose bound does not exceed the
``exact_ranks``-th best score found (ties included, with a rounding margin). What that changes, and what not:

* ``chosen``, ``branch`` and the first ``exact_ranks`` places of ``ranking`` (default 3: the choice and the
  router's two retries) are exactly full scoring's, ties broken by candidate order as full scoring breaks them;
  so is the ranking's membership (every candidate but the excluded ones) and the exclusion counters.
* the rest of ``ranking``: the other scored candidates by score, then the pruned ones in candidate order (full
  scoring would rank those by score; a retry walks that far only past ``exact_ranks`` failures).
* ``scores`` holds the candidates scored in full (at least the first ``exact_ranks`` places, and the chosen),
  in candidate order, each exactly as full scoring computes it; a pruned candidate has no entry. So the
  router's ``/route`` lists the contenders, not every replica, and ``pruned_candidates`` counts the others.
* with a TTFT target (``RouteRequest.ttft_target_s``), every candidate that may meet it and the one with the
  lowest predicted TTFT are scored, so the SLO pick and the router's early ``slo_unattainable`` check read
  exactly what full scoring gives them; under ``tail`` with ``slo_ttft_s``, ranking by (meets the SLO, key)
  is bounded the same way.
* state (popularity counts, reuse ages, calibration inputs, exclusion counters) evolves exactly as with full
  scoring, so later decisions are the same too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from math import exp, expm1
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from policies.adapters import adapter_delay_s, adapter_imposed_s
from policies.admission_slo import slo_order
from policies.base import (
    Candidate,
    CandidateScore,
    Decision,
    Objective,
    Observation,
    RouteRequest,
    register,
)
from policies.calibration import PrefillCalibrator
from policies.common import require_candidates
from policies.cost_model import CostParams, estimate, recompute_s
from policies.ttft_bounds import (
    BIG,
    MAX_TOKENS,
    MAX_WORK_WEIGHT,
    SAFE,
    Bounds,
    BoundTerms,
    bound_pass,
    migration_bound,
    worst_known,
)
from policies.ttft_columns import (
    MAX_COLUMN_INDEX,
    BoundColumns,
    ColumnBounds,
    ColumnCandidates,
    IndexedFloats,
    column_bounds,
    migration_floor_bounds,
)

_INF = float("inf")
_NEG = float("-inf")
#: candidates scored in the first round beyond ``exact_ranks`` (the smallest bounds): enough that the others'
#: bounds usually exceed the ``exact_ranks``-th score found, so no second look at the bounds is needed
_EXTRA_SEEDS = 2


class _ProfileError(ValueError):
    """A replica profile the model cannot use (a configuration error: raised, never a silent exclusion)."""


#: Most prefixes the popularity guard of the migration penalty remembers (a bounded table; pruned when full).
_MAX_TRACKED_PREFIXES = 8192

#: Parts of a candidate that holds nothing of the prompt (the per-candidate values are filled in).
_MISS_PARTS: dict[str, float] = {
    "Q": 0.0,
    "R": 0.0,
    "C": 0.0,
    "p": 1.0,
    "T": 0.0,
    "T_miss": 0.0,
    "E": 0.0,
    "tail": 0.0,
    "kv_penalty": 0.0,
    "matched_gpu": 0.0,
    "matched_cpu": 0.0,
    "matched_disk": 0.0,
    "matched_remote": 0.0,
    "usable": 0.0,
    "W": 0.0,
    "RTT": 0.0,
}


class TTFTPolicy:
    """Lowest estimated TTFT (seconds), tier-, freshness- and load-aware, with online calibration.

    Args:
        objective: ``mean`` or ``tail`` to override the request's objective; None follows the request.
        p_confirmed, confirmed_decay_s, p_predicted, predicted_decay_s, kv_pressure_threshold,
            kv_pressure_weight_s, mean_prefill_tokens, tail_quantile, slo_ttft_s: see ``CostParams``.
        calibrate: learn prefill rate and overhead per replica from ``observe``.
        calibration_window, calibration_min_samples, calibration_refit_every: see ``PrefillCalibrator``.
        drain_stale_queue: subtract what the replica prefilled since the scrape from the scraped backlog.
        work_weight: weight of the request's own expected prefill compute (seconds, excluding the fixed
            overhead) added to the score: the delay it imposes on the requests that queue behind it on that
            replica. 0 scores the request's TTFT alone; 1 (default) also counts its cost to the fleet, which
            keeps long shared prefixes where they are cached instead of recomputing them on an idle replica
            (seeds 000 §9.5.4: decide whether the objective is this request's time or all tasks' completion).
        migration_weight: weight of the migration penalty ``(deepest GPU match among the candidates - the
            tokens this candidate can reuse, any usable tier) / prefill rate`` (seconds, linear: no attention term) added to the score: a
            move away from the replica holding the conversation's KV is charged this many times the recompute it
            throws away, because the conversation's later turns follow the new copy while the old one keeps
            occupying cache. 0 disables it. Default 6 with ``migration_cap_s=1``: on the Mooncake conversation
            trace (8 x A100) +0.3 to +1.0 points of hit rate with TTFT p50/p99 still the lowest at loads 0.7 and
            0.9 (docs/results.md).
        migration_cap_s: largest migration penalty, seconds (default 1): the penalty pays for future turns
            with this request's own wait, so it is bounded; uncapped, long conversations (deep matches, long
            prompts, the TTFT tail) wait behind busy holders and p99 rises by up to 1 s at load 0.9.
        popular_window_s, popular_min_requests: the popularity guard. Each decision counts against the block
            key where the deepest GPU match ends (a count decaying with e-folding time ``popular_window_s``
            seconds of ``request.now``); once a prefix's count reaches ``popular_min_requests`` (default 3
            within ~30 s) it is popular: many requests share it right now, so it should be replicated, and the
            migration penalty is not charged (without the guard a 200-request burst sharing an 8k-token prefix
            put 116 requests on one replica). A conversation's deep prefix is matched by its next turn only.
        tight_migration_weight, tight_migration_cap_s: the migration penalty's weight and cap (seconds) when the
            destination's cache is *tight* (below); 0 (default) turns the estimate off and the penalty is always
            ``migration_weight`` capped at ``migration_cap_s``. With tightness ``t`` in [0, 1] the penalty is
            ``(migration_weight + t * (tight_migration_weight - migration_weight)) * lost seconds``, capped at
            ``migration_cap_s + t * (tight_migration_cap_s - migration_cap_s)``; ``1000, 1000`` makes a tight
            cache behave like "never move". Opt-in, not the default: +0.2 points of hit rate over eight 300-s
            slices of the Mooncake trace (4 x A100), within noise on the e2e slice and on the whole trace
            (8 x A100, loads 0.7 / 0.9); docs/results.md, e2e-slice section, point 5.
        tight_ratio_low, tight_ratio_high: the tightness ramp. ``rho = mean reuse age / cache lifetime`` (both
            seconds) and ``t = (rho - low) / (high - low)`` clipped to [0, 1]; defaults 0.5 and 1.0. The
            *cache lifetime* of a replica is ``total_kv_blocks * block_size`` (tokens, its capacity) over the
            rate of uncached tokens written to it (tokens/s, ``write_rate``): how long an unused block survives
            its LRU. The *reuse age* is ``PrefixHit.age_s`` of the deepest unpopular GPU match at routing time
            (for a conversation: the gap since the turn that wrote it). A reuse only hits if it comes within one
            lifetime, so a mean reuse age near the lifetime means reuses happen at the edge of the cache, and
            the blocks a move writes (the duplicated conversation) evict blocks that were about to be reused;
            far below it (``rho`` < 0.5: ages uniform up to ``A`` < lifetime give ``rho = A / (2 lifetime)``),
            the evicted tail is cold and today's capped penalty is kept. Unknown capacity, no write history or
            no reuse seen yet: ``t = 0``.
        lifetime_window_s: e-folding time (seconds of ``Observation.now``) of the per-replica write rate: a
            decaying sum of ``prompt_tokens - cached_tokens`` of each observation, divided by the window it
            covers (exact for a constant rate, no warm-up bias). Default 60.
        reuse_age_samples: the mean reuse age is a running mean over the first this many samples, then an
            exponential moving average over about this many (default 64). O(1) state per replica; no clock.
        survival_check: with ``tight_migration_weight`` set, charge no migration penalty at all when the
            holder's copy will be evicted before this request could use it: ``hit.age_s + Q > cache lifetime``
            of the holder (seconds; an LRU keeps an unused block about one lifetime), so a move throws nothing
            away. Default False: on the e2e slice it raises the hit rate by 0.27 points but TTFT p99 by 2.4 s.
        seed: accepted so every policy takes ``seed``; ``ttft`` is deterministic (ties: candidate order).
        slo_fast_priority: with a TTFT target (``RouteRequest.ttft_target_s``), requests of at least this
            priority take the fastest candidate meeting it, others the one with the least slack (default 1:
            ``standard`` and ``critical`` classes take the fastest, ``sheddable`` packs).
        prune: score in full only the candidates whose lower bound (``policies.ttft_bounds``) can still reach
            the first ``exact_ranks`` places; the decision is the same as scoring every candidate (see
            "Pruning" in the module docstring for what a pruned ``Decision`` carries). None: the class's
            ``prune_default`` (on for the registered ``ttft`` policy, off for ``TTFTPolicy`` itself, which
            ``pd_ttft`` uses as its prefill model and which must give every candidate's terms).
        exact_ranks: places at the head of the ranking that are exactly full scoring's, each with its full terms
            (default 3: the choice and the router's default two retries, ``max_retries``); at least 1.
        prune_min_candidates: prune only decisions with at least this many candidates (and more than
            ``exact_ranks``). Default 32: below it, scoring everyone costs less than bounding first (measured
            with ``python -m loadtest.bench_policies``: pruned and full scoring break even near 24-32
            candidates, pruning halves the time at 64); 0 prunes every decision it can.
    """

    name = "ttft"
    #: whether ``choose`` prunes when the constructor's ``prune`` is None
    prune_default: ClassVar[bool] = False

    def __init__(
        self,
        *,
        objective: Objective | None = None,
        p_confirmed: float = 0.995,
        confirmed_decay_s: float = 0.0,
        p_predicted: float = 0.8,
        predicted_decay_s: float = 120.0,
        kv_pressure_threshold: float = 0.8,
        kv_pressure_weight_s: float = 0.05,
        mean_prefill_tokens: int = 1024,
        tail_quantile: float = 0.99,
        slo_ttft_s: float | None = None,
        calibrate: bool = True,
        calibration_window: int = 64,
        calibration_min_samples: int = 16,
        calibration_refit_every: int = 8,
        drain_stale_queue: bool = False,
        seed: int = 0,
        work_weight: float = 1.0,
        migration_weight: float = 6.0,
        popular_window_s: float = 30.0,
        popular_min_requests: float = 3.0,
        migration_cap_s: float = 1.0,
        tight_migration_weight: float = 0.0,
        tight_migration_cap_s: float = 1000.0,
        tight_ratio_low: float = 0.5,
        tight_ratio_high: float = 1.0,
        lifetime_window_s: float = 60.0,
        reuse_age_samples: int = 64,
        survival_check: bool = False,
        slo_fast_priority: int = 1,
        prune: bool | None = None,
        exact_ranks: int = 3,
        prune_min_candidates: int = 32,
    ) -> None:
        """Check and store the parameters (documented in the class docstring).

        Long because: 30 keyword parameters, one line each; they stay flat (not grouped) because
        ``make_policy(name, **params)`` builds every policy from ``Settings.policy_params``, and the body only
        checks them (``_check_params``) and stores them.
        """
        _check_params(
            objective,
            p_confirmed,
            p_predicted,
            tail_quantile,
            popular_window_s,
            lifetime_window_s,
            tight_ratio_low,
            tight_ratio_high,
            reuse_age_samples,
        )
        self.objective: Objective | None = objective
        self.params = CostParams(
            p_confirmed=p_confirmed,
            confirmed_decay_s=confirmed_decay_s,
            p_predicted=p_predicted,
            predicted_decay_s=predicted_decay_s,
            kv_pressure_threshold=kv_pressure_threshold,
            kv_pressure_weight_s=kv_pressure_weight_s,
            mean_prefill_tokens=mean_prefill_tokens,
            tail_quantile=tail_quantile,
            slo_ttft_s=slo_ttft_s,
        )
        self.calibrate = calibrate
        self.calibrator = PrefillCalibrator(
            window=calibration_window,
            min_samples=calibration_min_samples,
            refit_every=calibration_refit_every,
        )
        self.drain_stale_queue = drain_stale_queue
        self._rates: dict[int, float] = {}
        self._overheads: dict[int, float] = {}
        #: ``_rates`` and ``_overheads`` as columns by replica index (the column pass reads them)
        self._rate_col = IndexedFloats()
        self._overhead_col = IndexedFloats()
        self._attention: dict[int, float] = {}
        self._mean_uncached = float(mean_prefill_tokens)
        self._mean_samples = 0
        self.work_weight = work_weight
        self.migration_weight = migration_weight
        self.popular_window_s = popular_window_s
        self.migration_cap_s = migration_cap_s
        self.popular_min_requests = popular_min_requests
        #: deepest-match block key -> (decayed count of decisions whose deepest GPU match ended there, now)
        self._deep_counts: dict[int, tuple[float, float]] = {}
        self.tight_migration_weight = tight_migration_weight
        self.survival_check = survival_check
        self.tight_migration_cap_s = tight_migration_cap_s
        self.tight_ratio_low = tight_ratio_low
        self.tight_ratio_high = tight_ratio_high
        self.lifetime_window_s = lifetime_window_s
        self.reuse_age_samples = reuse_age_samples
        self.slo_fast_priority = slo_fast_priority
        if exact_ranks < 1:
            raise ValueError(f"exact_ranks must be >= 1, got {exact_ranks!r}")
        self.prune = type(self).prune_default if prune is None else prune
        self.exact_ranks = exact_ranks
        self.prune_min_candidates = prune_min_candidates
        #: candidates a pruned decision did not score in full (cumulative)
        self.pruned_candidates = 0
        #: replica -> [decayed sum of uncached tokens written (tokens), time of the last update (s),
        #: time of the first write (s)]: the write rate that sets the replica's cache lifetime
        self._written: dict[int, list[float]] = {}
        self._reuse_age = 0.0  # mean age of the (unpopular) deepest GPU matches seen at routing time, seconds
        self._reuse_n = 0
        #: candidates left out of decisions because their score could not be computed or was not a finite
        #: non-negative number of seconds (cumulative; the router exports it as a metric)
        self.excluded_candidates = 0
        #: why the last candidate was left out (replica name and error), for logs
        self.last_exclusion = ""

    # ------------------------------------------------------------------ decision

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Estimate the candidates' TTFT and pick the lowest (see the module docstring).

        Steps: the deepest GPU match a move would throw away (``_deepest_to_keep``), every candidate's score
        (``_score``, the hot loop), the migration penalty (``_charge_migration``), the ranking (``_pick``). With
        pruning on (``prune``) and at least ``prune_min_candidates`` candidates (more than ``exact_ranks``),
        ``_choose_pruned`` bounds every candidate first and scores only those that can reach the head of the
        ranking.
        """
        require_candidates(candidates)
        tail = (self.objective or request.objective) == "tail"
        n = len(candidates)
        if self.prune and n > self.exact_ranks and n >= self.prune_min_candidates:
            if isinstance(candidates, ColumnCandidates):
                pruned = self._choose_columns(request, candidates, tail)
            else:
                pruned = self._choose_pruned(request, candidates, tail)
            if pruned is not None:
                return pruned
        deepest = self._deepest_to_keep(request, candidates)
        scores, keys, excluded, moved = self._score(request, candidates, tail, deepest)
        if moved:
            doomed = self._doomed(request, candidates, scores, deepest)
            self._charge_migration(request, candidates, scores, keys, moved, doomed)
        decision = self._pick(candidates, scores, keys, excluded, self.params.slo_ttft_s if tail else None)
        if request.ttft_target_s is not None:
            self._slo_pick(request, decision)
        return decision

    @property
    def accepts_columns(self) -> bool:
        """Whether a caller may pass ``ColumnCandidates`` (``policies.ttft_columns``) for a cheaper decision:
        a pruning policy bounds them as columns and builds only the candidates it scores."""
        return self.prune

    def mean_uncached_tokens(self) -> float:
        """Uncached tokens per queued request when only the request count is scraped: the mean learned from
        ``observe`` once ``calibration_min_samples`` observations arrived, else ``mean_prefill_tokens``."""
        mean_tokens = self._mean_uncached if self._mean_samples >= self.calibrator.min_samples else None
        return mean_tokens or self.params.mean_prefill_tokens

    def _slo_pick(self, request: RouteRequest, decision: Decision) -> None:
        """The final pick under a TTFT target (``policies.admission_slo.slo_order``): among candidates predicted
        to meet it, urgent work (priority >= ``slo_fast_priority``) takes the fastest, other work the least
        slack. Decisions without a target never come here."""
        target = request.ttft_target_s
        if target is None or decision.branch == "unscorable":
            return
        order = slo_order(decision.ranking, decision.scores, target, request.priority, self.slo_fast_priority)
        if order and order[0] != decision.chosen:
            decision.branch = (
                "slo_fastest" if request.priority >= self.slo_fast_priority else "slo_least_slack"
            )
        decision.ranking = order
        decision.chosen = order[0]

    def _deepest_to_keep(
        self, request: RouteRequest, candidates: Sequence[Candidate], gmax: int | None = None
    ) -> int:
        """The deepest GPU match among the candidates (tokens, at most the prompt) that a move away from its
        holder throws away; 0 when the migration penalty is off or that prefix is popular right now (replicate
        it, do not pin it). Counts the decision for the popularity guard and the reuse-age mean. ``gmax``: the
        candidates' deepest GPU match when already known."""
        if not self.migration_weight:
            return 0
        n = request.prompt_tokens
        deepest = max([c.hit.gpu for c in candidates]) if gmax is None else gmax
        if deepest > n:
            deepest = n
        if deepest and self._popular(request, deepest):
            return 0
        if deepest and self.tight_migration_weight:
            self._note_reuse_age(candidates, deepest)
        return deepest

    def _score(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        tail: bool,
        deepest: int,
        worst: tuple[float, float, float] | None = None,
    ) -> tuple[list[CandidateScore], list[float], list[int], list[tuple[int, float]]]:
        """Every candidate's score and parts (seconds), in candidate order.

        Returns (scores, their score values, positions of the excluded candidates, moves: (position, seconds of
        recompute a move there throws away) for the migration penalty). ``worst``: the worst known (backlog,
        running, KV usage) of the decision's candidates (``ttft_bounds.worst_known``), the stand-ins for
        unknown gauges; None computes it from ``candidates`` when a gauge is unknown (a pruned decision scores a
        subset and passes the whole decision's).

        Long because: it is the hot loop (every request, every candidate): the load gaps are filled, Q, the
        KV-pressure penalty, the miss path and the hit path are computed inline on locals. Helpers per candidate
        or per path cost a call and the attribute look-ups again for each candidate (measured:
        ``python -m loadtest.bench_policies --json``, ttft at 64 candidates). GPU-only and empty matches are
        evaluated inline; matches with non-GPU tiers go through ``cost_model.estimate``; a unit test checks the
        inline path against ``estimate``.
        """
        params = self.params
        n = request.prompt_tokens
        k0 = params.kv_pressure_threshold
        kw = params.kv_pressure_weight_s
        pc0 = params.p_confirmed
        cdecay = params.confirmed_decay_s
        pp0 = params.p_predicted
        pdecay = params.predicted_decay_s
        qt_q = params.tail_quantile - 1e-12
        rates = self._rates
        overheads = self._overheads
        drain = self.drain_stale_queue
        ww = self.work_weight
        moved: list[tuple[int, float]] = []  # (position, seconds of recompute a move there throws away)
        mean_tokens = self.mean_uncached_tokens()

        scores: list[CandidateScore] = []
        keys: list[float] = []
        excluded: list[int] = []  # positions of candidates whose scoring failed
        for cand in candidates:
            try:
                load = cand.load
                prof = cand.profile
                hit = cand.hit
                idx = cand.index
                qt: float | None = load.queued_prefill_tokens
                running: float | None = load.running_requests
                kv: float | None = load.kv_usage
                if qt is None or running is None or kv is None:
                    if worst is None:
                        worst = worst_known(candidates, mean_tokens)
                    if qt is None:
                        qr = load.queued_requests
                        qt = worst[0] if qr is None else qr * mean_tokens
                    if running is None:
                        running = worst[1] if worst[1] > load.inflight_requests else load.inflight_requests
                    if kv is None:
                        kv = worst[2]
                if not (qt >= 0 and running >= 0 and kv >= 0.0 and load.inflight_prefill_tokens >= 0):
                    raise ArithmeticError(
                        f"negative or NaN load (backlog {qt!r} tokens, {running!r} running, KV usage {kv!r})"
                    )
                rate = rates.get(idx, prof.prefill_tokens_per_s) if rates else prof.prefill_tokens_per_s
                if not rate > 0.0:  # a configuration error: fails loudly (not an engine's bad input)
                    raise _ProfileError(
                        f"replica {cand.name!r}: prefill_tokens_per_s must be > 0, got {rate!r}"
                    )
                ov = overheads.get(idx, prof.fixed_overhead_s) if overheads else prof.fixed_overhead_s
                att = prof.attention_s_per_token2
                if att:
                    self._attention[idx] = att
                if drain and load.age_s:
                    qt = max(0.0, qt - rate * load.age_s)
                q = (qt + load.inflight_prefill_tokens) / rate + prof.decode_interference_s * running
                if not q >= 0.0:  # NaN (an infinite gauge times a zero interference): max(Q, R) would drop it
                    raise ArithmeticError(
                        f"queue wait {q!r} s is not a number (backlog {qt!r}, {running!r} running)"
                    )
                pen = 0.0 if kv <= k0 else kw * (kv - k0) / (1.0 - kv if kv < 0.999 else 1e-3)
                t_miss = q + ov + (recompute_s(n, 0, rate, att) if att else n / rate)
                g = hit.gpu
                if hit.cpu or hit.disk or hit.remote:
                    est = estimate(n, hit, q, prof, rate, ov, params, kv)
                    score = est.tail if tail else est.expected
                    w = ww * (est.p * (est.c - ov) + (1.0 - est.p) * (est.t_miss - q - ov)) if ww else 0.0
                    if deepest > est.usable_tokens:  # a tier it can fetch from is not thrown away
                        moved.append((len(scores), (deepest - est.usable_tokens) / rate))
                    score += w
                    parts = {
                        "Q": q,
                        "R": est.r,
                        "C": est.c,
                        "p": est.p,
                        "T": est.t_hit,
                        "T_miss": est.t_miss,
                        "E": est.expected,
                        "tail": est.tail,
                        "kv_penalty": pen,
                        "matched_gpu": float(g),
                        "matched_cpu": float(hit.cpu),
                        "matched_disk": float(hit.disk),
                        "matched_remote": float(hit.remote),
                        "usable": float(est.usable_tokens),
                        "W": w,
                    }
                elif not g:
                    w = ww * (t_miss - q - ov) if ww else 0.0
                    if deepest:
                        moved.append((len(scores), deepest / rate))
                    score = t_miss + pen + w
                    parts = _MISS_PARTS.copy()  # copying a template beats a 14-key literal
                    parts["Q"] = q
                    parts["C"] = t_miss - q
                    parts["T"] = parts["T_miss"] = t_miss
                    parts["E"] = parts["tail"] = t_miss + pen
                    parts["kv_penalty"] = pen
                    parts["W"] = w
                else:
                    usable = g if g < n else n
                    new = n - usable
                    c = ov + (recompute_s(new, usable, rate, att) if att else new / rate)
                    t_hit = q + c
                    pred = hit.predicted
                    age = hit.age_s if hit.age_s > 0.0 else 0.0
                    if pred <= 0:
                        p = pc0 * exp(-age / cdecay) if cdecay > 0 else pc0
                        e = p * t_hit + (1.0 - p) * t_miss
                        tl = t_hit if p >= qt_q else t_miss
                    else:
                        pp = pp0 * exp(-age / pdecay) if pdecay > 0 else pp0
                        if pred >= g:
                            p = pp
                            e = p * t_hit + (1.0 - p) * t_miss
                            tl = t_hit if p >= qt_q else t_miss
                        else:
                            pc = pc0 * exp(-age / cdecay) if cdecay > 0 else pc0
                            conf = g - pred if g - pred < n else n
                            cc = ov + (recompute_s(n - conf, conf, rate, att) if att else (n - conf) / rate)
                            t_conf = q + cc
                            p = pc * pp
                            e = p * t_hit + (pc - p) * t_conf + (1.0 - pc) * t_miss
                            tl = t_hit if p >= qt_q else (t_conf if pc >= qt_q else t_miss)
                    e += pen
                    tl += pen
                    w = ww * (e - pen - q - ov) if ww else 0.0
                    if deepest > usable:
                        moved.append((len(scores), (deepest - usable) / rate))
                    score = (tl if tail else e) + w
                    parts = {
                        "Q": q,
                        "R": 0.0,
                        "C": c,
                        "p": p,
                        "T": t_hit,
                        "T_miss": t_miss,
                        "E": e,
                        "tail": tl,
                        "kv_penalty": pen,
                        "matched_gpu": float(g),
                        "matched_cpu": 0.0,
                        "matched_disk": 0.0,
                        "matched_remote": 0.0,
                        "usable": float(usable),
                        "W": w,
                    }
                ad = cand.adapter
                if ad is not None:  # the LoRA adapter: the request's own wait, and what it imposes (W)
                    a_s = adapter_delay_s(ad)
                    wa = ww * adapter_imposed_s(ad) if ww else 0.0
                    score += a_s + wa
                    parts["A"] = a_s
                    parts["T"] += a_s
                    parts["T_miss"] += a_s
                    parts["E"] += a_s
                    parts["tail"] += a_s
                    parts["W"] += wa
                rtt = cand.rtt_s  # the client <-> replica round trip: part of the TTFT the client sees
                if rtt:
                    if not 0.0 <= rtt < _INF:
                        raise ArithmeticError(f"round trip {rtt!r} s is not a finite non-negative number")
                    score += rtt
                    parts["E"] += rtt
                    parts["tail"] += rtt
                parts["RTT"] = rtt
                if not 0.0 <= score < _INF:
                    raise ArithmeticError(f"score {score!r} is not a finite non-negative number of seconds")
            except _ProfileError:
                raise
            except (ArithmeticError, ValueError, TypeError) as exc:
                # one replica's bad inputs (absurd gauges, a broken profile) exclude that replica, never fail the
                # request: it is ranked after every candidate that could be scored, and counted
                excluded.append(len(scores))
                self.excluded_candidates += 1
                self.last_exclusion = f"{cand.name}: {type(exc).__name__}: {exc}"
                moved = [mv for mv in moved if mv[0] != len(scores)]
                score = _INF
                parts = _MISS_PARTS.copy()
                parts["excluded"] = 1.0
            keys.append(score)
            scores.append(CandidateScore(cand.index, cand.name, score, parts))
        return scores, keys, excluded, moved

    def _charge_migration(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        scores: list[CandidateScore],
        keys: list[float],
        moved: list[tuple[int, float]],
        doomed: bool,
    ) -> None:
        """Add the migration penalty (seconds, capped: see the class docstring) to the scores of the moves
        (positions in ``candidates``); none when the holder's copy is ``doomed`` (``_doomed``)."""
        tw = self.tight_migration_weight
        mw = self.migration_weight
        mcap = self.migration_cap_s
        if doomed:
            return  # the holder's copy is evicted before this request would run there: a move loses nothing
        for pos, lost_s in moved:
            if tw:
                t = self.tightness(candidates[pos], request)
                m = (mw + t * (tw - mw)) * lost_s
                cap = mcap + t * (self.tight_migration_cap_s - mcap)
            else:
                m = mw * lost_s
                cap = mcap
            if m > cap:
                m = cap
            if m > 0.0:
                keys[pos] += m
                sc = scores[pos]
                sc.score += m
                sc.parts["W"] += m

    def _pick(
        self,
        candidates: Sequence[Candidate],
        scores: list[CandidateScore],
        keys: list[float],
        excluded: list[int],
        slo: float | None,
    ) -> Decision:
        """The decision: candidates ranked by score (with an SLO: those meeting it first, by mean), the
        excluded ones left out (or, when nothing could be scored, ranked by in-flight requests)."""
        if slo is not None:
            ok = [s.parts["tail"] <= slo for s in scores]
            if any(ok):
                # tail objective with an SLO: candidates meeting it first, by mean; the rest by tail
                rank_keys = [
                    (0, s.parts["E"] + s.parts["W"]) if good else (1, s.score)
                    for s, good in zip(scores, ok, strict=True)
                ]
                order = sorted(range(len(candidates)), key=rank_keys.__getitem__)
            else:
                order = sorted(range(len(candidates)), key=keys.__getitem__)
        else:
            order = sorted(range(len(candidates)), key=keys.__getitem__)
        if excluded and len(excluded) < len(candidates):
            out = set(excluded)
            order = [
                i for i in order if i not in out
            ]  # retries never go to a replica that could not be scored
        elif excluded:
            # nothing could be scored: fall back to this router's own in-flight counts (always sane)
            order = sorted(range(len(candidates)), key=lambda i: candidates[i].load.inflight_requests)
        best = order[0]
        branch = "cache_hit" if scores[best].parts["usable"] > 0 else "cost"
        if len(excluded) == len(candidates):
            branch = "unscorable"
        return Decision(
            chosen=candidates[best].index,
            ranking=[candidates[i].index for i in order],
            scores=scores,
            policy=self.name,
            branch=branch,
        )

    # ------------------------------------------------------------------ pruning

    def _choose_pruned(
        self, request: RouteRequest, candidates: Sequence[Candidate], tail: bool
    ) -> Decision | None:
        """The decision scoring in full only the candidates that can reach the head of the ranking (the module
        docstring, "Pruning"); None when this policy's parameters or the request leave nothing to bound safely
        (the caller then scores every candidate).

        Steps: bound every candidate (``ttft_bounds.bound_pass``), the deepest GPU match to keep, score the
        unbounded candidates and the few smallest bounds (``_score_some``), score every other candidate whose
        bound does not rule it out of the first ``exact_ranks`` places (``_unpruned``), rank (``_rank_scored``).
        """
        slo = self.params.slo_ttft_s if tail else None
        terms = self._bound_terms(request, slo is not None or request.ttft_target_s is not None)
        if terms is None:
            return None
        b = Bounds.sized(len(candidates), terms.need_e, terms.seeds)
        bound_pass(candidates, terms, b)
        deepest = self._deepest_to_keep(request, candidates, b.gmax)
        worst = (b.wq, b.wr, b.wk)
        first = set(b.must)
        first.update(p for _, p in b.top[: terms.seeds] if p >= 0)
        acc = _Scored()
        if deepest and self.tight_migration_weight and self.survival_check:
            holder = b.gpos if b.gmax <= request.prompt_tokens else holder_position(candidates, deepest)
            if holder is not None:
                acc.holder = holder
                first.add(holder)
        self._score_some(request, candidates, sorted(first), tail, deepest, worst, acc)
        rest = self._unpruned(request, candidates, b, acc, slo, deepest)
        if rest:
            self._score_some(request, candidates, rest, tail, deepest, worst, acc)
        decision = self._rank_scored(candidates, b.index, acc, slo)
        if request.ttft_target_s is not None:
            self._slo_pick(request, decision)
        return decision

    def _choose_columns(
        self, request: RouteRequest, candidates: ColumnCandidates, tail: bool
    ) -> Decision | None:
        """``_choose_pruned`` on the candidates' columns (``policies.ttft_columns``): the bounds are column
        arithmetic, and a ``Candidate`` is built only for the positions scored in full. The same decision and the
        same state afterwards as full scoring (the column bounds are lower bounds too)."""
        slo = self.params.slo_ttft_s if tail else None
        terms = self._bound_terms(request, slo is not None or request.ttft_target_s is not None)
        if terms is None:
            return None
        cols = candidates.columns
        if len(cols) and int(cols.index.max()) >= MAX_COLUMN_INDEX:
            return None  # calibration is kept as columns below that index only: full scoring
        if self._rates:  # the calibrated rates and overheads where known
            cols = replace(
                cols,
                rate=self._rate_col.over(cols.index, cols.rate),
                overhead=self._overhead_col.over(cols.index, cols.overhead),
            )
        cb = column_bounds(cols, terms)
        seen = np.flatnonzero((cb.lb != _NEG) & (cols.att != 0.0))
        if seen.size:  # the attention seen, as the pass over objects records it
            self._attention.update(zip(cols.index[seen].tolist(), cols.att[seen].tolist(), strict=True))
        n = request.prompt_tokens
        # the first holder of the deepest match (at most the prompt): all ``_deepest_to_keep`` reads of the holders
        at = cb.gpos if cb.gmax <= n else int(np.flatnonzero(cols.gpu >= n)[0])
        deepest = self._deepest_to_keep(request, [candidates[at]], cb.gmax)
        first = set(cb.must)
        first.update(p for _, p in cb.top[: terms.seeds] if p >= 0)
        acc = _Scored()
        if deepest and self.tight_migration_weight and self.survival_check:
            acc.holder = (
                at  # ``holder_position``: the first candidate holding ``deepest`` (at most the prompt)
            )
            first.add(at)
        worst = (cb.wq, cb.wr, cb.wk)
        self._score_some(request, candidates, sorted(first), tail, deepest, worst, acc)
        rest = self._unpruned_columns(request, cols, cb, acc, slo, deepest)
        if rest:
            self._score_some(request, candidates, rest, tail, deepest, worst, acc)
        decision = self._rank_scored(candidates, cols.index.tolist(), acc, slo)
        if request.ttft_target_s is not None:
            self._slo_pick(request, decision)
        return decision

    def _unpruned_columns(
        self,
        request: RouteRequest,
        cols: BoundColumns,
        cb: ColumnBounds,
        acc: _Scored,
        slo: float | None,
        deepest: int,
    ) -> list[int]:
        """``_unpruned`` over column bounds: the positions not scored yet that the bounds do not rule out."""
        scored = acc.scores
        ok = [p for p in scored if p not in acc.excluded]
        k = self.exact_ranks
        if len(ok) < k:  # too few scoreable: nothing can be ruled out
            return [p for p in range(len(cols)) if p not in scored]
        lb = cb.lb
        target = request.ttft_target_s
        mig = self._migration_floor(deepest)

        def within(v: float) -> npt.NDArray[np.bool_]:
            if mig is None:
                return lb <= v
            return (lb <= v) & (lb + migration_floor_bounds(cols, request.prompt_tokens, deepest, *mig) <= v)

        if slo is None:
            v = sorted(acc.keys[p] for p in ok)[k - 1] / SAFE
            if target is None and v < cb.cut:
                return []  # every candidate not scored has a bound of at least ``cut``
            maybe = [p for p in np.flatnonzero(within(v)).tolist() if p not in scored]
            if target is None:
                return maybe
            ethr = max(target, min(scored[p].parts["E"] for p in ok)) / SAFE
            more = [p for p in np.flatnonzero(cb.lbe <= ethr).tolist() if p not in scored]
            return sorted({*maybe, *more})
        g, v = sorted(_slo_key(scored[p], slo) for p in ok)[k - 1]
        v /= SAFE
        lbe = cb.lbe
        ethr = _NEG if target is None else max(target, min(scored[p].parts["E"] for p in ok)) / SAFE
        meets = lbe <= slo / SAFE  # may meet the SLO (rank group 0)
        keep = (lbe <= ethr) | (meets & bool(g)) | ((meets | bool(g)) & within(v))
        return [p for p in np.flatnonzero(keep).tolist() if p not in scored]

    def _bound_terms(self, request: RouteRequest, need_e: bool) -> BoundTerms | None:
        """The bound pass's constants for this decision, or None when a parameter is outside what the bounds
        cover: ``work_weight`` outside [0, ``MAX_WORK_WEIGHT``], a negative KV-pressure weight, a prompt over
        ``MAX_TOKENS``, or a migration cap that is not a number below ``BIG`` seconds."""
        params = self.params
        ww = self.work_weight
        n = request.prompt_tokens
        caps = (self.migration_cap_s, self.tight_migration_cap_s) if self.tight_migration_weight else ()
        if not (0.0 <= ww <= MAX_WORK_WEIGHT and params.kv_pressure_weight_s >= 0.0 and 0 <= n <= MAX_TOKENS):
            return None
        if not all(-BIG < c < BIG for c in (self.migration_cap_s, *caps)):
            return None
        return BoundTerms(
            n=n,
            mean_tokens=self.mean_uncached_tokens(),
            k0=params.kv_pressure_threshold,
            kw=params.kv_pressure_weight_s,
            ww=ww,
            drain=self.drain_stale_queue,
            rates=self._rates,
            overheads=self._overheads,
            attention=self._attention,
            need_e=need_e,
            seeds=self.exact_ranks + _EXTRA_SEEDS,
        )

    def _migration_floor(self, deepest: int) -> tuple[float, float] | None:
        """(weight, cap seconds): the least migration penalty any tightness charges a move this decision, or
        None when it may be nothing (no deepest match, a weight or cap that is not positive, or the survival
        check, which may drop every move's penalty)."""
        if not deepest:
            return None
        tw = self.tight_migration_weight
        weights = (self.migration_weight, tw) if tw else (self.migration_weight,)
        caps = (self.migration_cap_s, self.tight_migration_cap_s) if tw else (self.migration_cap_s,)
        if not (all(w > 0.0 for w in weights) and all(c > 0.0 for c in caps)) or (tw and self.survival_check):
            return None
        return min(weights), min(caps)

    def _score_some(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        positions: list[int],
        tail: bool,
        deepest: int,
        worst: tuple[float, float, float],
        acc: _Scored,
    ) -> None:
        """Score the candidates at ``positions`` (ascending) in full, migration penalty included, into ``acc``.

        The holder's copy is judged (survival check) in the first call, which scores the holder."""
        sub = [candidates[p] for p in positions]
        scores, keys, excluded, moved = self._score(request, sub, tail, deepest, worst)
        if acc.doomed is None:
            h = acc.holder
            acc.doomed = h is not None and self.holder_copy_doomed(
                candidates[h], scores[positions.index(h)], request
            )
        if moved:
            self._charge_migration(request, sub, scores, keys, moved, acc.doomed)
        for i, p in enumerate(positions):
            acc.scores[p] = scores[i]
            acc.keys[p] = keys[i]
        acc.excluded.update(positions[i] for i in excluded)

    def _unpruned(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        b: Bounds,
        acc: _Scored,
        slo: float | None,
        deepest: int,
    ) -> list[int]:
        """Positions not scored yet that their bounds do not rule out (ascending).

        Ruled out: a bound (migration floor included) above the ``exact_ranks``-th best rank key scored so far;
        with a TTFT target, also a ``bound_E`` above max(target, the lowest E scored), so every candidate that
        may meet the target or have the lowest predicted TTFT is scored; with an SLO under ``tail``, rank keys
        are (misses the SLO, key) pairs and a bound's is (``bound_E`` > SLO, bound). Thresholds are divided by
        ``SAFE`` (bounds are unscaled)."""
        scored = acc.scores
        ok = [p for p in scored if p not in acc.excluded]
        k = self.exact_ranks
        if len(ok) < k:  # too few scoreable: nothing can be ruled out
            return [p for p in range(len(b.lb)) if p not in scored]
        lb = b.lb
        target = request.ttft_target_s
        mig = self._migration_floor(deepest)
        n, rates = request.prompt_tokens, self._rates

        def within(p: int, x: float, v: float) -> bool:
            return mig is None or x + migration_bound(candidates[p], n, rates, deepest, *mig) <= v

        if slo is None:
            v = sorted(acc.keys[p] for p in ok)[k - 1] / SAFE
            if target is None and v < b.cut:
                return []  # every candidate not scored has a bound of at least ``cut``
            maybe = [p for p, x in enumerate(lb) if x <= v and p not in scored and within(p, x, v)]
            if target is None:
                return maybe
            ethr = max(target, min(scored[p].parts["E"] for p in ok)) / SAFE
            return sorted({*maybe, *(p for p, x in enumerate(b.lbe) if x <= ethr and p not in scored)})
        g, v = sorted(_slo_key(scored[p], slo) for p in ok)[k - 1]
        v /= SAFE
        lbe = b.lbe
        ethr = _NEG if target is None else max(target, min(scored[p].parts["E"] for p in ok)) / SAFE
        slo_s = slo / SAFE
        out = []
        for p, x in enumerate(lb):
            if p in scored:
                continue
            meets = lbe[p] <= slo_s  # may meet the SLO (rank group 0)
            if lbe[p] <= ethr or (g and meets) or ((meets or g) and x <= v and within(p, x, v)):
                out.append(p)
        return out

    def _rank_scored(
        self, candidates: Sequence[Candidate], index: list[int], acc: _Scored, slo: float | None
    ) -> Decision:
        """The pruned decision: the scored candidates ranked by their keys (exactly as full scoring ranks them),
        then the pruned ones in candidate order; ``scores`` holds the scored ones in candidate order. When
        nothing was pruned, exactly full scoring's ``_pick``."""
        positions = sorted(acc.scores)
        scores = [acc.scores[p] for p in positions]
        n = len(candidates)
        if len(positions) == n:
            keys = [acc.keys[p] for p in positions]
            return self._pick(candidates, scores, keys, sorted(acc.excluded), slo)
        self.pruned_candidates += n - len(positions)
        ok = [p for p in positions if p not in acc.excluded]
        if slo is None:
            ok.sort(key=acc.keys.__getitem__)
        else:
            ok.sort(key=lambda p: _slo_key(acc.scores[p], slo))
        ranking = [index[p] for p in ok]
        prev = 0
        for p in positions:  # the pruned ones, in candidate order, between the scored positions
            ranking += index[prev:p]
            prev = p + 1
        ranking += index[prev:]
        best = ok[0]
        return Decision(
            chosen=index[best],
            ranking=ranking,
            scores=scores,
            policy=self.name,
            branch="cache_hit" if acc.scores[best].parts["usable"] > 0 else "cost",
        )

    def _popular(self, request: RouteRequest, deepest: int) -> bool:
        """Count this decision against its deepest GPU match; True when that prefix is popular right now.

        The prefix is identified by the block key where the deepest match ends (chained keys name the whole
        prefix). Its count decays with e-folding time ``popular_window_s`` (seconds of ``request.now``); it is
        popular when the count including this request reaches ``popular_min_requests``. A conversation's deep
        prefix is matched by its next turn only, so it stays unpopular and keeps the migration penalty; a burst
        sharing one long prefix becomes popular on its third request and spreads as without the penalty.
        A prefix that cannot be identified (no keys for that depth) is never popular.
        """
        bs = request.block_size
        nb = deepest // bs if bs > 0 else 0
        keys = request.block_keys
        if nb <= 0 or nb > len(keys):
            return False
        key = keys[nb - 1]
        now = request.now
        counts = self._deep_counts
        prev = counts.get(key)
        if prev is None:
            c = 1.0
            if len(counts) >= _MAX_TRACKED_PREFIXES:
                self._prune(now)
                counts = self._deep_counts
        else:
            dt = now - prev[1]
            c = prev[0] * exp(-dt / self.popular_window_s) + 1.0 if dt > 0.0 else prev[0] + 1.0
        counts[key] = (c, now if prev is None or now > prev[1] else prev[1])
        return c >= self.popular_min_requests

    def _prune(self, now: float) -> None:
        """Bound the popularity table: drop prefixes idle for over 5 windows, then the oldest half if needed."""
        counts = self._deep_counts
        horizon = now - 5.0 * self.popular_window_s
        kept = {k: v for k, v in counts.items() if v[1] >= horizon}
        if len(kept) >= _MAX_TRACKED_PREFIXES // 2:
            newest = sorted(kept.items(), key=lambda kv: kv[1][1])[len(kept) // 2 :]
            kept = dict(newest)
        self._deep_counts = kept

    # ------------------------------------------------------------------ cache lifetime vs reuse age

    def _note_reuse_age(self, candidates: Sequence[Candidate], deepest: int) -> None:
        """Fold the age (seconds) of the deepest GPU match into the running mean of reuse ages.

        The age of the candidate holding ``deepest`` GPU tokens (the first such candidate) is the time since its
        deepest matched block was stored: for a conversation, the gap since the turn that wrote it. Running mean
        over the first ``reuse_age_samples`` samples, then an exponential moving average with that many samples.
        """
        for c in candidates:
            if c.hit.gpu >= deepest:
                age = c.hit.age_s if c.hit.age_s > 0.0 else 0.0
                self._reuse_n += 1
                alpha = 1.0 / min(self._reuse_n, self.reuse_age_samples)
                self._reuse_age += alpha * (age - self._reuse_age)
                return

    def _doomed(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        scores: Sequence[CandidateScore],
        deepest: int,
    ) -> bool:
        """With the survival check on, True when the holder's copy of the deepest GPU match is evicted before
        this request could use it there (``holder_copy_doomed``); ``scores`` in candidate order."""
        if not (self.tight_migration_weight and self.survival_check):
            return False
        pos = holder_position(candidates, deepest)
        return pos is not None and self.holder_copy_doomed(candidates[pos], scores[pos], request)

    def holder_copy_doomed(self, holder: Candidate, score: CandidateScore, request: RouteRequest) -> bool:
        """True when the deepest GPU match will be evicted before this request could use it on its holder.

        The holder is the first candidate holding the deepest GPU match (``holder_position``). An LRU keeps an
        unused block for one cache lifetime; the prefix was last stored ``hit.age_s`` seconds ago and the request
        would wait ``Q`` seconds (its score's queue estimate) before its prefill starts, so the copy is lost when
        ``age_s + Q > cache_lifetime_s`` of the holder. False when the lifetime is unknown.
        """
        life = self.cache_lifetime_s(holder, request)
        return life is not None and holder.hit.age_s + score.parts["Q"] > life

    def write_rate(self, index: int, now: float) -> float | None:
        """Uncached tokens per second written to replica ``index``'s cache lately, or None when unknown.

        A sum of the written tokens decaying with e-folding time ``lifetime_window_s`` (seconds of the
        observations' clock), divided by the window it covers: ``lifetime_window_s * (1 - exp(-elapsed /
        lifetime_window_s))``, exact for a constant rate from the first write on. None before any write or when
        no time has passed since the first one.
        """
        rec = self._written.get(index)
        if rec is None:
            return None
        total, last, first = rec
        tau = self.lifetime_window_s
        elapsed = now - first
        if not elapsed > 0.0:
            return None
        if now > last:
            total *= exp(-(now - last) / tau)
        return total / (tau * -expm1(-elapsed / tau))  # expm1: no 0 denominator for a tiny elapsed time

    def cache_lifetime_s(self, candidate: Candidate, request: RouteRequest) -> float | None:
        """Seconds a block survives in the candidate's LRU cache at its current write rate, or None if unknown.

        ``total_kv_blocks * block size`` (the capacity, tokens) over ``write_rate`` (tokens/s). The capacity is
        counted in the engine's own blocks, so its block size (``load.engine_block_size``) is used when known;
        the router's stands in otherwise.
        """
        blocks = candidate.load.total_kv_blocks
        rate = self.write_rate(candidate.index, request.now)
        if not blocks or rate is None or not rate > 0.0:
            return None
        return blocks * (candidate.load.engine_block_size or request.block_size) / rate

    def tightness(self, candidate: Candidate, request: RouteRequest) -> float:
        """How tight the candidate's cache is for the prefixes being reused: 0 (loose) to 1 (tight).

        ``rho = mean reuse age / cache lifetime`` (both seconds). A block is evicted about one lifetime after
        its last use, so reuses at ages near the lifetime are the ones a move's extra writes turn into misses.
        ``(rho - tight_ratio_low) / (tight_ratio_high - tight_ratio_low)``, clipped to [0, 1]; 0 while either
        is unknown (no reuse seen yet, no write rate, no capacity).
        """
        if not self._reuse_n:
            return 0.0
        life = self.cache_lifetime_s(candidate, request)
        if life is None:
            return 0.0
        rho = self._reuse_age / life
        lo = self.tight_ratio_low
        t = (rho - lo) / (self.tight_ratio_high - lo)
        return 0.0 if t <= 0.0 else (1.0 if t >= 1.0 else t)

    # ------------------------------------------------------------------ feedback

    def observe(self, observation: Observation) -> None:
        """Feed one (uncached tokens, queue wait, TTFT) sample to the replica's calibration.

        With ``tight_migration_weight`` set, the uncached tokens also count as written to the replica's cache
        (at ``observation.now``) for its write rate, whether or not calibration is on.
        """
        idx = observation.index
        uncached = max(0, observation.prompt_tokens - observation.cached_tokens)
        if self.tight_migration_weight:
            self._note_write(idx, uncached, observation.now)
        if not self.calibrate:
            return
        self._mean_samples += 1
        alpha = max(0.02, 1.0 / self._mean_samples)  # running mean first, then an EWMA over ~50 requests
        self._mean_uncached += alpha * (uncached - self._mean_uncached)
        prefill_s = observation.ttft_s - max(0.0, observation.queue_wait_s)
        att = self._attention.get(idx, 0.0)
        if att:
            cached = observation.cached_tokens
            prefill_s -= att * (uncached * cached + uncached * (uncached + 1) / 2)
        self.calibrator.add(idx, uncached, prefill_s)
        rate = self.calibrator.rate(idx)
        if rate is not None:
            self._rates[idx] = rate
            self._rate_col.set(idx, rate)
            ov = self.calibrator.overhead_s(idx)
            if ov is not None:
                self._overheads[idx] = ov
                self._overhead_col.set(idx, ov)

    def _note_write(self, index: int, tokens: int, now: float) -> None:
        """Add ``tokens`` uncached tokens written to replica ``index`` at ``now`` (seconds) to its decayed sum."""
        rec = self._written.get(index)
        if rec is None:
            self._written[index] = [float(tokens), now, now]
            return
        if now > rec[1]:
            rec[0] *= exp(-(now - rec[1]) / self.lifetime_window_s)
            rec[1] = now
        rec[0] += tokens

    def forget(self, index: int) -> None:
        """Drop calibration for replica ``index`` (left the fleet, restarted, or changed hardware)."""
        self.calibrator.forget(index)
        self._written.pop(index, None)
        self._rates.pop(index, None)
        self._overheads.pop(index, None)
        self._rate_col.drop(index)
        self._overhead_col.drop(index)
        self._attention.pop(index, None)

    def calibrated(self, index: int) -> tuple[float, float] | None:
        """``(prefill tokens/s, overhead s)`` learned for replica ``index``, or None while uncalibrated."""
        if index not in self._rates:
            return None
        return self._rates[index], self._overheads.get(index, 0.0)


@register("ttft")
class PrunedTTFTPolicy(TTFTPolicy):
    """The registered ``ttft`` policy (what the router and the simulator run): ``TTFTPolicy`` with pruning on
    unless ``prune=False`` is given. Same parameters, same decisions; a pruned ``Decision`` carries the scored
    candidates' terms only (module docstring, "Pruning")."""

    prune_default: ClassVar[bool] = True


def _check_params(
    objective: Objective | None,
    p_confirmed: float,
    p_predicted: float,
    tail_quantile: float,
    popular_window_s: float,
    lifetime_window_s: float,
    tight_ratio_low: float,
    tight_ratio_high: float,
    reuse_age_samples: int,
) -> None:
    """Raise ``ValueError`` for a ``TTFTPolicy`` parameter out of its range (a configuration error)."""
    if objective not in (None, "mean", "tail"):
        raise ValueError(f"objective must be 'mean' or 'tail', got {objective!r}")
    if not 0.0 <= p_confirmed <= 1.0 or not 0.0 <= p_predicted <= 1.0:
        raise ValueError("p_confirmed and p_predicted must be within [0, 1]")
    if not 0.0 < tail_quantile <= 1.0:
        raise ValueError("tail_quantile must be within (0, 1]")
    if not popular_window_s > 0.0:
        raise ValueError(f"popular_window_s must be > 0, got {popular_window_s!r}")
    if not lifetime_window_s > 0.0:
        raise ValueError(f"lifetime_window_s must be > 0, got {lifetime_window_s!r}")
    if not 0.0 <= tight_ratio_low < tight_ratio_high:
        raise ValueError("tight_ratio_low and tight_ratio_high must satisfy 0 <= low < high")
    if reuse_age_samples < 1:
        raise ValueError(f"reuse_age_samples must be >= 1, got {reuse_age_samples!r}")


def holder_position(candidates: Sequence[Candidate], deepest: int) -> int | None:
    """Position of the first candidate holding ``deepest`` GPU tokens (the holder a move leaves), or None."""
    for pos, c in enumerate(candidates):
        if c.hit.gpu >= deepest:
            return pos
    return None


@dataclass(slots=True)
class _Scored:
    """The candidates a pruned decision scored in full, by position.

    Attributes:
        scores, keys: score (with parts) and score value of each scored position.
        excluded: scored positions whose scoring failed.
        holder: position of the deepest GPU match's holder when the survival check needs it, else None.
        doomed: whether the holder's copy is evicted first (None until the holder is scored).
    """

    scores: dict[int, CandidateScore] = field(default_factory=dict)
    keys: dict[int, float] = field(default_factory=dict)
    excluded: set[int] = field(default_factory=set)
    holder: int | None = None
    doomed: bool | None = None


def _slo_key(score: CandidateScore, slo: float) -> tuple[int, float]:
    """A candidate's rank key under the ``tail`` objective with an SLO (``_pick``): those whose tail meets it
    first, by ``E + W``; the others by their score."""
    parts = score.parts
    if parts["tail"] <= slo:
        return 0, parts["E"] + parts["W"]
    return 1, score.score
