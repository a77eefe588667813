"""``pd_ttft``: kvroute's PD plan choice, every feasible plan priced in seconds of predicted TTFT.

For a prompt of ``N`` tokens (seeds 000 §9.2, TV-14; 002 item 1.2; DESIGN §4):

* **in place** on replica X (a ``both`` replica, or a ``decode`` replica prefilling itself)::

      TTFT = Q_X + R_X + C_X        (or max(Q, R) + C: ``policies.cost_model``, the model ``ttft`` uses)

  The first token comes out of X's own prefill; X's running decode batch slows it through
  ``decode_interference_s`` per running request (in ``Q``).

* **disaggregated**, prefill on P, decode on D::

      T_p      = Q_p + R_p + C_p                                  (cost model on P: queue, fetch, recompute)
      handoff  = max(0, link_busy_p - T_p) + latency + moved * bytes_per_token / bandwidth
      moved    = N - (prompt tokens D already holds in GPU)       (the whole prompt's KV, TV-14: 1.125 GiB)
      D_ready  = backlog_D / rate_D                               (prefill work D itself has queued)
      decode_first = max(0, D_ready - (T_p + handoff)) + decode_step_s * (1 + ...) + kv_penalty(D)
      TTFT     = T_p + handoff + decode_first

  ``decode_step_s + decode_step_s_per_request * (running_D + 1)`` is one decode round of D's running batch
  with the request in it (TV-16: 26.26 ms at batch 1 .. 29.63 ms at batch 64). D's queue of its own prefill
  work drains while P computes and the KV moves, hence the ``max``. Handoffs from one prefill replica are
  serialised on its link (``PdCandidate.link_busy_s``, seconds of handoffs already queued there).

The plan with the lowest TTFT wins (``E[T]``; the tail quantile when the request's objective is ``tail``). So a
short prompt, or a decode replica that already holds most of the prefix (little to recompute, nothing to move
but its own queue), is served in place, and a long uncached prompt goes to an idle prefill replica when its
prefill plus the handoff beat the in-place prefill on the decode side.

**What the caller must charge** (``policies.pd_base.plan_charges``): at dispatch, before either leg runs,
``inflight_requests += 1`` on P and on D, and ``inflight_prefill_tokens += plan.prefill_tokens`` on the replica
that prefills (P, or X in place). P's charges end with the prefill leg (its response / the handoff), D's with
the request. The simulator (``loadtest.pd_simulator``) does exactly this. Without the charge on P before
dispatch, a burst sees every prefill replica idle and picks prefill #0 every time (sglang #27547).

Terms per plan (seconds unless named tokens): in place ``Q``, ``R``, ``C``, ``kv_penalty``; disaggregated
``Q_p``, ``R_p``, ``C_p``, ``handoff``, ``link_wait``, ``D_ready``, ``decode_step``, ``decode_first``,
``kv_penalty``, ``moved_tokens``; both carry ``usable`` (reused tokens on the prefilling replica).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.base import Objective, Observation, RouteRequest
from policies.cost_model import CostParams, estimate, kv_penalty_s
from policies.pd_base import HandoffLink, PdCandidate, Plan, PlanDecision, register_pd
from policies.pd_common import (
    Loads,
    RoleRules,
    decision_of,
    gpu_hit_tokens,
    no_feasible_plan,
    positions,
    read_loads,
    require_pd_candidates,
)


@dataclass(frozen=True, slots=True)
class _Prefill:
    """One candidate's prefill estimate (seconds, tokens)."""

    q: float
    r: float
    c: float
    ttft: float
    usable: int
    kv_penalty: float


@register_pd("pd_ttft")
class PdTtftPolicy:
    """Lowest predicted TTFT over every feasible plan (in place, or any prefill/decode pair).

    Args:
        decode_prefills: a ``decode`` replica may serve in place (prefill itself).
        both_can_pair: ``both`` replicas may take either leg of a disaggregated plan.
        objective: ``mean`` or ``tail`` to override the request's objective; None follows the request.
        p_confirmed, confirmed_decay_s, p_predicted, predicted_decay_s, kv_pressure_threshold,
            kv_pressure_weight_s, mean_prefill_tokens, tail_quantile: see ``policies.cost_model.CostParams``.
        seed: accepted so every policy takes ``seed``; deterministic, ignored.
    """

    name = "pd_ttft"

    def __init__(
        self,
        *,
        decode_prefills: bool = True,
        both_can_pair: bool = False,
        objective: Objective | None = None,
        p_confirmed: float = 0.995,
        confirmed_decay_s: float = 0.0,
        p_predicted: float = 0.8,
        predicted_decay_s: float = 120.0,
        kv_pressure_threshold: float = 0.8,
        kv_pressure_weight_s: float = 0.05,
        mean_prefill_tokens: int = 1024,
        tail_quantile: float = 0.99,
        seed: int = 0,
    ) -> None:
        self.rules = RoleRules(decode_prefills=decode_prefills, both_can_pair=both_can_pair)
        self.objective = objective
        self.params = CostParams(
            p_confirmed=p_confirmed,
            confirmed_decay_s=confirmed_decay_s,
            p_predicted=p_predicted,
            predicted_decay_s=predicted_decay_s,
            kv_pressure_threshold=kv_pressure_threshold,
            kv_pressure_weight_s=kv_pressure_weight_s,
            mean_prefill_tokens=mean_prefill_tokens,
            tail_quantile=tail_quantile,
        )
        self.seed = seed

    def choose_plan(self, request: RouteRequest, candidates: Sequence[PdCandidate],
                    link: HandoffLink) -> PlanDecision:
        """Price every feasible plan and return them best first (ties: in place first, then candidate order)."""
        require_pd_candidates(candidates)
        tail = (self.objective or request.objective) == "tail"
        loads = read_loads(candidates, self.params.mean_prefill_tokens)
        prefill = [self._prefill(request, c, loads, i, tail) for i, c in enumerate(candidates)]
        plans = self._in_place_plans(request, candidates, prefill)
        plans += self._pd_plans(request, candidates, prefill, loads, link)
        if not plans:
            raise no_feasible_plan(candidates)
        plans.sort(key=lambda p: p.predicted_ttft_s)  # stable: in place first on ties
        branch = "in_place" if plans[0].kind == "in_place" else "disaggregated"
        return decision_of(self.name, plans, branch)

    def _prefill(self, request: RouteRequest, cand: PdCandidate, loads: Loads, i: int, tail: bool) -> _Prefill:
        """The cost-model estimate of prefilling ``request`` on candidate ``i`` (seconds)."""
        prof = cand.candidate.profile
        rate = prof.prefill_tokens_per_s
        if not rate > 0.0:
            raise ValueError(f"replica {cand.name!r}: prefill_tokens_per_s must be > 0, got {rate!r}")
        q = loads.backlog_tokens[i] / rate + prof.decode_interference_s * loads.running[i]
        est = estimate(request.prompt_tokens, cand.candidate.hit, q, prof, rate, prof.fixed_overhead_s,
                       self.params, loads.kv_usage[i])
        ttft = (est.tail if tail else est.expected) - est.kv_penalty
        return _Prefill(q=q, r=est.r, c=est.c, ttft=ttft, usable=est.usable_tokens, kv_penalty=est.kv_penalty)

    def _in_place_plans(self, request: RouteRequest, cands: Sequence[PdCandidate],
                        prefill: list[_Prefill]) -> list[Plan]:
        """One ``in_place`` plan per replica allowed to serve alone."""
        out = []
        for i in positions(cands, self.rules.can_serve_in_place):
            e = prefill[i]
            terms = {"Q": e.q, "R": e.r, "C": e.c, "kv_penalty": e.kv_penalty, "usable": float(e.usable)}
            out.append(Plan(kind="in_place", decode=cands[i].index, predicted_ttft_s=e.ttft + e.kv_penalty,
                            terms=terms, prefill_tokens=request.prompt_tokens - e.usable))
        return out

    def _pd_plans(self, request: RouteRequest, cands: Sequence[PdCandidate], prefill: list[_Prefill],
                  loads: Loads, link: HandoffLink) -> list[Plan]:
        """One ``disaggregated`` plan per (prefill-capable, decode-capable) pair of distinct replicas."""
        ps = positions(cands, self.rules.can_prefill_leg)
        ds = positions(cands, self.rules.can_decode_leg)
        if not ps or not ds:
            return []
        n = request.prompt_tokens
        decode_side = [self._decode_side(request, cands[d], loads, d) for d in ds]
        out = []
        for p in ps:
            e = prefill[p]
            pc = cands[p]
            bpt = pc.candidate.profile.bytes_per_token
            for d, (moved, ready, step, pen) in zip(ds, decode_side, strict=True):
                if d == p:
                    continue
                wait = pc.link_busy_s - e.ttft if pc.link_busy_s > e.ttft else 0.0
                handoff = wait + link.transfer_s(moved * bpt)
                arrive = e.ttft + handoff
                first = (ready - arrive if ready > arrive else 0.0) + step + pen
                terms = {"Q_p": e.q, "R_p": e.r, "C_p": e.c, "handoff": handoff, "link_wait": wait,
                         "D_ready": ready, "decode_step": step, "decode_first": first, "kv_penalty": pen,
                         "moved_tokens": float(moved), "usable": float(e.usable)}
                out.append(Plan(kind="disaggregated", decode=cands[d].index, prefill=pc.index,
                                predicted_ttft_s=arrive + first, terms=terms, prefill_tokens=n - e.usable,
                                handoff_tokens=moved))
        return out

    def _decode_side(self, request: RouteRequest, cand: PdCandidate, loads: Loads,
                     d: int) -> tuple[int, float, float, float]:
        """For decode candidate ``d``: (tokens to move, seconds until it is free of its own prefill work,
        seconds of its first decode round with the request in its batch, KV-pressure penalty seconds)."""
        prof = cand.candidate.profile
        n = request.prompt_tokens
        moved = n - gpu_hit_tokens(cand.candidate, n, request.block_size)
        ready = loads.backlog_tokens[d] / prof.prefill_tokens_per_s
        step = prof.decode_step_s + prof.decode_step_s_per_request * (loads.running[d] + 1.0)
        return moved, ready, step, kv_penalty_s(loads.kv_usage[d], self.params)

    def observe(self, observation: Observation) -> None:
        """Feedback is not used yet (the profiles carry the rates)."""
