"""``pd_ttft``: kvroute's PD plan choice, every feasible plan priced in seconds of predicted TTFT.

For a prompt of ``N`` tokens (seeds 000 §9.2, TV-14; 002 item 1.2; DESIGN §4, §10):

* **in place** on replica X (a ``both`` replica, or a ``decode`` replica prefilling itself)::

      TTFT = Q_X + R_X + C_X        (or max(Q, R) + C: ``policies.cost_model``, exactly ``ttft``'s estimate)

  The first token comes out of X's own prefill; X's running decode batch slows it through
  ``decode_interference_s`` per running request (in ``Q``).

* **disaggregated**, prefill on P, decode on D::

      T_p      = Q_p + R_p + C_p                                  (``ttft``'s estimate on P)
      handoff  = max(0, link_busy_p - T_p) + latency + moved * bytes_per_token / bandwidth
      moved    = N - (prompt tokens D already holds in GPU)       (the whole prompt's KV, TV-14: 1.125 GiB,
                                                                   even when P had most of it cached)
      D_ready  = backlog_D / rate_D                               (prefill work D itself has queued, FCFS)
      decode_first = max(0, D_ready - (T_p + handoff)) + decode_step_s + decode_step_s_per_request
                     * (running_D + 1) + kv_penalty(D)
      TTFT     = T_p + handoff + decode_first

  ``decode_step_s + decode_step_s_per_request * (running_D + 1)`` is one decode round of D's running batch
  with the request in it (TV-16: 26.26 ms at batch 1 .. 29.63 ms at batch 64). D's queue of its own prefill
  work drains while P computes and the KV moves, hence the ``max``. Handoffs from one prefill replica are
  serialised on its link (``PdCandidate.link_busy_s``, seconds of handoffs already queued there).

The prefill side of every plan is the ``ttft`` policy itself (``policies.ttft.TTFTPolicy``, run over all the
candidates once per request): the same cost model, hit probabilities, online calibration (``observe``), and its
fleet terms ``W`` (the work term: the request's own prefill seconds, the delay it imposes on requests queued
behind it; the migration penalty). Plans are ranked by ``TTFT + W`` of the prefilling replica, and
``predicted_ttft_s`` is the TTFT alone. So a short prompt, or a decode replica that already holds most of the
prefix (little to recompute, nothing to move), is served in place, and a long uncached prompt goes to an idle
prefill replica when its prefill plus the handoff beat the in-place prefill on the decode side.

**What the caller must charge** (``policies.pd_base.plan_charges``): at dispatch, before either leg runs,
``inflight_requests += 1`` on P and on D, and ``inflight_prefill_tokens += plan.prefill_tokens`` on the replica
that prefills (P, or X in place). P's prefill tokens end at its first token, its request with the prefill leg
(the handoff), D's with the request. The simulator (``loadtest.pd_simulator``) does exactly this. Without the
charge on P before dispatch, a burst sees every prefill replica idle and picks prefill #0 every time (sglang
#27547, smg #1714).

Terms per plan (seconds unless named tokens): in place ``Q``, ``R``, ``C``, ``kv_penalty``, ``W``; disaggregated
``Q_p``, ``R_p``, ``C_p``, ``handoff``, ``link_wait``, ``D_ready``, ``decode_step``, ``decode_first``,
``kv_penalty``, ``W``, ``moved_tokens``; both carry ``usable`` (reused tokens on the prefilling replica).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policies.base import Observation, RouteRequest
from policies.cost_model import kv_penalty_s
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
from policies.ttft import TTFTPolicy


@dataclass(frozen=True, slots=True)
class _Prefill:
    """One candidate's prefill estimate from the ``ttft`` model (seconds, tokens).

    ``ttft`` is the predicted time to the prefill's end (``E[T]``, or the tail quantile); ``extra`` the rest of
    ``ttft``'s score (``W``: the work term and the migration penalty), which ranks plans but is not a time.
    """

    q: float
    r: float
    c: float
    ttft: float
    extra: float
    usable: int
    kv_penalty: float


@register_pd("pd_ttft")
class PdTtftPolicy:
    """Lowest predicted TTFT over every feasible plan (in place, or any prefill/decode pair).

    The prefill side of every plan is the ``ttft`` policy's model (``policies.ttft.TTFTPolicy``: tiered cost
    model, hit probabilities, calibration from ``observe``, the work term and the migration penalty), so a
    plan's rank is ``ttft``'s score of its prefilling replica plus, for a disaggregated plan, the handoff and
    the first decode step. ``predicted_ttft_s`` leaves out the work term and the migration penalty (term ``W``).

    Args:
        decode_prefills: a ``decode`` replica may serve in place (prefill itself).
        both_can_pair: ``both`` replicas may take either leg of a disaggregated plan.
        seed: seeds the inner ``ttft`` model (deterministic).
        **ttft_params: parameters of the inner ``ttft`` model (``objective``, ``work_weight``,
            ``migration_weight``, ``p_predicted``, ...; see ``policies.ttft.TTFTPolicy``).
    """

    name = "pd_ttft"

    def __init__(self, *, decode_prefills: bool = True, both_can_pair: bool = False, seed: int = 0,
                 **ttft_params: Any) -> None:
        self.rules = RoleRules(decode_prefills=decode_prefills, both_can_pair=both_can_pair)
        self.model = TTFTPolicy(seed=seed, **ttft_params)
        self.params = self.model.params

    def choose_plan(self, request: RouteRequest, candidates: Sequence[PdCandidate],
                    link: HandoffLink) -> PlanDecision:
        """Price every feasible plan and return them best first (ties: in place first, then candidate order)."""
        require_pd_candidates(candidates)
        tail = (self.model.objective or request.objective) == "tail"
        loads = read_loads(candidates, self.params.mean_prefill_tokens)
        prefill = self._prefill(request, candidates, tail)
        ranked = self._in_place_plans(request, candidates, prefill)
        ranked += self._pd_plans(request, candidates, prefill, loads, link)
        if not ranked:
            raise no_feasible_plan(candidates)
        ranked.sort(key=lambda kp: kp[0])  # stable: in place first on ties
        plans = [p for _, p in ranked]
        branch = "in_place" if plans[0].kind == "in_place" else "disaggregated"
        return decision_of(self.name, plans, branch)

    def _prefill(self, request: RouteRequest, cands: Sequence[PdCandidate], tail: bool) -> list[_Prefill | None]:
        """Per candidate, the ``ttft`` model's estimate of prefilling ``request`` there (None: unscorable)."""
        decision = self.model.choose(request, [c.candidate for c in cands])
        out: list[_Prefill | None] = []
        for sc in decision.scores:
            pa = sc.parts
            if pa.get("excluded") or not sc.score < float("inf"):
                out.append(None)
                continue
            t = pa["tail"] if tail else pa["E"]
            out.append(_Prefill(q=pa["Q"], r=pa["R"], c=pa["C"], ttft=t, extra=sc.score - t,
                                usable=int(pa["usable"]), kv_penalty=pa["kv_penalty"]))
        return out

    def _in_place_plans(self, request: RouteRequest, cands: Sequence[PdCandidate],
                        prefill: list[_Prefill | None]) -> list[tuple[float, Plan]]:
        """(rank key, plan): one ``in_place`` plan per replica allowed to serve alone."""
        out = []
        for i in positions(cands, self.rules.can_serve_in_place):
            e = prefill[i]
            if e is None:
                continue
            terms = {"Q": e.q, "R": e.r, "C": e.c, "kv_penalty": e.kv_penalty, "W": e.extra,
                     "usable": float(e.usable)}
            plan = Plan(kind="in_place", decode=cands[i].index, predicted_ttft_s=e.ttft, terms=terms,
                        prefill_tokens=request.prompt_tokens - e.usable)
            out.append((e.ttft + e.extra, plan))
        return out

    def _pd_plans(self, request: RouteRequest, cands: Sequence[PdCandidate], prefill: list[_Prefill | None],
                  loads: Loads, link: HandoffLink) -> list[tuple[float, Plan]]:
        """(rank key, plan): one ``disaggregated`` plan per (prefill-capable, decode-capable) pair."""
        ps = positions(cands, self.rules.can_prefill_leg)
        ds = positions(cands, self.rules.can_decode_leg)
        if not ps or not ds:
            return []
        n = request.prompt_tokens
        decode_side = [self._decode_side(request, cands[d], loads, d) for d in ds]
        out = []
        for p in ps:
            e = prefill[p]
            if e is None:
                continue
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
                         "W": e.extra, "moved_tokens": float(moved), "usable": float(e.usable)}
                plan = Plan(kind="disaggregated", decode=cands[d].index, prefill=pc.index,
                            predicted_ttft_s=arrive + first, terms=terms, prefill_tokens=n - e.usable,
                            handoff_tokens=moved)
                out.append((arrive + first + e.extra, plan))
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
        """Prefill feedback calibrates the inner ``ttft`` model (rates and overheads per replica)."""
        self.model.observe(observation)
