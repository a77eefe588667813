"""``pd_ttft``: kvroute's PD plan choice, every feasible plan priced in seconds of predicted TTFT.

For a prompt of ``N`` tokens (seeds 000 §9.2, TV-14; 002 item 1.2; DESIGN §4, §10):

* **in place** on replica X (a ``both`` replica, or a ``decode`` replica prefilling itself)::

      TTFT = Q_X + R_X + C_X        (or max(Q, R) + C: ``policies.cost_model``, exactly ``ttft``'s estimate)

  The first token comes out of X's own prefill; X's running decode batch slows it through
  ``decode_interference_s`` per running request (in ``Q``). On a ``decode`` replica two decode-side terms
  (``policies.pd_decode``) are added: ``kv_wait``, the wait for its KV cache to admit the request (prompt +
  expected output beside what it holds, the in-place requests sent to it and the disaggregated requests reaching
  it first), in the TTFT; and ``decode_cost`` = ``decode_cost_weight`` x ``C_X`` x (the requests queued there +
  the disaggregated requests reaching it before X's prefill ends), in the rank only, like ``W``: every one of
  them gets its first token ``C_X`` later, because X's prefill chunks stretch D's rounds. Past capacity this
  is what keeps in-place plans from piling on a decode replica whose own disaggregated requests wait there.

* **disaggregated**, prefill on P, decode on D::

      T_p      = Q_p + R_p + C_p                                  (``ttft``'s estimate on P)
      handoff  = max(0, link_busy_p - T_p) + latency + moved * bytes_per_token / bandwidth
      moved    = N - (prompt tokens D already holds in GPU)       (the whole prompt's KV, TV-14: 1.125 GiB,
                                                                   even when P had most of it cached)
      D_ready  = backlog_D / rate_D                               (prefill work D itself has queued, FCFS)
      kv_wait  = the wait for D's KV cache to admit the request, reaching D at T_p + handoff
      decode_first = max(0, D_ready - (T_p + handoff), kv_wait) + decode_step_s
                     + decode_step_s_per_request * (running_D + 1) + kv_penalty(D)
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
(the handoff), D's with the request. The simulator (``sim.pd_simulator``) does exactly this. Without the
charge on P before dispatch, a burst sees every prefill replica idle and picks prefill #0 every time (sglang
#27547, smg #1714).

Terms per plan (seconds unless named tokens): in place ``Q``, ``R``, ``C``, ``kv_penalty``, ``W``, ``kv_wait``,
``decode_cost``; disaggregated ``Q_p``, ``R_p``, ``C_p``, ``handoff``, ``link_wait``, ``D_ready``, ``kv_wait``,
``decode_step``, ``decode_first``, ``kv_penalty``, ``W``, ``moved_tokens``; both carry ``usable`` (reused tokens
on the prefilling replica).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from policies.base import Candidate, Observation, RouteRequest
from policies.cost_model import kv_penalty_s
from policies.pd_base import HandoffLink, PdCandidate, Plan, PlanDecision, register_pd
from policies.pd_common import (
    Loads,
    RoleRules,
    decision_of,
    gpu_hit_tokens,
    in_place_positions,
    no_feasible_plan,
    positions,
    read_loads,
    require_pd_candidates,
)
from policies.pd_decode import DecodeSide, decode_side
from policies.ttft import TTFTPolicy

#: weight of one observation in the moving average of uncached tokens per request
_MEAN_ALPHA = 0.05


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
        age_inflight: give the ``ttft`` model each replica's backlog as max(the scraped queue less what the
            replica prefilled since the scrape, the router's in-flight tokens priced in seconds of the cost
            model and less ``LoadView.inflight_prefill_elapsed_s``) instead of their sum (``_aged``): of
            replicas with equal backlogs the one that started first is seen to finish first, a queued long
            prompt counts its attention time, and a stale scrape does not count a request twice. Off by default:
            on the seeds' 8192-in / 1025-out condition it lowers TTFT p99 (1.551 -> 1.274 s at load 0.5, 1.784
            -> 1.667 s at 0.9, 4 A100 + 4 H20), on the first 600 s of the conversation trace it raises p99
            (25.1 -> 27.9 s at 0.5, 28.4 -> 29.1 s at 0.9); docs/results.md, PD section.
        decode_cost_weight: weight of the ``decode_cost`` term of an in-place plan on a ``decode`` replica
            (seconds of TTFT the requests queued there lose to its prefill; ``policies.pd_decode``); 0 turns it
            off (``kv_wait`` stays: it is a prediction, not a cost).
        mean_output_tokens: output tokens assumed when the request does not say (``expected_output_tokens``):
            the KV a request needs on its decode replica and how long it holds it there, tokens.
        batch_weight: weight, relative to a queued request's TTFT, of the decode progress the running batch of a
            decode replica loses to an in-place prefill there (inter-token latency). 0 (default): measured past
            capacity, 0.25 or 1 keep long prompts off the decode replicas and roughly double the TTFT p99
            (docs/results.md, PD under overload).
        seed: seeds the inner ``ttft`` model (deterministic).
        **ttft_params: parameters of the inner ``ttft`` model (``objective``, ``work_weight``,
            ``migration_weight``, ``p_predicted``, ...; see ``policies.ttft.TTFTPolicy``).
    """

    name = "pd_ttft"

    def __init__(
        self,
        *,
        decode_prefills: bool = True,
        both_can_pair: bool = False,
        age_inflight: bool = False,
        decode_cost_weight: float = 1.0,
        mean_output_tokens: int = 256,
        batch_weight: float = 0.0,
        seed: int = 0,
        **ttft_params: Any,
    ) -> None:
        self.rules = RoleRules(decode_prefills=decode_prefills, both_can_pair=both_can_pair)
        self.age_inflight = age_inflight
        if not (decode_cost_weight >= 0 and batch_weight >= 0) or mean_output_tokens < 1:
            raise ValueError("decode_cost_weight, batch_weight must be >= 0 and mean_output_tokens >= 1")
        self.decode_cost_weight = decode_cost_weight
        self.mean_output_tokens = mean_output_tokens
        self.batch_weight = batch_weight
        self.model = TTFTPolicy(seed=seed, **ttft_params)
        #: mean uncached prompt tokens per request (exponential moving average over ``observe``), tokens
        self._mean_uncached = float(self.model.params.mean_prefill_tokens)
        self.params = self.model.params

    def choose_plan(
        self, request: RouteRequest, candidates: Sequence[PdCandidate], link: HandoffLink
    ) -> PlanDecision:
        """Price every feasible plan and return them best first (ties: in place first, then candidate order)."""
        require_pd_candidates(candidates)
        tail = (self.model.objective or request.objective) == "tail"
        loads = read_loads(candidates, self.params.mean_prefill_tokens)
        prefill = self._prefill(request, candidates, tail)
        sides = [
            decode_side(request, c, loads.running[i], self.mean_output_tokens)
            for i, c in enumerate(candidates)
        ]
        ranked = self._in_place_plans(request, candidates, prefill, sides)
        ranked += self._pd_plans(request, candidates, prefill, loads, link, sides)
        if not ranked:
            raise no_feasible_plan(candidates)
        ranked.sort(key=lambda kp: kp[0])  # stable: in place first on ties
        plans = [p for _, p in ranked]
        branch = "in_place" if plans[0].kind == "in_place" else "disaggregated"
        return decision_of(self.name, plans, branch)

    def _prefill(
        self, request: RouteRequest, cands: Sequence[PdCandidate], tail: bool
    ) -> list[_Prefill | None]:
        """Per candidate, the ``ttft`` model's estimate of prefilling ``request`` there (None: unscorable)."""
        decision = self.model.choose(request, [self._aged(c.candidate) for c in cands])
        out: list[_Prefill | None] = []
        for sc in decision.scores:
            pa = sc.parts
            if pa.get("excluded") or not sc.score < float("inf"):
                out.append(None)
                continue
            t = pa["tail"] if tail else pa["E"]
            out.append(
                _Prefill(
                    q=pa["Q"],
                    r=pa["R"],
                    c=pa["C"],
                    ttft=t,
                    extra=sc.score - t,
                    usable=int(pa["usable"]),
                    kv_penalty=pa["kv_penalty"],
                )
            )
        return out

    def _aged(self, cand: Candidate) -> Candidate:
        """``cand`` with its prefill backlog as the ``ttft`` model should see it (see ``age_inflight``).

        * In flight: ``inflight_prefill_tokens`` over ``k = inflight_requests`` prompts of equal length take
          ``tokens / rate + attention * tokens**2 / (2 k)`` seconds, of which ``inflight_prefill_elapsed_s``
          are done; the rest goes back as ``rate x remaining seconds`` tokens (so ``Q`` is those seconds).
        * Scraped: the engine's reported queue (``queued_prefill_tokens``, else ``queued_requests`` x the mean
          uncached tokens per request seen in ``observe``) less what it prefilled since the scrape
          (``rate x age_s``). It is the same work as the router's in-flight tokens when this router feeds the
          replica, so only its excess over them is kept: backlog = max(scraped, in flight), not their sum.

        A gauge the replica does not report stays unknown (the ``ttft`` model then assumes the worst known).
        The candidate itself is not changed.
        """
        load = cand.load
        if not self.age_inflight:
            return cand
        cal = self.model.calibrated(cand.index)
        rate = cal[0] if cal is not None else cand.profile.prefill_tokens_per_s
        tokens = load.inflight_prefill_tokens
        left = 0
        if tokens > 0:
            k = max(1, load.inflight_requests)
            total_s = tokens / rate + cand.profile.attention_s_per_token2 * tokens * tokens / (2.0 * k)
            left_s = total_s - load.inflight_prefill_elapsed_s
            left = int(rate * left_s) if left_s > 0.0 else 0
        if load.queued_prefill_tokens is not None:
            scraped: float | None = float(load.queued_prefill_tokens)
        elif load.queued_requests is not None:
            scraped = load.queued_requests * self._mean_uncached
        else:
            scraped = None
        if scraped is None:
            if left == tokens:
                return cand
            return replace(cand, load=replace(load, inflight_prefill_tokens=left))
        scraped -= rate * (load.age_s or 0.0)
        excess = int(scraped - left) if scraped > left else 0
        return replace(cand, load=replace(load, inflight_prefill_tokens=left, queued_prefill_tokens=excess))

    def _in_place_plans(
        self,
        request: RouteRequest,
        cands: Sequence[PdCandidate],
        prefill: list[_Prefill | None],
        sides: list[DecodeSide],
    ) -> list[tuple[float, Plan]]:
        """(rank key, plan): one ``in_place`` plan per replica allowed to serve alone. On a ``decode`` replica the
        plan also waits for its KV to fit (``kv_wait``) and is charged the TTFT its prefill takes from the requests
        queued there and arriving before it ends (``decode_cost``, ranked like ``W``)."""
        out = []
        need = request.prompt_tokens + (request.expected_output_tokens or self.mean_output_tokens)
        for i in in_place_positions(cands, self.rules):
            e = prefill[i]
            if e is None:
                continue
            wait = cost = 0.0
            if cands[i].role == "decode":
                wait = sides[i].kv_wait_s(need)
                cost = self.decode_cost_weight * sides[i].in_place_cost_s(
                    e.c, e.ttft + wait, self.batch_weight
                )
            terms = {
                "Q": e.q,
                "R": e.r,
                "C": e.c,
                "kv_penalty": e.kv_penalty,
                "W": e.extra,
                "usable": float(e.usable),
                "kv_wait": wait,
                "decode_cost": cost,
            }
            plan = Plan(
                kind="in_place",
                decode=cands[i].index,
                predicted_ttft_s=e.ttft + wait,
                terms=terms,
                prefill_tokens=request.prompt_tokens - e.usable,
            )
            out.append((e.ttft + wait + e.extra + cost, plan))
        return out

    def _pd_plans(
        self,
        request: RouteRequest,
        cands: Sequence[PdCandidate],
        prefill: list[_Prefill | None],
        loads: Loads,
        link: HandoffLink,
        sides: list[DecodeSide],
    ) -> list[tuple[float, Plan]]:
        """(rank key, plan): one ``disaggregated`` plan per (prefill-capable, decode-capable) pair; the first
        decode round waits for D's own prefill work and for its KV to fit, whichever is later."""
        ps = positions(cands, self.rules.can_prefill_leg)
        ds = positions(cands, self.rules.can_decode_leg)
        if not ps or not ds:
            return []
        n = request.prompt_tokens
        need = n + (request.expected_output_tokens or self.mean_output_tokens)
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
                kv_wait = sides[d].kv_wait_s(need, arrive)
                first = max(ready - arrive, kv_wait, 0.0) + step + pen
                terms = {
                    "Q_p": e.q,
                    "R_p": e.r,
                    "C_p": e.c,
                    "handoff": handoff,
                    "link_wait": wait,
                    "D_ready": ready,
                    "kv_wait": kv_wait,
                    "decode_step": step,
                    "decode_first": first,
                    "kv_penalty": pen,
                    "W": e.extra,
                    "moved_tokens": float(moved),
                    "usable": float(e.usable),
                }
                plan = Plan(
                    kind="disaggregated",
                    decode=cands[d].index,
                    prefill=pc.index,
                    predicted_ttft_s=arrive + first,
                    terms=terms,
                    prefill_tokens=n - e.usable,
                    handoff_tokens=moved,
                )
                out.append((arrive + first + e.extra, plan))
        return out

    def _decode_side(
        self, request: RouteRequest, cand: PdCandidate, loads: Loads, d: int
    ) -> tuple[int, float, float, float]:
        """For decode candidate ``d``: (tokens to move, seconds until it is free of its own prefill work,
        seconds of its first decode round with the request in its batch, KV-pressure penalty seconds)."""
        prof = cand.candidate.profile
        n = request.prompt_tokens
        moved = n - gpu_hit_tokens(cand.candidate, n, request.block_size)
        ready = loads.backlog_tokens[d] / prof.prefill_tokens_per_s
        step = prof.decode_step_s + prof.decode_step_s_per_request * (loads.running[d] + 1.0)
        return moved, ready, step, kv_penalty_s(loads.kv_usage[d], self.params)

    def observe(self, observation: Observation) -> None:
        """Prefill feedback calibrates the inner ``ttft`` model (rates and overheads per replica) and the mean
        uncached tokens per request that prices a scraped queue length."""
        self.model.observe(observation)
        uncached = max(0, observation.prompt_tokens - observation.cached_tokens)
        self._mean_uncached += _MEAN_ALPHA * (uncached - self._mean_uncached)
