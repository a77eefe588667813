"""``ttft`` (the default policy): pick the replica with the lowest estimated time to first token.

Per candidate it evaluates the tiered model of ``policies.cost_model`` (``Q``, ``R``, ``C``, ``T``, hit
probability ``p``, ``E[T]``, tail, KV-pressure penalty) and picks the minimum of ``E[T]`` (objective ``mean``)
or of the tail quantile (objective ``tail``). The objective comes from the request unless the policy was built
with a fixed one.

Load inputs and what happens when they are unknown (``None``):

* backlog tokens = scraped ``queued_prefill_tokens`` + ``inflight_prefill_tokens`` (work this router dispatched
  since the scrape; the router adds a request's uncached tokens right after deciding, which is what spreads a
  burst sharing one system prompt over the fleet instead of piling it on the replica holding the prompt).
  If only ``queued_requests`` is scraped, it is multiplied by ``mean_prefill_tokens``. If neither is known, the
  largest backlog any candidate reports is assumed (never zero: a blind replica must not look idle); when no
  candidate reports one, every candidate gets 0 and the in-flight counters decide.
* running requests (decode interference) unknown -> the largest known, or this router's in-flight requests.
* KV usage unknown -> the largest known, else 0.
* optionally (``drain_stale_queue``) the scraped backlog is reduced by ``rate * age_s`` (what the replica has
  prefilled since the scrape).

Prefill rate and fixed overhead come from the candidate's profile until online calibration (``observe``) has
``calibration_min_samples`` samples for that replica; then the calibrated values are used.

Ties are broken by candidate order (deterministic). The decision's parts per candidate: ``Q``, ``R``, ``C``,
``p``, ``T`` (hit path), ``T_miss``, ``E``, ``tail``, ``kv_penalty``, ``matched_gpu/cpu/disk/remote``,
``predicted``, ``usable`` (tokens) and ``rate`` (tokens/s).
"""

from __future__ import annotations

from collections.abc import Sequence

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


@register("ttft")
class TTFTPolicy:
    """Lowest estimated TTFT (seconds), tier-, freshness- and load-aware, with online calibration.

    Args:
        objective: ``mean`` or ``tail`` to override the request's objective; None follows the request.
        p_confirmed, confirmed_decay_s, p_predicted, predicted_decay_s, kv_pressure_threshold,
            kv_pressure_weight_s, mean_prefill_tokens, tail_quantile, slo_ttft_s: see ``CostParams``.
        calibrate: learn prefill rate and overhead per replica from ``observe``.
        calibration_window, calibration_min_samples, calibration_refit_every: see ``PrefillCalibrator``.
        drain_stale_queue: subtract what the replica prefilled since the scrape from the scraped backlog.
    """

    name = "ttft"

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
    ) -> None:
        if objective not in (None, "mean", "tail"):
            raise ValueError(f"objective must be 'mean' or 'tail', got {objective!r}")
        if not 0.0 <= p_confirmed <= 1.0 or not 0.0 <= p_predicted <= 1.0:
            raise ValueError("p_confirmed and p_predicted must be within [0, 1]")
        if not 0.0 < tail_quantile <= 1.0:
            raise ValueError("tail_quantile must be within (0, 1]")
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
        self._attention: dict[int, float] = {}

    # ------------------------------------------------------------------ decision

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Estimate every candidate's TTFT and pick the lowest (see the module docstring)."""
        require_candidates(candidates)
        params = self.params
        tail = (self.objective or request.objective) == "tail"
        n = request.prompt_tokens
        mean_tokens = params.mean_prefill_tokens
        k0 = params.kv_pressure_threshold
        rates = self._rates
        overheads = self._overheads
        drain = self.drain_stale_queue
        worst: tuple[float, float, float] | None = None

        scores: list[CandidateScore] = []
        keys: list[float] = []
        slo_ok: list[bool] = []
        slo = params.slo_ttft_s if tail else None
        for cand in candidates:
            load = cand.load
            prof = cand.profile
            hit = cand.hit
            idx = cand.index
            rate = rates.get(idx, prof.prefill_tokens_per_s) if rates else prof.prefill_tokens_per_s
            ov = overheads.get(idx, prof.fixed_overhead_s) if overheads else prof.fixed_overhead_s
            att = prof.attention_s_per_token2
            if att:
                self._attention[idx] = att

            qt: float | None = load.queued_prefill_tokens
            if qt is None and load.queued_requests is not None:
                qt = load.queued_requests * mean_tokens
            running: float | None = load.running_requests
            kv = load.kv_usage
            if qt is None or running is None or kv is None:
                if worst is None:
                    worst = _worst_known(candidates, mean_tokens)
                if qt is None:
                    qt = worst[0]
                if running is None:
                    running = max(worst[1], load.inflight_requests)
                if kv is None:
                    kv = worst[2]
            if drain and load.age_s:
                qt = max(0.0, qt - rate * load.age_s)
            q = (qt + load.inflight_prefill_tokens) / rate + prof.decode_interference_s * running

            if hit.gpu == 0 and hit.cpu == 0 and hit.disk == 0 and hit.remote == 0 and kv <= k0:
                # fast path: nothing cached, no KV pressure
                c = ov + (recompute_s(n, 0, rate, att) if att else n / rate)
                t = q + c
                keys.append(t)
                slo_ok.append(slo is None or t <= slo)
                scores.append(
                    CandidateScore(
                        idx,
                        cand.name,
                        t,
                        {
                            "Q": q,
                            "R": 0.0,
                            "C": c,
                            "p": 1.0,
                            "T": t,
                            "T_miss": t,
                            "E": t,
                            "tail": t,
                            "kv_penalty": 0.0,
                            "matched_gpu": 0.0,
                            "matched_cpu": 0.0,
                            "matched_disk": 0.0,
                            "matched_remote": 0.0,
                            "predicted": 0.0,
                            "usable": 0.0,
                            "rate": rate,
                        },
                    )
                )
                continue

            est = estimate(n, hit, q, prof, rate, ov, params, kv)
            score = est.tail if tail else est.expected
            keys.append(score)
            slo_ok.append(slo is None or est.tail <= slo)
            scores.append(
                CandidateScore(
                    idx,
                    cand.name,
                    score,
                    {
                        "Q": q,
                        "R": est.r,
                        "C": est.c,
                        "p": est.p,
                        "T": est.t_hit,
                        "T_miss": est.t_miss,
                        "E": est.expected,
                        "tail": est.tail,
                        "kv_penalty": est.kv_penalty,
                        "matched_gpu": float(hit.gpu),
                        "matched_cpu": float(hit.cpu),
                        "matched_disk": float(hit.disk),
                        "matched_remote": float(hit.remote),
                        "predicted": float(hit.predicted),
                        "usable": float(est.usable_tokens),
                        "rate": rate,
                    },
                )
            )

        if slo is not None and any(slo_ok):
            # tail objective with an SLO: candidates meeting it first, by mean; the rest by tail
            for i, ok in enumerate(slo_ok):
                if ok:
                    keys[i] = scores[i].parts["E"]
            order = sorted(range(len(candidates)), key=lambda i: (not slo_ok[i], keys[i]))
        else:
            order = sorted(range(len(candidates)), key=keys.__getitem__)
        best = order[0]
        branch = "cache_hit" if scores[best].parts["usable"] > 0 else "cost"
        return Decision(
            chosen=candidates[best].index,
            ranking=[candidates[i].index for i in order],
            scores=scores,
            policy=self.name,
            branch=branch,
        )

    # ------------------------------------------------------------------ feedback

    def observe(self, observation: Observation) -> None:
        """Feed one (uncached tokens, queue wait, TTFT) sample to the replica's calibration."""
        if not self.calibrate:
            return
        idx = observation.index
        uncached = max(0, observation.prompt_tokens - observation.cached_tokens)
        prefill_s = observation.ttft_s - max(0.0, observation.queue_wait_s)
        att = self._attention.get(idx, 0.0)
        if att:
            cached = observation.cached_tokens
            prefill_s -= att * (uncached * cached + uncached * (uncached + 1) / 2)
        self.calibrator.add(idx, uncached, prefill_s)
        rate = self.calibrator.rate(idx)
        if rate is not None:
            self._rates[idx] = rate
            ov = self.calibrator.overhead_s(idx)
            if ov is not None:
                self._overheads[idx] = ov

    def forget(self, index: int) -> None:
        """Drop calibration for replica ``index`` (left the fleet, restarted, or changed hardware)."""
        self.calibrator.forget(index)
        self._rates.pop(index, None)
        self._overheads.pop(index, None)
        self._attention.pop(index, None)

    def calibrated(self, index: int) -> tuple[float, float] | None:
        """``(prefill tokens/s, overhead s)`` learned for replica ``index``, or None while uncalibrated."""
        if index not in self._rates:
            return None
        return self._rates[index], self._overheads.get(index, 0.0)


def _worst_known(candidates: Sequence[Candidate], mean_tokens: int) -> tuple[float, float, float]:
    """Largest known (backlog tokens, running requests, KV usage) among ``candidates`` (0 when none known)."""
    backlog = 0.0
    running = 0.0
    kv = 0.0
    for c in candidates:
        load = c.load
        if load.queued_prefill_tokens is not None:
            backlog = max(backlog, float(load.queued_prefill_tokens))
        elif load.queued_requests is not None:
            backlog = max(backlog, float(load.queued_requests * mean_tokens))
        if load.running_requests is not None:
            running = max(running, float(load.running_requests))
        if load.kv_usage is not None:
            kv = max(kv, load.kv_usage)
    return backlog, running, kv
