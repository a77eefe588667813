"""``pd_smg``: SGLang Model Gateway's PD router, an independent prefill policy and decode policy.

Mimics SMG (``sgl-model-gateway``, formerly ``sgl-router``; ``routers/http/pd_router.rs``): the prefill worker
and the decode worker are chosen independently, each by its own load-balancing policy over its own pool
(``--prefill-policy``, ``--decode-policy``); the recommended setup is ``cache_aware`` on prefill and
``power_of_two`` on decode. Every request is disaggregated when the fleet has both pools (SMG's PD mode has
no in-place path); a fleet of ``both`` replicas is served in place by the prefill policy. Nothing is priced in
seconds (``predicted_ttft_s`` 0). The caller charges both legs (``plan_charges``) before dispatch, which fixes
SMG's own bug class (smg #1714) in this baseline: the comparison is about the choice, not about the bug.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Observation, RouteRequest, make_policy
from policies.pd_base import HandoffLink, PdCandidate, PlanDecision, register_pd
from policies.pd_common import RoleRules, two_pool_plan


@register_pd("pd_smg")
class PdSmgPolicy:
    """Prefill by ``prefill_policy`` over the prefill pool, decode by ``decode_policy`` over the decode pool.

    Args:
        prefill_policy: co-located policy name for the prefill pool (``sglang_cache_aware``).
        decode_policy: co-located policy name for the decode pool (``power_of_two``).
        seed: seeds both sub-policies.
        both_can_pair: ``both`` replicas may take either leg.
    """

    name = "pd_smg"

    def __init__(
        self,
        *,
        prefill_policy: str = "sglang_cache_aware",
        decode_policy: str = "power_of_two",
        seed: int = 0,
        both_can_pair: bool = False,
    ) -> None:
        self.prefill = make_policy(prefill_policy, seed=seed)
        self.decode = make_policy(decode_policy, seed=seed + 1)
        self.rules = RoleRules(decode_prefills=False, both_can_pair=both_can_pair)

    def choose_plan(
        self, request: RouteRequest, candidates: Sequence[PdCandidate], link: HandoffLink
    ) -> PlanDecision:
        """Independent picks in the two pools; in place by the prefill policy when there is no pair."""
        return two_pool_plan(
            self.name, self.prefill, self.decode, self.rules, request, candidates, "independent_pair"
        )

    def observe(self, observation: Observation) -> None:
        """Pass feedback to both sub-policies."""
        self.prefill.observe(observation)
        self.decode.observe(observation)
