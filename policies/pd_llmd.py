"""``pd_llmd``: llm-d's disaggregated profile, decode first, then the prefix-based PD decider.

Mimics llm-d's inference scheduler (``disagg-profile-handler`` with ``prefix-based-pd-decider``,
``pkg/plugins/profile/prefix_based_pd_decider.go``): the decode profile runs first and picks the decode pod by
its scorers (prefix + KV utilisation + queue, ``policies.llmd_weighted``); the decider then disaggregates iff the
prompt's tokens not cached on *that decode pod* are at least ``non_cached_tokens``
(``(1 - hit%) x prompt tokens >= nonCachedTokens``); only then does the prefill profile pick a prefill pod by
the same scorers over the prefill pool. Otherwise the decode pod serves the request in place (its sidecar runs
prefill locally when no ``x-prefiller-host-port`` is set). llm-d's default ``nonCachedTokens`` is 0, which turns
disaggregation off; its guides configure a positive value, ``128`` here (as in the decider's troubleshooting
docs). A fleet without decode replicas is served in place by the decode profile over the ``both`` replicas.
Nothing is priced in seconds (``predicted_ttft_s`` 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Observation, RouteRequest, make_policy
from policies.pd_base import HandoffLink, PdCandidate, PlanDecision, register_pd
from policies.pd_common import (
    RoleRules,
    decision_of,
    in_place_plan,
    in_place_positions,
    no_feasible_plan,
    pd_plan,
    pick_in_pool,
    positions,
    require_pd_candidates,
    usable_hit_tokens,
)


@register_pd("pd_llmd")
class PdLlmdPolicy:
    """Decode pod by llm-d's scorers, then disaggregate iff its uncached suffix >= ``non_cached_tokens``.

    Args:
        non_cached_tokens: the decider's ``nonCachedTokens`` threshold, tokens (0 = never disaggregate).
        seed: seeds the scorers' random tie-breaks.
        both_can_pair: ``both`` replicas may take either leg.
    """

    name = "pd_llmd"

    def __init__(self, *, non_cached_tokens: int = 128, seed: int = 0, both_can_pair: bool = False) -> None:
        if non_cached_tokens < 0:
            raise ValueError("non_cached_tokens must be >= 0")
        self.non_cached_tokens = non_cached_tokens
        self.decode = make_policy("llmd_weighted", seed=seed)
        self.prefill = make_policy("llmd_weighted", seed=seed + 1)
        self.rules = RoleRules(decode_prefills=True, both_can_pair=both_can_pair)

    def choose_plan(
        self, request: RouteRequest, candidates: Sequence[PdCandidate], link: HandoffLink
    ) -> PlanDecision:
        """Decode first; the decider; the prefill pick only when disaggregating."""
        require_pd_candidates(candidates)
        n, bs = request.prompt_tokens, request.block_size
        ds = positions(candidates, self.rules.can_decode_leg) or in_place_positions(candidates, self.rules)
        if not ds:
            raise no_feasible_plan(candidates)
        d = pick_in_pool(self.decode, request, candidates, ds)
        ps = [i for i in positions(candidates, self.rules.can_prefill_leg) if i != d]
        uncached = n - usable_hit_tokens(candidates[d].candidate, n, bs)
        alone = d in in_place_positions(candidates, self.rules)
        if ps and (not alone or (self.non_cached_tokens > 0 and uncached >= self.non_cached_tokens)):
            p = pick_in_pool(
                self.prefill, request, candidates, ps
            )  # (a decode pod that cannot serve alone: always)
            return decision_of(self.name, [pd_plan(candidates, p, d, n, bs)], "decider_disaggregate")
        if not alone:
            raise no_feasible_plan(candidates)
        return decision_of(self.name, [in_place_plan(candidates, d, n, bs)], "decider_in_place")

    def observe(self, observation: Observation) -> None:
        """llm-d's scorers take no feedback here."""
